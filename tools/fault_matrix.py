"""Fault matrix on real gloo ranks: SIGKILL and SIGSTOP of one rank during a forward, a backward, a checkpoint
save and a checkpoint load of the training example (examples/train_gpt.py, default watchdog settings).

For every case it measures the seconds from the fault until every surviving rank has exited, checks that
each survivor's log names the lost rank and its own operation in flight ("autoparallel watchdog: rank R:
rank V lost ..."), and checks the checkpoint root after: the previous good checkpoint verifies, which
partial directories were left, and ``--resume`` continues to the same final parameters (sha256 of every
rank's parameters) and losses as an uninterrupted run.

    python tools/fault_matrix.py                      # 8 cases, 4 ranks (DP2 x TP2), victim rank 1
    python tools/fault_matrix.py --cases save:stop,forward:kill --victim 0 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from autoparallel.testing.events import events_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tools", "_fault_worker.py")
PHASES = ("forward", "backward", "save", "load")
SIGNALS = ("kill", "stop")
STEPS, SAVE_EVERY, AT = 6, 2, 4          # the fault comes in the 4th forward/backward, the 2nd save
FLAKES = ("Connection refused", "pair closure", "TIMEOUT self_rank")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def launch(base: str, name: str, flags: list, nproc: int, fault: str = "", limit: float = 240.0, env=None) -> dict:
    """Run the example on ``nproc`` ranks; returns events, logs, exit code and survivor exit times."""
    out, logs = os.path.join(base, name), os.path.join(base, name + "-logs")
    os.makedirs(out)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOG_minloglevel="2",
               FLAGS_call_stack_level="0", AP_FAULT=fault, AP_FAULT_OUT=out,
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **(env or {}))
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc), "--log_dir", logs,
           WORKER, *flags]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    exits, start, fault_at = {}, time.monotonic(), None
    while proc.poll() is None and time.monotonic() - start < limit:
        events = events_of(out, nproc)
        faults = [e for evs in events.values() for e in evs if e["kind"] == "fault"]
        if faults:
            fault_at = faults[0]
            victim = next(r for r, evs in events.items() if faults[0] in evs)
            for r, evs in events.items():
                if r != victim and r not in exits and not _alive(evs[0]["pid"]):
                    exits[r] = time.time()
            if len(exits) == nproc - 1:
                _kill(evs_pid(events, victim))          # a stopped victim stays stopped otherwise
        time.sleep(0.05)
    timed_out = proc.poll() is None
    if timed_out:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    events = events_of(out, nproc)
    for r, evs in events.items():
        _kill(evs[0]["pid"])
    text = {}
    for r in range(nproc):
        path = os.path.join(logs, f"workerlog.{r}")
        text[r] = open(path, errors="replace").read() if os.path.exists(path) else ""
    return {"code": proc.returncode, "events": events, "logs": text, "exits": exits, "fault": fault_at,
            "timed_out": timed_out, "started": sorted(r for r, evs in events.items() if evs)}


def evs_pid(events: dict, rank: int) -> int:
    return events[rank][0]["pid"]


def _kill(pid: int) -> None:
    if _alive(pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"_fault_worker.py" not in f.read():
                    return
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def launch_retrying(base, name, flags, nproc, fault="", attempts=3, env=None) -> dict:
    """gloo sometimes fails a job's start-up on a loaded machine: run such a job again."""
    for attempt in range(attempts):
        run = launch(base, f"{name}-{attempt}", flags, nproc, fault, env=env)
        flaky = len(run["started"]) < nproc or (run["fault"] is None and run["code"] != 0 and any(
            f in t for t in run["logs"].values() for f in FLAKES))
        if not flaky:
            return run
    return run


def train_flags(ckpt: str, steps: int, resume: bool = False, nproc: int = 4) -> list:
    degrees = ["--dp", "2", "--tp", "2"] if nproc == 4 else ["--dp", str(nproc)]
    return degrees + ["--steps", str(steps), "--batch-size", "8", "--seq-len", "16",
            "--ckpt-dir", ckpt, "--save-every", str(SAVE_EVERY)] + (["--resume"] if resume else [])


def finals(run: dict) -> dict:
    return {r: next((e for e in evs if e["kind"] == "done"), None) for r, evs in run["events"].items()}


def ckpt_state(ckpt: str) -> dict:
    from autoparallel.checkpoint.discovery import complete_checkpoints, incomplete_checkpoints
    from autoparallel.checkpoint.verify import verify_checkpoint

    complete = complete_checkpoints(ckpt)
    verified = {}
    for step, path in complete:
        try:
            verify_checkpoint(path)
            verified[step] = True
        except Exception as e:          # reported, not raised: the matrix shows it
            verified[step] = f"{type(e).__name__}: {e}"
    return {"complete": [s for s, _ in complete], "verified": verified,
            "partial": [os.path.basename(p) for p in incomplete_checkpoints(ckpt)]}


def survivors_report(run: dict, victim: int, nproc: int) -> dict:
    fault = run["fault"]
    named, exited = {}, {}
    for r in range(nproc):
        if r == victim:
            continue
        lines = re.findall(rf"autoparallel watchdog: rank {r}: [^\r\n]*", run["logs"][r])
        named[r] = next((ln for ln in lines if f"rank {victim} lost" in ln or f"rank {victim} reported" in ln
                         or f"rank {victim} exited" in ln), lines[0] if lines else None)
        exited[r] = round(run["exits"][r] - fault["time"], 2) if fault and r in run["exits"] else None
    times = [t for t in exited.values() if t is not None]
    return {"seconds_to_all_exited": max(times) if len(times) == nproc - 1 else None, "per_rank": exited,
            "all_named": all(m is not None and f"rank {victim}" in m for m in named.values()),
            "messages": named}


