"""Every tool and example entry point, in this process: ``--help`` answers (exit 0, a usage line), the options a
run would ignore or cannot use are refused before any launch (exit 2, naming them), and the tools that need no
launch run on tiny inputs. The commands go through the paths users type: ``python -m tools.bench NAME``
(tools/bench/__main__.py), ``python tools/X.py`` and ``python examples/X.py`` (run as ``__main__``); the
``tools/bench_*.py`` shims re-execute ``python -m tools.bench NAME`` and are checked by reading them."""
import ast
import json
import pathlib
import re
import runpy
import sys

import pytest

from tools.bench import BENCHMARKS
from tools.bench import __main__ as bench_cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOLS, EXAMPLES = ROOT / "tools", ROOT / "examples"


def _is_shim(path) -> bool:
    return "os.execve" in path.read_text()


SHIMS = sorted(p for p in TOOLS.glob("*.py") if _is_shim(p))
SCRIPTS = sorted(p for p in TOOLS.glob("*.py") if not p.name.startswith("_") and not _is_shim(p))
EXAMPLE_SCRIPTS = [EXAMPLES / n for n in ("train_gpt.py", "train_llama.py", "reshard_demo.py", "article_program.py")]


def run_script(path, argv, monkeypatch) -> int:
    """``python PATH ARGV`` in this process; its exit code (every entry point ends in sys.exit)."""
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(path), run_name="__main__")
    return info.value.code or 0


def run_bench(argv, monkeypatch) -> int:
    """``python -m tools.bench ARGV`` in this process; its exit code."""
    monkeypatch.setattr(sys, "argv", ["tools.bench", *argv])
    try:
        return bench_cli.main(argv)
    except SystemExit as e:
        return e.code or 0


# ---- --help ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_every_benchmark_answers_help(name, monkeypatch, capsys):
    assert run_bench([name, "--help"], monkeypatch) == 0
    assert f"usage: python -m tools.bench {name}" in capsys.readouterr().out


def test_bench_without_a_name_lists_every_benchmark_and_refuses_an_unknown_one(monkeypatch, capsys):
    assert run_bench([], monkeypatch) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BENCHMARKS)
    assert run_bench(["no-such-bench"], monkeypatch) == 2
    assert "unknown benchmark 'no-such-bench'" in capsys.readouterr().err


@pytest.mark.parametrize("path", SCRIPTS + EXAMPLE_SCRIPTS, ids=lambda p: p.name)
def test_every_script_answers_help(path, monkeypatch, capsys):
    assert run_script(path, ["--help"], monkeypatch) == 0
    assert capsys.readouterr().out.startswith("usage:")


