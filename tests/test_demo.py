"""The reshard demo's per-rank logic in the simulated world (the real 4-rank launch is `make demo`)."""
import importlib.util
import os

import pytest

import autoparallel as ap
from autoparallel.demo import is_noise, launcher_safe, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("reshard_demo", os.path.join(ROOT, "examples", "reshard_demo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_verifies_every_transition_on_every_rank(demo):
    lines = []
    with ap.simulate(world_size=4):
        results = demo.run_demo(out=lines.append)
    assert len(results) == len(demo.TRANSITIONS)
    assert all(r["ok"] and not r["bad_ranks"] for r in results), [(r["src"], r["dst"], r["bad_ranks"]) for r in results]
    # the plans are explained and the collectives are the expected ones
    text = "\n".join(lines)
    assert "summary: 7/7 reshards verified" in text
    assert {"slice", "all_gather", "all_reduce", "reduce_scatter", "all_to_all"} <= {c for r in results
                                                                                      for c in r["collectives"]}


def test_wrong_expected_placement_is_reported_as_failure(demo):
    """Negative control: checking shards against a placement the reshard did not produce must fail."""
    with ap.simulate(world_size=4):
        mesh = demo.demo_mesh(4)
        right = demo.run_transition(mesh, (8, 6), "S(0),R", "R,S(1)")
        wrong = demo.run_transition(mesh, (8, 6), "S(0),R", "R,S(1)", expect="S(1),R")
        swapped = demo.run_transition(mesh, (8, 8), "R,R", "S(0),S(1)", expect="S(1),S(0)")
    assert right["ok"]
    assert not wrong["ok"] and wrong["bad_ranks"]
    assert not swapped["ok"] and swapped["bad_ranks"]


def test_partial_sources_hold_distinct_terms(demo):
    """P(sum) sources hold genuinely different terms on the ranks of the partial mesh dim."""
    import numpy as np

    with ap.simulate(world_size=4):
        mesh = demo.demo_mesh(4)
        x = demo.full_tensor((4, 4), 0)
        dt = demo.make_source(x, mesh, ap.parse_placements("P(sum),R"), 0)
        terms = [dt.local_of(r).numpy() for r in (0, 2)]
    assert not np.allclose(terms[0], terms[1])
    assert np.allclose(terms[0] + terms[1], x, atol=1e-5)


def test_demo_mesh_rejects_odd_world(demo):
    with pytest.raises(ValueError, match="even number of ranks"):
        demo.demo_mesh(3)


def test_launcher_arguments_and_noise_filter(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    args, rest = parse_args(["--nproc", "2", "--script", str(script), "--", "--steps", "3"])
    assert (args.nproc, args.script, rest) == (2, str(script), ["--steps", "3"])
    assert parse_args([])[0].script.endswith(os.path.join("examples", "reshard_demo.py"))
    with pytest.raises(SystemExit):
        parse_args(["--nproc", "0"])
    assert is_noise("LAUNCH INFO 2026-11-30 03:53:26,656 nnodes: 1")
    assert not is_noise("reshard float32[8, 6] on mesh 2x2 (gloo): (S(0), R) -> (R, S(1))")


def test_script_flags_the_launcher_would_misread_get_a_separator():
    """paddle's launcher aborts on ``--auto`` (a prefix of its --auto_* options) even after the script name:
    ``autoparallel demo`` puts a ``--`` separator before such script flags."""
    assert launcher_safe(["--dp", "2"]) == ["--dp", "2"]
    assert launcher_safe(["--auto", "--steps", "5"]) == ["--", "--auto", "--steps", "5"]