def run_reference(base: str, nproc: int, env=None) -> dict:
    """The uninterrupted run every resume is compared with."""
    return launch_retrying(base, "reference", train_flags(os.path.join(base, "ckpt-ref"), STEPS, nproc=nproc), nproc,
                           env=env)


def run_case(base: str, phase: str, sig: str, victim: int, nproc: int, reference: dict = None, env=None) -> dict:
    """One fault; with a ``reference`` run, then ``--resume`` and a bit-for-bit comparison."""
    ckpt = os.path.join(base, f"ckpt-{phase}-{sig}-{victim}")
    if phase == "load":                  # a good checkpoint to resume from, then a resume that is hit
        launch_retrying(base, f"prep-{phase}-{sig}", train_flags(ckpt, SAVE_EVERY, nproc=nproc), nproc, env=env)
        fault, flags = f"load:{sig}:{victim}:1", train_flags(ckpt, STEPS, resume=True, nproc=nproc)
    else:
        nth = 2 if phase == "save" else AT
        fault, flags = f"{phase}:{sig}:{victim}:{nth}", train_flags(ckpt, STEPS, nproc=nproc)
    run = launch_retrying(base, f"fault-{phase}-{sig}-{victim}", flags, nproc, fault, env=env)
    result = {"case": f"{sig} rank {victim} during {phase}", "fault_injected": run["fault"] is not None,
              "launcher_exit": run["code"], **survivors_report(run, victim, nproc), "after": ckpt_state(ckpt),
              "run": run}
    if reference is None:
        return result
    resumed = launch_retrying(base, f"resume-{phase}-{sig}-{victim}",
                              train_flags(ckpt, STEPS, resume=True, nproc=nproc), nproc, env=env)
    got, want = finals(resumed), finals(reference)
    result["resume_exit"] = resumed["code"]
    result["resume_bit_for_bit"] = bool(got) and all(
        got.get(r) and want.get(r) and got[r]["params"] == want[r]["params"] for r in range(nproc))
    result["after_resume"] = ckpt_state(ckpt)
    if not result["resume_bit_for_bit"]:        # what differs, for the report
        result["mismatch"] = {r: {"resumed": (got.get(r) or {}).get("losses"), "reference": (want.get(r) or {}).get(
            "losses")} for r in range(nproc)}
    return result


def table(results: list) -> str:
    rows = ["| case | survivors exited after (s) | all named the rank | good checkpoint intact | partial dirs "
            "after fault / after resume | `--resume` bit for bit |", "|---|---|---|---|---|---|"]
    for r in results:
        after = r["after"]
        intact = bool(after["complete"]) and all(v is True for v in after["verified"].values())
        rows.append(f"| {r['case']} | {r['seconds_to_all_exited']} | {r['all_named']} | {intact} "
                    f"(steps {after['complete']}) | {len(after['partial'])} / {len(r['after_resume']['partial'])} "
                    f"| {r['resume_bit_for_bit']} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(f"{ph}:{s}" for ph in PHASES for s in SIGNALS),
                   help="comma-separated phase:signal pairs (phases forward backward save load; kill stop)")
    p.add_argument("--victim", type=int, default=1, help="the rank that is killed or stopped (default 1)")
    p.add_argument("--nproc", type=int, default=4, choices=(2, 4), help="ranks: 4 (DP2 x TP2, default) or 2 (DP2)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    args = p.parse_args(argv)
    cases = []
    for item in args.cases.split(","):
        phase, _, sig = item.partition(":")
        if phase not in PHASES or sig not in SIGNALS:
            p.error(f"--cases: expected phase:signal with phase in {PHASES} and signal in {SIGNALS}, got {item!r}")
        cases.append((phase, sig))
    if not 0 <= args.victim < args.nproc:
        p.error(f"--victim must be a rank in [0, {args.nproc}), got {args.victim}")
    from tqdm import tqdm

    base = tempfile.mkdtemp(prefix="ap_faults_")
    try:
        bar = tqdm(total=len(cases) + 1, desc="fault matrix", dynamic_ncols=True)
        reference = run_reference(base, args.nproc)
        if not all(finals(reference).values()) or len(finals(reference)) != args.nproc:
            print("the uninterrupted reference run failed:\n" + reference["logs"][0][-3000:], file=sys.stderr)
            return 1
        bar.update()
        results = []
        for phase, sig in cases:
            bar.set_postfix_str(f"{sig} during {phase}")
            result = run_case(base, phase, sig, args.victim, args.nproc, reference)
            result.pop("run")
            results.append(result)
            bar.update()
        bar.close()
    finally:
        if args.keep:
            print(f"run directories kept under {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
    print(table(results))
    for r in results:
        for rank, msg in r["messages"].items():
            print(f"  {r['case']}: rank {rank}: {re.sub(r' +', ' ', msg or 'NO WATCHDOG MESSAGE')[:400]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python tools/fault_matrix.py"] + list(argv or sys.argv[1:])),
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
