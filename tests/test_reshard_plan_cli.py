"""`autoparallel reshard` CLI and the planner's input errors."""
import json

import pytest

from autoparallel import cli as top_cli
from autoparallel.mesh import mesh_from_shape
from autoparallel.placement import Partial, Shard
from autoparallel.planner.cluster import preset
from reshard import plan_reshard
from reshard.cli import main

BASE = ["--shape", "4096,4096", "--dtype", "float32", "--mesh", "2x4"]
M24 = mesh_from_shape([2, 4], create_groups=False)


def run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_prints_the_plan_and_its_cost(capsys):
    code, out, err = run(capsys, BASE + ["--from", "S(0),R", "--to", "R,S(1)"])
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "reshard float32[4096, 4096] on mesh 2x4 (nccl): (S(0), R) -> (R, S(1))"
    assert "1. mesh dim 1 (size 4): R -> S(1)" in lines[1] and "slice" in lines[1]
    assert "2. mesh dim 0 (size 2): S(0) -> R" in lines[2] and "all_gather" in lines[2]
    assert lines[3] == "  total: 2 steps, 8 MiB per rank, 33 us"


def test_cli_is_routed_from_the_top_level_command(capsys):
    assert top_cli.main(["reshard"] + BASE + ["--from", "S(0),R", "--to", "R,S(1)"]) == 0
    assert "all_gather" in capsys.readouterr().out


def test_cli_json_matches_the_api(capsys):
    code, out, _ = run(capsys, BASE + ["--from", "P,R", "--to", "S(0),R", "--json"])
    assert code == 0
    d = json.loads(out)
    p = plan_reshard([4096, 4096], "float32", M24, "P,R", "S(0),R")
    assert d["path"] == p.placements_path() == ["(P(sum), R)", "(S(0), R)"]
    assert [s["collective"] for s in d["steps"]] == ["reduce_scatter"]
    assert d["bytes_per_rank"] == p.bytes_per_rank and d["seconds"] == p.seconds


def test_cli_from_defaults_to_replicated(capsys):
    code, out, _ = run(capsys, BASE + ["--to", "S(0),S(1)", "--json"])
    assert code == 0 and json.loads(out)["src"] == ["R", "R"]


def test_cli_backend_gloo_prices_emulations(capsys):
    code, out, _ = run(capsys, BASE + ["--from", "P,R", "--to", "S(0),R", "--backend", "gloo", "--json"])
    d = json.loads(out)
    # gloo's reduce_scatter is a whole all_reduce: shrink it first by slicing the other mesh dim
    assert code == 0 and d["path"] == ["(P(sum), R)", "(P(sum), S(1))", "(S(0), S(1))", "(S(0), R)"]
    step = d["steps"][1]
    assert step["collective"] == "reduce_scatter" and step["emulated"] == "all_reduce + slice"
    full = 4096 * 4096 * 4
    assert step["bytes_per_rank"] == 2 * 1 / 2 * full / 4
    assert d["bytes_per_rank"] == full / 4 + 3 * full / 8 < full


def test_cli_cluster_spec_and_profile(capsys, tmp_path):
    code, out, _ = run(capsys, ["--shape", "16,16", "--mesh", "2x4", "--from", "S(0),R", "--to", "R,R",
                                "--cluster", "2x4:H100-80GB", "--json"])
    ag0 = json.loads(out)["steps"][-1]
    assert code == 0 and ag0["seconds"] == pytest.approx(1e-5 + 512 / 50e9, rel=1e-12)    # dim 0 spans nodes
    path = tmp_path / "profile.json"
    preset("A100-80GB", 1, 8).to_json(str(path))
    code, out, _ = run(capsys, ["--shape", "16,16", "--mesh", "2x4", "--from", "S(0),R", "--to", "R,R",
                                "--cluster", str(path), "--json"])
    assert code == 0 and json.loads(out)["steps"][-1]["seconds"] == pytest.approx(5e-6 + 512 / 300e9, rel=1e-12)


