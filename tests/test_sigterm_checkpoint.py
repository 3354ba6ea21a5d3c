"""A training run stopped by SIGTERM writes a final checkpoint, and --resume continues from it."""
import os
import signal
import subprocess
import sys
import time

from autoparallel.testing.launch import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")


def test_sigterm_saves_a_final_checkpoint_between_the_periodic_ones(tmp_path):
    ckpt = tmp_path / "ck"
    env = child_env(dict(OMP_NUM_THREADS="1"))
    cmd = [sys.executable, SCRIPT, "--steps", "100000", "--save-every", "1000", "--seed", "0",
           "--ckpt-dir", str(ckpt)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        head = b""
        while b"train:" not in head and time.time() < deadline:    # the progress bar: inside the loop
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            head += chunk
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
        out = head + out
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out.decode()[-2000:]
    steps = sorted(int(d.split("-")[1]) for d in os.listdir(ckpt) if d.startswith("step-") and "." not in d)
    assert len(steps) == 1 and 0 < steps[0] < 1000, steps   # not a periodic save: the SIGTERM one
    resumed = subprocess.run([sys.executable, SCRIPT, "--steps", str(steps[0] + 2), "--save-every", "1000",
                              "--seed", "0", "--ckpt-dir", str(ckpt), "--resume"], env=env,
                             capture_output=True, timeout=120)
    assert resumed.returncode == 0, resumed.stdout.decode()[-2000:] + resumed.stderr.decode()[-2000:]
    assert b"2 steps" in resumed.stdout
