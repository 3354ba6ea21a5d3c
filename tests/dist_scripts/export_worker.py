"""Runs on 2 ranks: a trained model exported as users write it (test_probe_export_dist.py).

* tensor parallel: ``paddle.save(model.state_dict())`` and ``paddle.jit.save(model)`` raise ShardedExportError on
  both ranks (no rank waits in a gather the other never makes); ``ap.full_state_dict`` / ``ap.full_model`` on both
  ranks, rank 0 alone saves, both ranks load plain objects;
* data parallel: rank 0 alone calls ``paddle.jit.save(model)`` and ``paddle.save(model.state_dict())`` (no
  collective: the parameters are whole on the rank);
* ``generate`` with top_p sampling under tensor parallel: the tokens of both ranks, and of one process;
* pipeline parallel 2: ``pipe.eval()`` and ``eval_batch`` of a last batch of 7 samples: one process's loss.
Usage: export_worker.py OUT_DIR
"""
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F

import autoparallel as ap
from autoparallel.testing import paddleformers_models as pf
from autoparallel.testing.launch import write_result
from test_probe_export_save import SPEC, X, mlp

def strategy(dp=1, tp=1):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    return s


def plain_outputs(path):
    loaded = paddle.jit.load(path)
    loaded.eval()
    fresh = mlp(seed=5)
    fresh.set_state_dict(paddle.load(path + ".pdparams"))
    fresh.eval()
    return [loaded(paddle.to_tensor(X)).numpy(), fresh(paddle.to_tensor(X)).numpy()]


def refused(fn) -> str:
    try:
        fn()
    except ap.ShardedExportError:
        return "ShardedExportError"
    return "saved"


def tensor_parallel(out, rank, want) -> dict:
    plan = {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()}
    m, _ = ap.parallelize(mlp(), None, strategy=strategy(tp=2), tp_plan=plan)
    m.eval()
    res = {"save": refused(lambda: paddle.save(m.state_dict(), os.path.join(out, f"bad{rank}.pdparams"))),
           "jit_save": refused(lambda: paddle.jit.save(m, os.path.join(out, f"bad{rank}"), input_spec=SPEC))}
    state, plain = ap.full_state_dict(m), ap.full_model(m)           # collective: every rank
    path = os.path.join(out, "tp")
    if rank == 0:
        paddle.save(state, path + ".pdparams")
        paddle.jit.save(plain, path, input_spec=SPEC)
    dist.barrier()
    res["diffs"] = [float(np.abs(o - want).max()) for o in plain_outputs(path)]
    return res


def data_parallel(out, rank, want) -> dict:
    m, _ = ap.parallelize(mlp(), None, strategy=strategy(dp=2))
    m.eval()
    path = os.path.join(out, "dp")
    if rank == 0:                              # one rank alone: nothing to gather, nothing to wait for
        paddle.jit.save(m, path, input_spec=SPEC)
        paddle.save(m.state_dict(), path + ".pdparams")
    dist.barrier()
    return {"diffs": [float(np.abs(o - want).max()) for o in plain_outputs(path)]}


def sampled(model):
    ids = np.random.default_rng(3).integers(3, 60, (3, 5)).astype("int64")
    mask = np.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    paddle.seed(7)
    out = model.generate(input_ids=paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask), max_new_tokens=4,
                         decode_strategy="sampling", top_p=0.8)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return (out.full() if hasattr(out, "full") else out).numpy()


def generation() -> dict:
    ref = pf.build("llama", 0)
    ref.eval()
    want = sampled(ref)
    model = pf.build("llama", 0)
    model.eval()
    model, _ = ap.parallelize(model, None, strategy=strategy(tp=2))
    got = sampled(model)
    every = []
    dist.all_gather(every, paddle.to_tensor(got))
    return {"equal_one_process": bool(np.array_equal(got, want)),
            "equal_ranks": all(np.array_equal(t.numpy(), got) for t in every)}


def pipeline_eval() -> dict:
    """pp 2: the loss of a last batch of 7 samples (micro_batches 2), dropout off under eval()."""
    from examples.models import GPT, GPTConfig

    def gpt():
        paddle.seed(0)
        return GPT(GPTConfig(vocab_size=64, hidden=32, layers=2, heads=4, max_positions=16, dropout=0.3))

    rng = np.random.default_rng(5)
    ids, lab = paddle.to_tensor(rng.integers(0, 64, (7, 8))), paddle.to_tensor(rng.integers(0, 64, (7, 8)))
    ref = gpt()
    ref.eval()
    with paddle.no_grad():
        want = float(F.cross_entropy(ref(ids), lab.unsqueeze(-1)).mean())
    s = strategy()
    s.pipeline_parallel.degree, s.pipeline_parallel.micro_batches = 2, 2
    pipe, _ = ap.parallelize(gpt(), None, strategy=s)
    pipe.eval()
    return {"loss_diff": abs(float(pipe.eval_batch(ids, lab)) - want)}


def main():
    dist.init_parallel_env()
    rank, out = dist.get_rank(), sys.argv[1]
    ref = mlp()
    ref.eval()
    want = ref(paddle.to_tensor(X)).numpy()
    write_result({"tp": tensor_parallel(out, rank, want), "dp": data_parallel(out, rank, want),
                  "generate": generation(), "pipeline": pipeline_eval()})


if __name__ == "__main__":
    main()