@pytest.mark.parametrize("argv, message", [
    (BASE + ["--from", "S(x),R", "--to", "R,R"], "--from: malformed placement 'S(x)'"),
    (BASE + ["--to", "R"], "--to: expected 2 placements (one per mesh dim of [2, 4]), got 1"),
    (BASE + ["--to", "R,S(2)"], "S(2) is out of range for a tensor of rank 2"),
    (BASE + ["--to", "R,P(prod)"], "--to: Partial(reduce_type) expects one of ('sum', 'avg', 'max', 'min'), got 'prod'"),
    (["--shape", "4096,-1", "--mesh", "2x4", "--to", "R,R"], "malformed --shape '4096,-1'"),
    (["--shape", "4096,4096", "--mesh", "2x0", "--to", "R,R"], "--mesh needs positive sizes"),
    (["--shape", "8", "--mesh", "two", "--to", "R"], "malformed --mesh 'two'"),
    (BASE + ["--to", "R,R", "--dtype", "float7"], "unsupported dtype 'float7'"),
    (BASE + ["--to", "R,R", "--backend", "mpi"], "unknown backend 'mpi'"),
    (BASE + ["--to", "R,R", "--cluster", "8:A100"], "malformed cluster spec '8:A100'"),
    (BASE + ["--to", "R,R", "--cluster", "/nonexistent/profile.json"], "is not a file: expected a profile .json"),
])
def test_cli_bad_input_exits_2_with_a_clear_message(capsys, argv, message):
    code, out, err = run(capsys, argv)
    assert code == 2 and out == ""
    assert err.startswith("autoparallel reshard: error: ") and message in err
    assert "Traceback" not in err


def test_cli_missing_argument_exits_2(capsys):
    code, _, err = run(capsys, ["--shape", "4,4"])
    assert code == 2 and "required" in err


def test_cli_help_exits_0(capsys):
    code, out, _ = run(capsys, ["--help"])
    assert code == 0 and "--from" in out


# ---- planner input errors: typed, saying what was expected and what was given --------------------------

@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(src_placements="S(0)"), ValueError, "src_placements: expected 2 placements (one per mesh dim of [2, 4]), got 1"),
    (dict(dst_placements=[Shard(0), Shard(0), Shard(0)]), ValueError, "dst_placements: expected 2 placements"),
    (dict(dst_placements="R,S(2)"), ValueError, "dst_placements: S(2) is out of range for a tensor of rank 2"),
    (dict(src_placements="S(x),R"), ValueError, "src_placements: malformed placement 'S(x)'"),
    (dict(src_placements=None), TypeError, "src_placements must be a string like 'S(0),R'"),
    (dict(src_placements=[0, 1]), TypeError, "src_placements: expected a placement string"),
    (dict(dst_placements="P(sum),P(max)"), ValueError, "one reduce type only"),
    (dict(global_shape=[16, -1]), ValueError, "global_shape must be non-negative, got [16, -1]"),
    (dict(global_shape=[16, 2.5]), TypeError, "global_shape must hold ints, got float 2.5"),
    (dict(global_shape="16,16"), TypeError, "global_shape must be a sequence of ints"),
    (dict(global_shape=16), TypeError, "global_shape must be a sequence of ints"),
    (dict(dtype="float7"), ValueError, "unsupported dtype 'float7'"),
    (dict(mesh=[[0, 1, 2, 3], [4, 5, 6, 7]]), TypeError, "mesh must be a ProcessMesh, got list"),
    (dict(cluster=42), TypeError, "cluster must be None, a ClusterSpec or a spec string"),
    (dict(cluster="1x8:TPU"), ValueError, "unknown device 'TPU'"),
])
def test_planner_rejects_bad_input(kwargs, exc, message):
    args = dict(global_shape=[16, 16], dtype="float32", mesh=M24, src_placements="S(0),R",
                dst_placements="R,S(1)", cluster=None)
    args.update(kwargs)
    with pytest.raises(exc) as info:
        plan_reshard(**args)
    assert message in str(info.value)


def test_unknown_reduce_type_and_backend():
    with pytest.raises(ValueError, match="Partial\\(reduce_type\\) expects one of"):
        plan_reshard([4, 4], "float32", M24, (Partial("prod"), Shard(0)), "R,R")
    import dataclasses
    bad = dataclasses.replace(preset("A100-80GB"), backend="mpi")
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        plan_reshard([4, 4], "float32", M24, "R,R", "R,R", cluster=bad)


def test_cluster_may_be_a_spec_string():
    p = plan_reshard([16, 16], "float32", M24, "S(0),R", "R,R", cluster="2x4:A100-80GB")
    assert p.steps[-1].seconds == pytest.approx(1e-5 + 512 / 25e9, rel=1e-12)
