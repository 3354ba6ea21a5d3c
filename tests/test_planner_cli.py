"""`autoparallel plan` and `autoparallel calibrate`: outputs and exit codes."""
import json

import pytest

from autoparallel.cli import main as top_main
from autoparallel.planner import calibrate
from autoparallel.planner.cli import main

BASE = ["--model", "llama2-70b", "--cluster", "128x8:A100-80GB", "--global-batch", "1536", "--seq-len", "4096"]


def test_plan_table(capsys):
    assert main(BASE + ["--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "llama2-70b on 128x8:A100-80GB" in out and "Why #1" in out
    assert len([line for line in out.splitlines() if line.strip()[:2] in ("1 ", "2 ", "3 ")]) >= 3


def test_plan_json(capsys):
    assert top_main(["plan"] + BASE + ["--json", "--top", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["feasible"] is True and len(data["candidates"]) == 2
    best = data["candidates"][0]
    for key in ("dp", "tp", "pp", "vpp", "sp", "sharding_stage", "recompute", "offload", "micro_batch_size",
                "num_micro_batches", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu",
                "memory_per_device_gb", "feasible"):
        assert key in best
    assert best["dp"] * best["tp"] * best["pp"] == 1024


def test_fixed_json(capsys):
    fixed = "dp=32,tp=8,pp=4,micro_batch=1,recompute=selective,sharding=1"
    assert main(BASE + ["--fixed", fixed, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    c = data["candidates"][0]
    assert (c["dp"], c["tp"], c["pp"], c["recompute"], c["sharding_stage"], c["sp"]) == (32, 8, 4, "selective", 1, 0)
    assert c["num_micro_batches"] == 48 and data["mode"] == "fixed"


@pytest.mark.parametrize("args,match", [
    (["--model", "gpt9", "--cluster", "1x8:A100-80GB", "--global-batch", "8"], "unknown model"),
    (["--model", "llama2-7b", "--cluster", "1x8:TPU", "--global-batch", "8"], "unknown device"),
    (["--model", "llama2-7b", "--cluster", "8:A100", "--global-batch", "8"], "malformed cluster spec"),
    (["--model", "llama2-7b", "--cluster", "0x8:A100-80GB", "--global-batch", "8"], "zero devices"),
    (["--model", "llama2-7b", "--cluster", "1x8:A100-80GB", "--global-batch", "8", "--fixed", "tp=x"], "integer"),
    (["--model", "llama2-7b", "--cluster", "1x8:A100-80GB", "--global-batch", "12", "--fixed", "dp=8"],
     "not divisible"),
    (["--model", "llama2-7b", "--cluster", "1x8:A100-80GB", "--global-batch", "0"], "positive integer"),
    (["--model", "llama2-7b", "--cluster", "missing.json", "--global-batch", "8"], "missing.json"),
])
def test_bad_input_exits_2(capsys, args, match):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "error" in err and match in err


def test_missing_argument_exits_2(capsys):
    assert main(["--model", "llama2-7b"]) == 2
    assert "required" in capsys.readouterr().err


def test_infeasible_exits_1(capsys):
    assert main(["--model", "llama3-405b", "--cluster", "1x8:A100-40GB", "--global-batch", "16"]) == 1
    err = capsys.readouterr().err
    assert "smallest change that fits" in err and "nodes" in err


def test_infeasible_fixed_exits_1(capsys):
    args = ["--model", "llama2-7b", "--cluster", "1x8:A100-80GB", "--global-batch", "16", "--seq-len", "4096",
            "--fixed", "micro_batch=2", "--json"]
    assert main(args) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["feasible"] is False
    assert "smallest change that fits" in captured.err


def test_plot(tmp_path, capsys):
    path = tmp_path / "plan.png"
    assert main(["--model", "llama2-7b", "--cluster", "1x8:A100-80GB", "--global-batch", "64", "--top", "3",
                 "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibrate_in_process_writes_a_gloo_profile_usable_as_a_cluster(tmp_path, capsys):
    """--no-launch: matmul and bandwidth measured here, collectives assumed (the real-rank calibration is
    tests/test_planner_calibrate_dist.py)."""
    path = tmp_path / "cpu.json"
    assert calibrate.main(["-o", str(path), "--ranks", "2", "--matmul-size", "128", "--repeat", "2",
                           "--no-paddle", "--no-launch"]) == 0
    assert "GFLOP/s" in capsys.readouterr().out
    profile = json.loads(path.read_text())
    assert profile["backend"] == "gloo" and profile["overlap"] == 0.0 and profile["devices_per_node"] == 2
    assert main(["--model", "hidden=256,layers=4,heads=8,vocab=1024,seq=128", "--cluster", str(path),
                 "--global-batch", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["devices"] == 2 and data["feasible"]
    assert calibrate.main(["--ranks", "0", "-o", str(path)]) == 2
    assert calibrate.main(["--ranks", "1", "-o", str(path)]) == 2          # collectives need two ranks
