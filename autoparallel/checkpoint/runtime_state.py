"""Run state that is not a tensor of the model or optimizer: random generators, loss scaler, LR schedule.

Saved in the checkpoint's metadata (``runtime``, beside the user's ``extra``), written by rank 0:

* ``rng``: every rank's generator states (paddle's, numpy's global and python's ``random``), gathered to rank
  0 with one all_gather; restored when the job has the same number of ranks (rank r gets rank r's states).
  Under another world size the states of a different rank layout mean nothing, so they are left as seeded
  and the restore reports it.
* ``amp``: the dynamic loss scale and its good / bad step counters (the same on every rank: ``found_inf`` is
  agreed by all ranks).
* ``lr_scheduler``: ``state_dict()`` of the paddle optimizer's LRScheduler, if it has one.
"""
from __future__ import annotations

import base64
import pickle
import random


def capture(optimizer=None) -> dict:
    """This job's runtime state as JSON values (collective: every rank calls it)."""
    out = {"rng": _gather_rng()}
    scaler = _scaler(optimizer)
    if scaler is not None:
        out["amp"] = {"scale": scaler.scale_value, "good_steps": scaler.good_steps, "bad_steps": scaler.bad_steps}
    sched = _scheduler(optimizer)
    if sched is not None:
        out["lr_scheduler"] = _json_values(sched.state_dict())
    return out


def restore(runtime: dict | None, optimizer=None) -> list:
    """Put ``capture``'s values back; returns the names restored (``rng`` only under the saved world size)."""
    if not runtime:
        return []
    done = []
    rng = runtime.get("rng")
    _, rank, world = _job()
    if rng and rng.get("world_size") == world:
        _set_rng(rng["states"][rank])
        done.append("rng")
    scaler = _scaler(optimizer)
    if scaler is not None and "amp" in runtime:
        a = runtime["amp"]
        scaler.scale_value, scaler.good_steps, scaler.bad_steps = float(a["scale"]), a["good_steps"], a["bad_steps"]
        done.append("amp")
    sched = _scheduler(optimizer)
    if sched is not None and "lr_scheduler" in runtime:
        sched.set_state_dict(dict(runtime["lr_scheduler"]))
        done.append("lr_scheduler")
    return done


# ---- generators ------------------------------------------------------------------------------------------
def _rng_bytes() -> bytes:
    import numpy as np
    import paddle

    return pickle.dumps((paddle.get_rng_state(), np.random.get_state(), random.getstate()))


def _set_rng(encoded: str) -> None:
    import numpy as np
    import paddle

    p, n, r = pickle.loads(base64.b64decode(encoded))
    paddle.set_rng_state(p)
    np.random.set_state(n)
    random.setstate(r)


def _gather_rng() -> dict:
    """{"world_size": n, "states": [base64 of rank r's generator states]} (the same on every rank)."""
    mine = _rng_bytes()
    multi, _, world = _job()
    if not multi:
        return {"world_size": world, "states": [base64.b64encode(mine).decode()] * world}
    import numpy as np
    import paddle
    import paddle.distributed as dist

    size = paddle.to_tensor([len(mine)], dtype="int64")
    dist.all_reduce(size, op=dist.ReduceOp.MAX)
    buf = np.zeros(int(size.numpy()[0]) + 8, dtype=np.uint8)          # 8 bytes of length, then the payload
    buf[:8] = np.frombuffer(len(mine).to_bytes(8, "little"), dtype=np.uint8)
    buf[8:8 + len(mine)] = np.frombuffer(mine, dtype=np.uint8)
    parts = []
    dist.all_gather(parts, paddle.to_tensor(buf))
    states = []
    for t in parts:
        raw = t.numpy().tobytes()
        n = int.from_bytes(raw[:8], "little")
        states.append(base64.b64encode(raw[8:8 + n]).decode())
    return {"world_size": world, "states": states}


def _job() -> tuple:
    from autoparallel.checkpoint import sync

    return sync.job()


# ---- the optimizer's companions -------------------------------------------------------------------------
def _scaler(optimizer):
    """The LossScaler of an AmpOptimizer anywhere in the wrapper chain (None without AMP)."""
    from autoparallel.checkpoint.state import wrapper_chain

    for opt in wrapper_chain(optimizer):
        scaler = vars(opt).get("scaler") if hasattr(opt, "__dict__") else None
        if hasattr(scaler, "scale_value"):
            return scaler
    return None


def _scheduler(optimizer):
    if optimizer is None:
        return None
    from paddle.optimizer.lr import LRScheduler

    from autoparallel.checkpoint.state import paddle_optimizer

    try:
        lr = getattr(paddle_optimizer(optimizer), "_learning_rate", None)
    except TypeError:
        return None
    return lr if isinstance(lr, LRScheduler) else None


def _json_values(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, (int, float, str, bool, list)) or v is None:
            out[k] = v
    return out
