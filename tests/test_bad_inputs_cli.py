"""Bad inputs to every command line (``autoparallel plan | reshard | calibrate``, the training examples): exit code 2,
one line naming the flag with what was expected and what was given, no traceback, refused before any work, and
never a hang (every case runs under a deadline)."""
import os
import subprocess
import sys

import pytest

from autoparallel import cli
from bad_inputs_helpers import deadline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

PLAN = ["plan", "--model", "llama2-7b", "--cluster", "1x8:A100-80GB"]
RESHARD = ["reshard", "--shape", "4096,4096", "--mesh", "2x4", "--to", "R,S(1)"]

CASES = [
    (["frobnicate"], r"unknown command 'frobnicate'; expected one of"),
    (PLAN + ["--global-batch", str(10 ** 18)], r"--global-batch 1000000000000000000 exceeds 16,777,216 sequences"),
    (PLAN + ["--global-batch", "0"], r"--global-batch must be a positive integer, got 0"),
    (PLAN + ["--global-batch", "8", "--seq-len", str(10 ** 14)], r"--seq-len 100000000000000 exceeds 16,777,216"),
    (PLAN + ["--global-batch", str(2 ** 24), "--seq-len", str(2 ** 24)],
     r"--global-batch x --seq-len 281474976710656 exceeds 1,099,511,627,776 tokens per step"),
    (PLAN + ["--global-batch", "8", "--top", "0"], r"--top must be a positive integer, got 0"),
    (["plan", "--model", "hidden=32,layers=99999999999999999,heads=4,vocab=256", "--cluster", "1x8:A100-80GB",
      "--global-batch", "8"], r"--model layers=99999999999999999 exceeds 65,536, more than any model has"),
    (["plan", "--model", "hidden=32,layers=2,heads=4,vocab=99999999999999999999", "--cluster", "1x8:A100-80GB",
      "--global-batch", "8"], r"--model vocab=99999999999999999999 exceeds 1,073,741,824"),
    (["plan", "--model", "llama2-7b", "--cluster", "1x99999999999999999:A100-80GB", "--global-batch", "8"],
     r"--cluster 99999999999999999 exceeds 1,048,576 devices"),
    (PLAN + ["--global-batch", "8", "--plot", "/nonexistent-dir/plan.png"],
     r"--plot '/nonexistent-dir/plan.png': the directory '/nonexistent-dir' does not exist"),
    (PLAN + ["--global-batch", "8", "--plot", "plan.txt"], r"--plot 'plan.txt': expected a file ending in one of "
                                                            r"\.jpeg, \.jpg, \.pdf, \.png, \.svg, got \.txt"),
    (PLAN + ["--global-batch", "8", "--plot", "/tmp"], r"--plot '/tmp' is a directory, expected a file path"),
    (["reshard", "--shape", "99999999999,99999999999,999999999", "--mesh", "2x4", "--from", "S(0),R", "--to", "R,S(1)"],
     r"--shape \[99999999999, 99999999999, 999999999\] holds more than 72,057,594,037,927,936 bytes"),
    (["reshard", "--shape", "4,4", "--mesh", "100000x100000", "--to", "R,S(1)"],
     r"--mesh 100000x100000: its rank count 10000000000 exceeds 1,048,576 ranks"),
    (RESHARD + ["--cluster", "1x2:A100-80GB"], r"--cluster '1x2:A100-80GB' has 2 devices, fewer than the 8 ranks"),
    (RESHARD + ["--cluster", "1x99999999999999999:A100-80GB"], r"--cluster 99999999999999999 exceeds 1,048,576"),
    (RESHARD + ["--dtype", "float99"], r"unsupported dtype 'float99': expected one of"),
    (["calibrate", "-o", "/nonexistent-dir/profile.json"],
     r"--output '/nonexistent-dir/profile.json': the directory '/nonexistent-dir' does not exist"),
    (["calibrate", "-o", "/tmp"], r"--output '/tmp' is a directory"),
    (["calibrate", "-o", "profile.txt"], r"--output 'profile.txt': expected a file ending in one of \.json"),
    (["calibrate", "--ranks", "99999999"], r"--ranks 99999999 exceeds 1,024 ranks on one machine"),
    (["demo", "--nproc", "99999"], r"--nproc 99999 exceeds 256 ranks on one machine"),
    (["demo", "--nproc", "0"], r"--nproc expects a positive number of ranks, got 0"),
    (["demo", "--timeout", "-1"], r"--timeout expects a positive number of seconds, got -1.0"),
    (["demo", "--steps", "3"], r"the default script \(examples/reshard_demo.py\) takes no arguments, got \['--steps', '3'\]"),
]


@pytest.fixture
def no_work(monkeypatch):
    """Any planning, reshard search or measurement fails the test: bad input must be refused before."""
    import autoparallel.demo as demo
    import autoparallel.planner.api as api
    import autoparallel.planner.calibrate as calibrate
    import reshard.cli as reshard_cli

    def work(*a, **k):
        raise AssertionError("the command started its work before refusing the input")

    monkeypatch.setattr(api, "plan", work)
    monkeypatch.setattr(calibrate, "run_ranks", work)
    monkeypatch.setattr(calibrate, "_in_process", work)
    monkeypatch.setattr(reshard_cli, "plan_reshard", work)
    monkeypatch.setattr(demo, "run_once", work)


