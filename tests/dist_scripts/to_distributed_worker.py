"""Runs on every rank (2): paddle's documented ``to_distributed`` loop on real gloo ranks (test_to_distributed.py
compares it with one process), and a pipelined choice's plain-batch loader refusing batches that differ per rank."""
import traceback

import paddle

import autoparallel as ap
from autoparallel.api_to_distributed import SameOnEveryRank
from autoparallel.testing.launch import write_result
from test_to_distributed import B, T, build, loader, train

world = ap.init_parallel_env()


def documented_loop():
    paddle.seed(0)
    cfg = ap.ToDistributedConfig()
    cfg.input_spec = [paddle.static.InputSpec([B, T], "int64", "input_ids")]
    model, opt, dist_loader = ap.to_distributed(*build(), loader(), device_num=2, config=cfg)
    losses, params = train(model, opt, dist_loader)
    return {"losses": losses, "params": {n: p.tolist() for n, p in params.items()}}


def plain_batches_that_differ():
    batches = [(paddle.full([B, T], world.rank, "int64"),)]
    next(iter(SameOnEveryRank(batches, 2)))
    return "no error"


res = {}
for check in (documented_loop, plain_batches_that_differ):
    try:
        res[check.__name__] = check()
    except Exception as e:  # noqa: BLE001 -- reported to the test
        res[check.__name__] = f"{type(e).__name__}: {e}" + ("" if isinstance(e, ValueError) else
                                                             traceback.format_exc()[-800:])
write_result(res)
