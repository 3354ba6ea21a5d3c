"""Runs on every rank (4) of a gloo job: recompute forms with dropout > 0 under DP 2 x TP 2 x ZeRO-3, trained
3 SGD steps; each rank reports its losses and the generator's next draw, rank 0 saves the final parameters to
OUT_DIR/<case>.npz (compared with one process without recompute by tests/test_probe_recompute6.py).

    recompute6_worker.py OUT_DIR

``CASES``: a user's ``fleet.utils.recompute`` reentrant and not (a dict returned, keyword arguments), a user's
non-reentrant recompute inside ``Strategy.recompute``'s regions, ``ap.recompute_layers`` with k = 2 of 3 blocks.
``case_model(name)`` / ``train`` are shared with the test, which builds the one-process reference from them.
"""
import dataclasses
import os
import sys

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle.distributed.fleet.utils import recompute as fleet_recompute

STEPS = 3
CASES = ["user reentrant dict", "user non-reentrant kwargs", "nested in strategy full", "recompute_layers k2"]


def gpt(p=0.2):
    from examples.models import PRESETS, build

    paddle.seed(0)
    return build(dataclasses.replace(PRESETS["gpt-tiny"], vocab_size=64, layers=3, max_positions=16, dropout=p))


def data():
    rng = np.random.default_rng(0)
    return paddle.to_tensor(rng.integers(0, 64, (4, 16))), paddle.to_tensor(rng.integers(0, 64, (4, 16)))


def _dict_block(orig):
    def fwd(x):
        d = fleet_recompute(lambda h: {"y": orig(h), "aux": h.mean()}, x, use_reentrant=True)
        return d["y"] + 0 * d["aux"]
    return fwd


def _kwargs_block(orig):
    return lambda x: fleet_recompute(lambda h, scale: orig(h) * scale, x, scale=1.0, use_reentrant=False)


def _mlp_block(mlp):
    def inner(x):
        return mlp.fc2(F.dropout(F.gelu(mlp.fc1(x)), 0.3))
    return lambda x: fleet_recompute(inner, x, use_reentrant=False)


def case_model(name):
    """(model, recompute granularity of the strategy or None) of case ``name``; ``None``: the plain model."""
    from autoparallel.parallel.recompute import recompute_layers

    m = gpt()
    if name is None:
        return m, None
    if name == "user reentrant dict":
        for b in m.blocks:
            b.forward = _dict_block(b.forward)
    elif name == "user non-reentrant kwargs":
        for b in m.blocks:
            b.forward = _kwargs_block(b.forward)
    elif name == "nested in strategy full":
        for b in m.blocks:
            b.mlp.forward = _mlp_block(b.mlp)
        return m, "full"
    elif name == "recompute_layers k2":
        recompute_layers(m, lambda layer: type(layer).__name__ == "Block", 2)
    return m, None


def plain_for(name):
    """The one-process model without recompute that case ``name`` must equal."""
    m = gpt()
    if name == "nested in strategy full":
        for b in m.blocks:
            mlp = b.mlp
            mlp.forward = (lambda mlp: lambda x: mlp.fc2(F.dropout(F.gelu(mlp.fc1(x)), 0.3)))(mlp)
    return m


def train(model, strategy=None):
    """(losses + the generator's next draw, the trained model)."""
    import autoparallel as ap

    opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    if strategy is not None:
        model, opt = ap.parallelize(model, opt, strategy=strategy)
    return sgd_steps(model, opt), model


def sgd_steps(model, opt):
    """Losses of STEPS steps on ``data()`` after ``paddle.seed(123)``, and the generator's next draw."""
    x, y = data()
    paddle.seed(123)
    losses = []
    for _ in range(STEPS):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses + [float(paddle.rand([1]))]


def strategy(rc=None):
    import autoparallel as ap

    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = 2, 2
    s.sharding.enable, s.sharding.stage = True, 3
    if rc:
        s.recompute.enable, s.recompute.granularity = True, rc
    return s


def main():
    import paddle.distributed as dist

    from autoparallel.testing.launch import write_result

    out_dir = sys.argv[1]
    dist.init_parallel_env()
    rank = dist.get_rank()
    out = {}
    for name in CASES:
        try:
            model, rc = case_model(name)
            losses, model = train(model, strategy(rc))
            params = {n: p.full().numpy() for n, p in model.named_parameters()}
            if rank == 0:
                np.savez(os.path.join(out_dir, f"{CASES.index(name)}.npz"),
                         **{"param/" + n: v for n, v in params.items()})
            out[name] = {"losses": losses}
        except Exception as e:          # reported per case; the ranks run the same cases in the same order
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            paddle.set_grad_enabled(True)
    write_result({"rank": rank, "cases": out})


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