def test_custom_op_example_answers_help_and_refuses_options(capsys):
    import custom_op_rule

    with pytest.raises(SystemExit) as info:
        custom_op_rule.cli(["--help"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("usage:")
    with pytest.raises(SystemExit) as info:
        custom_op_rule.cli(["--world", "8"])
    assert info.value.code == 2 and "unrecognized arguments: --world 8" in capsys.readouterr().err


@pytest.mark.parametrize("path", SHIMS, ids=lambda p: p.name)
def test_every_shim_runs_a_known_benchmark(path):
    """``python tools/bench_X.py ARGS`` re-executes ``python -m tools.bench NAME ARGS``: NAME must exist and the
    arguments must be passed on."""
    calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
             and getattr(n.func, "attr", None) == "execve"]
    assert len(calls) == 1
    argv = calls[0].args[1]
    consts = [e.value for e in argv.elts if isinstance(e, ast.Constant)]
    assert consts[:2] == ["-m", "tools.bench"] and consts[2] in BENCHMARKS
    assert any(isinstance(e, ast.Starred) for e in argv.elts)          # *sys.argv[1:]


def test_every_entry_point_the_readme_names_is_covered_here():
    text = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    scripts = set(re.findall(r"\btools/([a-z][a-z_]*\.py)\b", text))      # not the ranks' _workers
    scripts |= set(re.findall(r"\bexamples/([a-z_]+\.py)\b", text))
    covered = {p.name for p in SCRIPTS + SHIMS + EXAMPLE_SCRIPTS} | {"custom_op_rule.py", "train_common.py"}
    assert scripts - covered == set()
    benches = set(re.findall(r"python -m tools\.bench ([a-z-]+)", text)) - {"NAME"}
    assert benches - set(BENCHMARKS) == set()


# ---- options a run cannot honour are refused before any launch ------------------------------------------------
@pytest.mark.parametrize("argv,message", [
    (["vs-paddle", "--categories", "--rounds", "3"], r"--out and --rounds do not apply"),
    (["vs-paddle", "--layouts", "TP3"], r"unknown layouts \['TP3'\]"),
    (["profile-step", "--repeat", "3"], r"--repeat 3 sets the forwards of --cprofile N, which is off"),
    (["profile-step", "--model", "tiny", "--hidden", "64"], r"--hidden do not apply"),
    (["predict", "--profile", "p.json", "--quick-calibrate"], r"with --profile it does not calibrate"),
    (["memory", "--steps", "1"], r"--steps >= 2"),
    (["memory", "--model", "gpt-9t"], r"unknown --model 'gpt-9t'"),
    (["lazy-init", "--model", "gpt-9t"], r"unknown --model 'gpt-9t'"),
    (["completion", "--steps", "2"], r"--steps must be >= 3"),
    (["dispatch", "--skip-gpt", "--rounds", "2"], r"--skip-gpt skips the part that --rounds set"),
    (["dispatch", "--skip-ops", "--skip-gpt"], r"leave nothing to measure"),
    (["pipeline", "--ranks", "1"], r"--ranks as comma-separated counts >= 2"),
    (["pipeline", "--ranks", "2,4", "--micro-batches", "2"], r"--ranks 4 --micro-batches 2: 1F1B needs micro_batches"),
    (["fused", "--batch", "3"], r"--batch a multiple of --dp"),
    (["reshard", "--repeats", "0"], r"--repeats >= 1"),
    (["reshard", "--sizes", "64,x"], r"--sizes: expected comma-separated integers"),
    (["planner", "--repeat", "0"], r"--repeat must be >= 1"),
    (["static", "--sizes", "huge"], r"unknown layout/size \['huge'\]"),
])
def test_bench_refuses_before_launching(argv, message, monkeypatch, capsys):
    assert run_bench(argv, monkeypatch) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("path,argv,message", [
    (EXAMPLES / "train_gpt.py", ["--auto", "--tp", "2"], r"--auto lets the planner choose .*--tp would be ignored"),
    (EXAMPLES / "train_gpt.py", ["--save-every", "3"], r"--save-every 3 needs --ckpt-dir"),
    (EXAMPLES / "train_llama.py", ["--static", "--ckpt-dir", "ck"], r"--ckpt-dir .* not supported with --static"),
    (EXAMPLES / "reshard_demo.py", [], r"one process is not a distributed job"),
    (EXAMPLES / "reshard_demo.py", ["--simulate", "3"], r"even number of ranks >= 2"),
    (TOOLS / "check_api_call_forms_dist.py", [], r"needs exactly 2 launched ranks"),
    (TOOLS / "check_vs_paddle_native.py", [], r"needs 2 or 4 launched ranks"),
    (TOOLS / "plot_schedule.py", ["--records", "run.json", "--pp", "2"], r"--pp do not apply"),
    (TOOLS / "plot_schedule.py", ["--weight", "1"], r"--weight is the weight-gradient time of ZB-H1, got .*'1F1B'"),
])
def test_script_refuses_what_it_would_ignore(path, argv, message, monkeypatch, capsys):
    assert run_script(path, argv, monkeypatch) == 2
    assert re.search(message, capsys.readouterr().err)


def test_example_flags_the_planner_leaves_alone_pass_with_auto():
    """Negative control of the refusals above: --auto with the run's own sizes and checkpointing is accepted."""
    import train_common

    parser = train_common.make_parser("gpt-tiny")
    args = parser.parse_args(["--auto", "--batch-size", "8", "--seq-len", "16", "--amp", "bfloat16",
                              "--ckpt-dir", "ck", "--save-every", "2"])
    train_common.check_args(parser, args, 4)


# ---- tiny runs of the tools that need no launch ---------------------------------------------------------------
def test_comm_overhead_runs_and_exits_zero(monkeypatch, capsys):
    assert run_bench(["comm-overhead", "--shape", "2", "3"], monkeypatch) == 0
    out = capsys.readouterr().out
    assert "tensor [2, 3] float32" in out and "count_comm wrapper around a no-op all_reduce" in out


@pytest.mark.parametrize("schedule,extra", [("1F1B", []), ("FThenB", []), ("VPP", ["--vpp", "2"]),
                                            ("ZB-H1", ["--weight", "1"])])
def test_plot_schedule_draws_and_reports_the_bubble(schedule, extra, tmp_path, monkeypatch, capsys):
    from autoparallel.parallel.pipeline import bubble_formula

    png = tmp_path / "s.png"
    argv = ["--schedule", schedule, "--pp", "2", "--micro-batches", "4", *extra, "--out", str(png)]
    assert run_script(TOOLS / "plot_schedule.py", argv, monkeypatch) == 0
    out = capsys.readouterr().out
    simulated = float(re.search(r"simulated bubble fraction ([0-9.]+)", out).group(1))
    assert png.stat().st_size > 1000
    if schedule in ("1F1B", "FThenB"):            # equal stages, B = 2F, no latency: the textbook value exactly
        assert simulated == pytest.approx(bubble_formula(schedule, 2, 4, 1), abs=1e-4)


def test_plot_schedule_draws_measured_records(tmp_path, monkeypatch, capsys):
    records = [[0, "F", 0, 0, 0.0, 1.0], [1, "F", 1, 0, 1.0, 2.0], [1, "B", 1, 0, 2.0, 4.0], [0, "B", 0, 0, 4.0, 6.0]]
    (tmp_path / "run.json").write_text(json.dumps(records))
    png = tmp_path / "m.png"
    argv = ["--records", str(tmp_path / "run.json"), "--out", str(png)]
    assert run_script(TOOLS / "plot_schedule.py", argv, monkeypatch) == 0
    measured = float(re.search(r"measured bubble fraction: ([0-9.]+)", capsys.readouterr().out).group(1))
    assert measured == pytest.approx(0.5) and png.stat().st_size > 1000      # each rank busy 3 of 6


def _log(path, losses):
    path.write_text(json.dumps({"world_size": 1, "steps": [{"step": i, "loss": l, "time": 0.1}
                                                           for i, l in enumerate(losses)]}))
    return str(path)


def test_compare_logs_passes_equal_curves_and_fails_different_ones(tmp_path, monkeypatch, capsys):
    a = _log(tmp_path / "a.json", [5.0, 4.0, 3.0])
    b = _log(tmp_path / "b.json", [5.0, 4.0 * (1 + 5e-5), 3.0])
    c = _log(tmp_path / "c.json", [5.0, 4.0 * (1 + 5e-3), 3.0])
    assert run_script(TOOLS / "compare_logs.py", [a, b], monkeypatch) == 0
    assert run_script(TOOLS / "compare_logs.py", [a, c], monkeypatch) != 0
    assert run_script(TOOLS / "compare_logs.py", [a, c, "--rtol", "1e-2"], monkeypatch) == 0
    assert run_script(TOOLS / "compare_logs.py", [a, _log(tmp_path / "d.json", [5.0])], monkeypatch) == 2
    capsys.readouterr()


def test_reshard_demo_runs_simulated(monkeypatch, capsys):
    assert run_script(EXAMPLES / "reshard_demo.py", ["--simulate", "4"], monkeypatch) == 0
    assert "summary: 7/7 reshards verified against the full tensor on 4 ranks" in capsys.readouterr().out


def test_planner_bench_helpers_on_a_small_job():
    """The planner benchmark's measuring helpers on LLaMA-2 7B on 8 GPUs (the full run takes minutes): every
    configuration priced is a valid one, and the best one is the one described."""
    from tools.bench import planner as bench

    seconds, result = bench.timed_plan(1, "llama2-7b", "1x8:A100-80GB", global_batch_size=16, seq_len=2048)
    valid = bench.valid_count("llama2-7b", "1x8:A100-80GB", 16, 2048)
    assert 0 < result.evaluated <= valid and seconds > 0
    assert bench.describe_best(result).startswith(result.best.config.short() + ":")
    assert bench.unpruned_seconds("llama2-7b", "1x8:A100-80GB", 16, 2048) > 0
