"""Ops a user module captured before dispatch was installed (a ``functools.partial``, a closure cell, a default
argument, a module alias / list / tuple / dict entry, a Layer or plain object attribute) reach the routed op:
each form, built before the first ``shard_layer`` in a fresh process, gives one process's output and gradients
on a tensor-parallel layout over 4 simulated ranks, and a sharded parameter passed to a captured op is no longer
computed on its local shard. Before: 'must be Tensor, but got DistTensor' for the partial, closure and default
forms (captured_ops.py). A live object whose attribute lookups raise does not stop the install's walk."""
import json
import subprocess
import sys

import pytest

from autoparallel.testing.launch import child_env

SCRIPT = r'''
import json, sys
import numpy as np, paddle
import captured_ops_model as cm          # imported, and every model built, before autoparallel installs


class SlotsProxy:                        # an object whose attribute lookups raise: the install walk must not ask
    __slots__ = ("a",)

    def __getattr__(self, name):
        raise RuntimeError("proxy: no attribute " + name)


proxy = SlotsProxy()
import autoparallel as ap
from autoparallel import dispatch_handle
import paddle.nn.functional as F
raw = [F.gelu, F.silu, F.tanh, F.softplus, F.softsign, F.tanhshrink, F.elu]      # paddle's own, before install
x = np.random.default_rng(0).standard_normal((8, 6)).astype("float32")

def run(m, dist):
    if dist:
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["mp"])
        def shard_fn(name, layer, mesh):
            if name == "":
                layer.w = ap.shard_tensor(layer.w, mesh, [ap.Shard(1)])
            if name == "fc1":
                layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(1)])
                layer.bias = ap.shard_tensor(layer.bias, mesh, [ap.Shard(0)])
        m = ap.shard_layer(m, mesh, shard_fn)
        xin = ap.shard_tensor(paddle.to_tensor(x), mesh, [ap.Replicate()])
    else:
        xin = paddle.to_tensor(x)
    out = m(xin)
    (out * out).sum().backward()
    full = lambda t: np.asarray(t.full() if ap.is_dist(t) else t).tolist()
    grad = lambda p: (p.as_dist().grad if ap.is_dist(p) else p.grad)
    return full(out), full(grad(m.fc1.weight)), None if grad(m.w) is None else full(grad(m.w))

models, want = {}, {}
for f in cm.ALL_FORMS:
    paddle.seed(1)
    want[f] = run(cm.Net(f), False)       # one process, plain paddle
    paddle.seed(1)
    models[f] = cm.Net(f)
assert not dispatch_handle.installed()
res = {}
with ap.simulate(world_size=4):
    for f, dist in models.items():
        try:
            res[f] = [want[f], run(dist, True)]
        except Exception as e:
            res[f] = f"{type(e).__name__}: {e}"[:300]
def captured():
    return [cm.act_partial.func, cm.closure_act.__closure__[0].cell_contents, cm.default_arg.__defaults__[0],
            cm.kwonly_default.__kwdefaults__["act"], cm.ACT_LIST[0], cm.ACT_TUPLE[0], cm.HOLDER.fn]
wrapped = [getattr(c, "__wrapped__", None) is r for c, r in zip(captured(), raw)]
dispatch_handle.uninstall(force=True)
res["_undo"] = {"installed": wrapped, "uninstalled": [c is r for c, r in zip(captured(), raw)]}
print("RESULT" + json.dumps(res))
'''


@pytest.fixture(scope="module")
def results():
    import os

    env = child_env({"OMP_NUM_THREADS": "1"})
    env["PYTHONPATH"] = os.path.dirname(os.path.abspath(__file__)) + os.pathsep + env["PYTHONPATH"]
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads(line[0][len("RESULT"):])


def test_every_form_is_listed(results):
    from captured_ops_model import ALL_FORMS

    assert sorted(results) == sorted(ALL_FORMS + ["_undo"]) and len(ALL_FORMS) == 14


@pytest.mark.parametrize("form", ["partial", "module alias", "closure", "default argument", "keyword-only default",
                                  "layer attribute partial", "dict table", "module list", "module tuple",
                                  "plain object attribute", "partial on a sharded parameter",
                                  "closure on a sharded parameter", "method default", "layer attribute"])
def test_captured_op_equals_one_process(results, form):
    import numpy as np

    r = results[form]
    assert not isinstance(r, str), r
    one, dist = r
    for a, b, what in zip(one, dist, ("output", "fc1.weight.grad", "w.grad")):
        if a is None:
            assert b is None, what
            continue
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5, err_msg=what)


def test_undo_restores_the_captured_originals(results):
    """Every place repointed at install held the wrapper, and holds paddle's original again after uninstall."""
    assert results["_undo"] == {"installed": [False] * 7, "uninstalled": [True] * 7}