@pytest.mark.parametrize("argv,match", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_cli_input_exits_2_naming_it(argv, match, capsys, no_work):
    with deadline():
        try:
            code = cli.main(argv)
        except SystemExit as e:                      # argparse's own error exit (demo)
            code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    import re
    assert re.search(match, err), err


def test_good_cli_input_still_works(capsys):
    """Negative control: the neighbours of the cases above run."""
    with deadline():
        assert cli.main(RESHARD + ["--cluster", "1x8:A100-80GB"]) == 0
        assert cli.main(PLAN + ["--global-batch", "16", "--top", "1"]) == 0
    assert "R -> S(1)" in capsys.readouterr().out


def test_a_huge_batch_ends_in_seconds_as_a_process():
    """End to end: the command that used to enumerate 10^18 divisors exits 2 at once."""
    out = subprocess.run([sys.executable, "-m", "autoparallel", *PLAN, "--global-batch", str(10 ** 18)],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 2 and "exceeds 16,777,216 sequences per step" in out.stderr
    assert "Traceback" not in out.stderr


# ---- the training examples' flags -----------------------------------------------------------------------------
def parse(argv):
    import train_common

    parser = train_common.make_parser("gpt-tiny")
    return parser, parser.parse_args(argv)


def test_example_flags_as_users_type_them():
    from autoparallel.strategy import Strategy

    _, args = parse(["--recompute"])
    s = Strategy.from_args(args)
    assert args.recompute == "full" and s.recompute.enable and s.recompute.granularity == "full"
    _, args = parse(["--recompute", "selective"])
    assert Strategy.from_args(args).recompute.granularity == "selective"
    s = Strategy.from_args(parse(["--pp", "2", "--schedule", "VPP", "--micro-batches", "4"])[1])
    assert (s.pipeline_parallel.schedule, s.pipeline_parallel.vpp_degree) == ("VPP", 2)
    assert s.validate(world_size=2).vpp == 2
    s = Strategy.from_args(parse(["--pp", "2", "--schedule", "VPP", "--vpp", "3", "--micro-batches", "4"])[1])
    assert s.pipeline_parallel.vpp_degree == 3
    s = Strategy.from_args(parse(["--pp", "2"])[1])
    assert (s.pipeline_parallel.schedule, s.pipeline_parallel.vpp_degree) == ("1F1B", 1)
    assert parse([])[1].watchdog is True and parse(["--no-watchdog"])[1].watchdog is False


@pytest.mark.parametrize("argv,world,match", [
    (["--offload"], 1, r"single-process run cannot honour these flags: .*sharding.offload=True needs sharding"),
    (["--vpp", "2"], 1, r"(?s)single-process run cannot honour .*vpp_degree=2 needs pipeline_parallel.degree > 1"),
    (["--micro-batches", "4"], 1, r"single-process run cannot honour .*micro_batches=4 only applies when"),
    (["--schedule", "ZB-H1"], 1, r"--schedule ZB-H1 needs --pp > 1 \(got --pp 1\)"),
    (["--sp"], 1, r"sequence_parallel.enable=True needs tensor_parallel.degree > 1"),
    (["--dp", "2"], 4, r"this 4-rank run cannot honour .*2 x 1 x 1 = 2, expected the world size 4"),
])
def test_example_flags_a_run_cannot_honour_are_refused(argv, world, match, capsys):
    import re

    import train_common

    parser, args = parse(argv)
    with deadline(), pytest.raises(SystemExit) as info:
        train_common.check_args(parser, args, world)
    assert info.value.code == 2
    assert re.search(match, capsys.readouterr().err)
    train_common.check_args(*parse([]), 1)                 # negative control: the defaults pass


def test_single_process_example_refuses_offload_before_training():
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "train_gpt.py"), "--offload", "--steps", "1"],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert out.returncode == 2, out.stderr[-2000:]
    assert "cannot honour these flags" in out.stderr and "sharding.offload=True" in out.stderr
    assert "final loss" not in out.stdout and "Traceback" not in out.stderr


def _a_file(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    return f


def _user_dir(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("the user's own file")
    return d


@pytest.mark.parametrize("ckpt_dir,extra,match", [
    (_a_file, [], r"CheckpointRootError: .*a-file"),
    (_user_dir, [], r"CheckpointOwnershipError: .*mine"),
    (lambda t: t, ["--resume"], r"NoCheckpointToResume: --resume: no complete checkpoint under"),
], ids=["root-is-a-file", "root-holds-user-files", "resume-nothing"])
def test_example_refuses_a_checkpoint_root_in_one_line(tmp_path, capsys, ckpt_dir, extra, match):
    """A checkpoint root the run may not use ends the example with exit 2 and one line naming the error, before
    the first step, and leaves what was there byte-identical."""
    import re

    import train_common

    root = ckpt_dir(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with deadline(60), pytest.raises(SystemExit) as info:
        train_common.main("gpt-tiny", ["--steps", "2", "--ckpt-dir", str(root), *extra])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert re.search(match, err) and len(err.strip().splitlines()) == 1, err
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert {p: after.get(p) for p in before} == before              # the user's files byte-identical
    if not extra:
        assert after == before                                       # a refused root: nothing written


def test_example_resume_without_a_checkpoint_dir_is_a_flag_error(capsys):
    import train_common

    with deadline(), pytest.raises(SystemExit) as info:
        train_common.main("gpt-tiny", ["--resume"])
    assert info.value.code == 2
    assert "--resume needs --ckpt-dir" in capsys.readouterr().err
