"""Every rank: GPT and LLaMA forward + backward under TP4, DP4 and DP2xTP2 against a single-process run;
collectives per layer counted by wrapping paddle.distributed; a negative control."""

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F

import autoparallel as ap  # noqa: E402
from autoparallel.comm.counter import count_comm  # noqa: E402
from autoparallel.testing import models as M  # noqa: E402
from autoparallel.testing.check import expected_local  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402

SHAPES = {"TP4": [[0, 1, 2, 3]], "DP4": [[0], [1], [2], [3]], "DP2xTP2": [[0, 1], [2, 3]]}


def run(kind, name, ranks, reduce=True):
    rank = dist.get_rank()
    ref_loss, ref_grads = M.reference(kind)
    mesh = ap.ProcessMesh(ranks, ["data", "model"])
    model = M.build(kind)
    ap.apply_tp(model, mesh, M.tp_plan(kind), "model")
    ap.shard_layer(model, mesh)
    ids, labels = M.batch()
    x = ap.shard_tensor(paddle.to_tensor(ids), mesh, [ap.Shard(0), ap.Replicate()])
    y = ap.shard_tensor(paddle.to_tensor(labels), mesh, [ap.Shard(0), ap.Replicate()])
    with count_comm() as fwd_log:
        logits = model(x)
    loss = F.cross_entropy(logits, y).mean()
    loss.backward()
    if reduce:
        ap.reduce_gradients(model.parameters())
    coords = mesh.coords_of(rank)
    bad = []
    for n, p in model.named_parameters():
        want = expected_local(ref_grads[n], p.spec, coords)
        if not np.allclose(p.grad.numpy(), want, rtol=1e-5, atol=1e-6):
            bad.append(n)
    return {"case": f"{kind} {name}", "loss": float(loss), "ref_loss": ref_loss, "bad_grads": bad,
            "forward_calls": fwd_log.summary()}


def run_paddleformers(name="llama"):
    """An unmodified PaddleFormers model under the seed shard function on the 2x2 mesh."""
    from autoparallel.testing import paddleformers_models as pf

    ref_loss, ref_grads = pf.reference(name)
    mesh = pf.mesh_2x2()
    model = ap.shard_layer(pf.build(name), mesh, pf.seed_shard_fn)
    ids, labels = pf.batch()
    x = ap.shard_tensor(paddle.to_tensor(ids), mesh, [ap.Shard(0), ap.Replicate()])
    y = ap.shard_tensor(paddle.to_tensor(labels), mesh, [ap.Shard(0), ap.Replicate()])
    with count_comm() as fwd_log:
        loss = pf.loss_of(model(input_ids=x, labels=y))
    loss.backward()
    ap.reduce_gradients(model.parameters())
    coords = mesh.coords_of(dist.get_rank())
    bad = [n for n, p in model.named_parameters()
           if not np.allclose(p.grad.numpy(), expected_local(ref_grads[n], p.spec, coords), rtol=1e-4, atol=1e-5)]
    return {"case": f"paddleformers {name} seed shard fn", "loss": float(loss), "ref_loss": ref_loss,
            "bad_grads": bad, "forward_calls": fwd_log.summary()}


def main():
    dist.init_parallel_env()
    out = []
    try:
        import paddleformers  # noqa: F401
        out.append(run_paddleformers())
    except ImportError:
        pass
    for kind in ("gpt", "llama"):
        for name, ranks in SHAPES.items():
            out.append(run(kind, name, ranks))
    neg = run("gpt", "DP2xTP2 without gradient reduction", SHAPES["DP2xTP2"], reduce=False)
    out.append(neg)
    write_result(out)


if __name__ == "__main__":
    main()
