"""Notebook-style rounds in one process: build the test GPT, distribute it (``ap.parallelize`` DP, ZeRO-3, or
``shard_layer`` + ``shard_optimizer(ShardingStage3)``), train, drop everything, ``gc.collect()``; repeated.
``rounds`` is run in ``ap.simulate`` by tests/test_probe_leaks7.py and on 2 real ranks by this script:

    leaks7_worker.py            (2 ranks; each rank writes its rounds' records)
"""
import contextlib
import gc
import sys
import weakref
from collections import deque

import paddle
import paddle.distributed as dist

import autoparallel as ap
from autoparallel.compat import SideData
from autoparallel.parallel.stale_optimizers import live_optimizers
from autoparallel.testing.launch import write_result
from autoparallel.testing.models import adamw, build, train_steps

STEPS = 2
KINDS = ("dp", "zero3", "shard_layer")
PACKAGES = ("autoparallel", "spmd_rules", "reshard")
BY_AGE = ("autoparallel.comm.fanout._MEMO", "autoparallel.comm.fanout._ORDER")   # bounded by insertions
CONTAINERS = (dict, list, set, deque, SideData, weakref.WeakSet, weakref.WeakKeyDictionary,
              weakref.WeakValueDictionary)


def registry_sizes() -> dict:
    """{module.name: len} of every module-level container of the packages (and the dicts inside a dict)."""
    out = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or name.split(".")[0] not in PACKAGES:
            continue
        for attr, v in list(vars(mod).items()):
            key = f"{name}.{attr}"
            if attr.startswith("__") or not isinstance(v, CONTAINERS) or key in BY_AGE:
                continue
            out[key] = len(v)
            if isinstance(v, dict):
                for k, inner in list(v.items()):
                    if isinstance(inner, (dict, list, set)):
                        out[f"{key}[{k!r:.40}]"] = len(inner)
    return out


def distributed(kind: str, world: int):
    """(model, optimizer, weak references to every parameter made) of one round."""
    m = build("gpt")
    made = [weakref.ref(p) for p in m.parameters()]
    if kind == "shard_layer":
        mesh = ap.ProcessMesh(list(range(world)), dim_names=["dp"])
        m = ap.shard_layer(m, mesh)
        opt = ap.shard_optimizer(adamw(m.parameters()), ap.ShardingStage3("dp", mesh))
    else:
        s = ap.Strategy()
        s.data_parallel.degree = world
        if kind == "zero3":
            s.sharding.enable, s.sharding.stage = True, 3
        m, opt = ap.parallelize(m, adamw(m.parameters()), strategy=s)
    return m, opt, made + [weakref.ref(p) for p in m.parameters()]


def one_round(kind: str, world: int) -> tuple:
    m, opt, made = distributed(kind, world)
    losses = train_steps(m, opt, STEPS)
    gone = [weakref.ref(m), weakref.ref(opt)] + made
    del m, opt
    return losses, gone


def rounds(plan, world_of=None) -> list:
    """For each (kind, world) of ``plan``: {losses, alive (objects of the round still alive after it),
    optimizers (live paddle optimizers), sizes (registry sizes)}, taken after ``gc.collect()``. ``world_of``:
    world size -> the context a round runs in (``ap.simulate``); None: the real job."""
    out = []
    for kind, world in plan:
        with (world_of or (lambda w: contextlib.nullcontext()))(world):
            losses, gone = one_round(kind, world)
        gc.collect()
        out.append({"kind": kind, "world": world, "losses": losses, "alive": sum(r() is not None for r in gone),
                    "optimizers": len(live_optimizers()), "sizes": registry_sizes()})
    return out


def main():
    dist.init_parallel_env()
    plan = [(k, 2) for k in KINDS] * 3
    write_result({"rank": dist.get_rank(), "rounds": rounds(plan)})


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
