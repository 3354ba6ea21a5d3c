"""Random small models x random strategies in the simulated world: losses and every parameter and buffer
after 2 steps equal one process. A fixed, lean set of seeds runs here; ``AP_FUZZ_SEEDS=500`` runs 500 pairs.
A pair may end in a refusal by name (a typed error from autoparallel), never in a wrong value or a crash."""
import os

import numpy as np
import pytest

from autoparallel.testing import fuzz_runs
from autoparallel.testing.fuzz_models import build_model, draw_model, draw_strategy, linear_names

# seeds chosen to cover every strategy kind, both worlds, accumulation, SGD/AdamW and clipping
LEAN = [0, 1, 2, 3, 5, 8, 12, 32, 40, 85]
SEEDS = range(int(os.environ["AP_FUZZ_SEEDS"])) if os.environ.get("AP_FUZZ_SEEDS") else LEAN


@pytest.mark.parametrize("seed", SEEDS)
def test_random_model_and_strategy_match_one_process(seed):
    out = fuzz_runs.run_pair(seed, seed)
    assert out.status in ("ok", "refused"), f"{out.model} {out.strategy}: {out.status}: {out.detail}"
    if out.status == "refused":            # a refusal must name what autoparallel cannot do, not paddle's parser
        assert "(InvalidArgument)" not in out.detail


def test_lean_seeds_cover_every_strategy_kind():
    kinds = {draw_strategy(s, linear_names(build_model(draw_model(s)))).kind for s in LEAN}
    assert kinds == {"dp", "tp", "dp_tp", "zero1", "zero2", "zero3", "recompute", "full", "shard_layer"}


def test_compare_catches_a_wrong_parameter():
    """Negative control: the comparison fails on a parameter off by one SGD step's worth."""
    spec = draw_model(0)
    sspec = draw_strategy(0, linear_names(build_model(spec)))
    ref = fuzz_runs.reference(spec, sspec)
    bad = (ref[0], {k: v.copy() for k, v in ref[1].items()})
    name = sorted(bad[1])[0]
    bad[1][name] = bad[1][name] + 1e-3
    assert fuzz_runs.compare(ref, ref) == ""
    assert fuzz_runs.compare(ref, bad).startswith(name)
    assert "losses" in fuzz_runs.compare(ref, ([x * 1.01 for x in ref[0]], ref[1]))
