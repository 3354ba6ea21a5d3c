"""Random small models x random strategies in the simulated world: losses and every parameter and buffer
after 2 steps equal one process. A fixed, lean set of seeds runs here; ``AP_FUZZ_SEEDS=500`` runs 500 pairs.
A pair may end in a refusal by name (a typed error from autoparallel), never in a wrong value or a crash."""
import os

import numpy as np
import pytest

from autoparallel.testing import fuzz_runs
from autoparallel.testing.fuzz_models import build_model, draw_model, draw_strategy, linear_names

# seeds chosen to cover every strategy kind, both worlds, accumulation, SGD/AdamW and clipping
LEAN = [0, 1, 2, 3, 4, 5, 8, 32, 40, 47, 85]
KNOWN_REFUSALS = ("no layer of FuzzModel matches a default tensor-parallel plan",)
SEEDS = range(int(os.environ["AP_FUZZ_SEEDS"])) if os.environ.get("AP_FUZZ_SEEDS") else LEAN


@pytest.mark.parametrize("seed", SEEDS)
def test_random_model_and_strategy_match_one_process(seed):
    out = fuzz_runs.run_pair(seed, seed)
    assert out.status in ("ok", "refused"), f"{out.model} {out.strategy}: {out.status}: {out.detail}"
    if out.status == "refused":            # only the refusals triaged as right (docs/fuzzing.md)
        assert any(k in out.detail for k in KNOWN_REFUSALS), out.detail


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


CAPTURED = r'''
import numpy as np, paddle, paddle.nn.functional as F
from paddle import nn
ACTS = {"gelu": F.gelu, "tanh": paddle.tanh, "silu": F.silu, "sigmoid": F.sigmoid}   # a table built at import

class Block(nn.Layer):
    def __init__(self, name, act=F.gelu):              # a default argument captured at import
        super().__init__()
        self.fc, self.name, self.act = nn.Linear(8, 8), name, act
    def forward(self, x):
        return self.act(ACTS[self.name](self.fc(x)))

import autoparallel as ap
x = np.random.default_rng(0).standard_normal((4, 8)).astype("float32")
for name in ACTS:                                      # the first model installs dispatch; the rest come after
    paddle.seed(0); want = Block(name)(paddle.to_tensor(x)).numpy()
    with ap.simulate(world_size=2):
        paddle.seed(0); m = Block(name); mesh = ap.ProcessMesh([0, 1], ["x"]); ap.shard_layer(m, mesh)
        got = m(ap.shard_tensor(paddle.to_tensor(x), mesh, [ap.Shard(0)])).full().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    print("ok", name)
'''


def test_ops_captured_before_dispatch_route():
    """Activation tables and default arguments written at import (before autoparallel first routes) reach
    the rules, in every model of the process (it crashed with paddle's 'must be Tensor, but got DistTensor')."""
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", CAPTURED], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["ok", "gelu", "ok", "tanh", "ok", "silu", "ok", "sigmoid"]


def test_linear_weight_with_an_empty_shard_trains_like_one_process():
    """6 rows over 4 ranks are shards of 2, 2, 2, 0; with replicated inputs the last rank's local matmul has
    an empty contracted dim (paddle's backward failed there: 'Required tensor shall not be nullptr')."""
    import paddle

    import autoparallel as ap

    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((2, 3, 6)).astype("float32"))
    paddle.seed(0)
    lin = paddle.nn.Linear(6, 4)
    lin(x).sum().backward()
    want = lin.weight.grad.numpy()
    paddle.seed(0)
    lin = paddle.nn.Linear(6, 4)
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], ["x"])
        ap.shard_layer(lin, mesh, lambda n, s, m: setattr(s, "weight", ap.shard_tensor(s.weight, m, [ap.Shard(0)]))
                       if n == "" else None)
        lin(ap.shard_tensor(x, mesh, [ap.Replicate()])).sum().backward()
        got = lin.weight.as_dist().grad.full().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
