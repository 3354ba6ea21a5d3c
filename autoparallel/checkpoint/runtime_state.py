"""Run state that is not a tensor of the model or optimizer: random generators, loss scaler, LR schedule.

Saved with the checkpoint (``runtime``, beside the user's ``extra``), written by rank 0; JSON values go into
the metadata, arrays into the data files like any tensor. Everything is data: nothing is ever unpickled.

* ``rng``: every rank's generator states (paddle's, numpy's global and python's ``random``) as plain integer
  arrays (rng_arrays.py), gathered with one all_gather; restored when the job has the same number of ranks
  (rank r gets rank r's states), after every field is checked. Under another world size the states of a
  different rank layout mean nothing, so they are left as seeded and the restore reports it.
* ``amp``: the dynamic loss scale and its good / bad step counters (the same on every rank: ``found_inf`` is
  agreed by all ranks).
* ``lr_scheduler``: ``state_dict()`` of the paddle optimizer's LRScheduler, if it has one, and
  ``lr_scheduler_attributes``: the attributes some schedulers step without listing them in their state
  (CosineAnnealingWarmRestarts' ``T_cur`` / ``T_i``), so a resumed schedule continues its cycle.
"""
from __future__ import annotations

import numpy as np

from autoparallel.checkpoint import rng_arrays


def capture(optimizer=None) -> dict:
    """This job's runtime state: JSON values and numpy arrays (collective: every rank calls it)."""
    out = {"rng": _gather_rng()}
    scaler = _scaler(optimizer)
    if scaler is not None:
        out["amp"] = {"scale": scaler.scale_value, "good_steps": scaler.good_steps, "bad_steps": scaler.bad_steps}
    sched = _scheduler(optimizer)
    if sched is not None:
        out.update(_schedule(sched))
    return out


def restore(runtime: dict | None, optimizer=None, state=None) -> list:
    """Put ``capture``'s values back; returns the names restored (``rng`` only under the saved world size).
    Every part is checked before any is applied (CheckpointCorruptError names the bad one). ``state``: what
    the load filled; an ``ap.training_state`` over a scheduled optimizer has had its schedule handled by the
    load (restore_schedule), so it is not reported twice."""
    if not runtime:
        return []
    _, rank, world = _job()
    rng = runtime.get("rng")
    states = rng_arrays.validate(rng) if rng else None      # plain arrays only, never unpickled
    scaler, sched = _scaler(optimizer), _scheduler(optimizer)
    amp = _amp_values(runtime["amp"]) if scaler is not None and "amp" in runtime else None
    lr = runtime.get("lr_scheduler") if sched is not None else None
    if lr is not None and not isinstance(lr, dict):
        from autoparallel.checkpoint.errors import CheckpointCorruptError

        raise CheckpointCorruptError(f"LR schedule state: expected a dict, got {type(lr).__name__}")
    done = []
    if states is not None and rng["world_size"] == world:
        rng_arrays.restore({k: v[rank] for k, v in states.items()})
        done.append("rng")
    if amp is not None:
        scaler.scale_value, scaler.good_steps, scaler.bad_steps = float(amp["scale"]), amp["good_steps"], \
            amp["bad_steps"]
        done.append("amp")
    if lr is not None:
        _put_schedule(sched, runtime)
        done.append("lr_scheduler")
    left = _left_out(runtime, states, world, scaler)
    if _scheduler(getattr(state, "optimizer", None)) is None:      # else the load restored or reported it
        left += _schedule_left_out(runtime, sched)
    _warn_left_out(left)
    return done


def _schedule_left_out(runtime: dict, sched) -> list:
    """The LR schedule a restore leaves as it was: saved without a scheduler to go to (the learning rate the
    resumed optimizer was built with then stays), or a scheduler with none saved (it keeps its own position)."""
    if sched is None and runtime.get("lr_scheduler") is not None:
        return [f"the LR schedule (last_epoch {runtime['lr_scheduler'].get('last_epoch', '?')}; the optimizer "
                f"given has no LR scheduler: its learning rate stays as built)"
                if isinstance(runtime["lr_scheduler"], dict) else "the LR schedule"]
    if sched is not None and "lr_scheduler" not in runtime:
        return [f"the LR schedule (the checkpoint holds none: the optimizer's {type(sched).__name__} keeps "
                f"last_epoch {sched.last_epoch})"]
    return []


def _left_out(runtime: dict, states, world: int, scaler) -> list:
    """What of the saved run state, or of this run's, a restore leaves as it was (the loss scale, the
    generators), each with its reason; ``restore`` warns with them (``info.restored`` names what came back)."""
    out = []
    if states is not None and runtime["rng"]["world_size"] != world:
        out.append(f"the random generators (saved by {runtime['rng']['world_size']} ranks, this job has {world}: "
                   f"they stay as seeded)")
    if scaler is not None and "amp" not in runtime:
        out.append(f"the loss scale (the checkpoint holds none: the optimizer's loss scaler keeps scale "
                   f"{scaler.scale_value})")
    if scaler is None and "amp" in runtime:
        out.append(f"the loss scale {runtime['amp'].get('scale') if isinstance(runtime['amp'], dict) else '?'} "
                   f"(the optimizer given has no loss scaler: not under AMP)")
    return out


def _warn_left_out(items: list) -> None:
    if items:
        import warnings

        warnings.warn("the checkpoint's run state was not all restored: " + "; ".join(items), RuntimeWarning,
                      stacklevel=4)             # the caller of CheckpointManager.restore


# ---- generators ------------------------------------------------------------------------------------------
def _gather_rng() -> dict:
    """Every rank's generator states as arrays with a leading rank axis (the same on every rank)."""
    mine = rng_arrays.capture()
    multi, _, world = _job()
    if not multi:
        return {"world_size": world, **{k: np.stack([v] * world) for k, v in mine.items()}}
    import paddle
    import paddle.distributed as dist

    packed = rng_arrays.pack(mine)              # fixed layout: every rank's buffer has the same length
    from autoparallel import watchdog

    parts = []
    with watchdog.op("checkpoint generator states (all_gather)"):
        dist.all_gather(parts, paddle.to_tensor(packed))
    states = [rng_arrays.unpack(t.numpy(), mine) for t in parts]
    return {"world_size": world, **{k: np.stack([s[k] for s in states]) for k in mine}}


def _job() -> tuple:
    from autoparallel.checkpoint import sync

    return sync.job()


def _amp_values(a) -> dict:
    from autoparallel.checkpoint.errors import CheckpointCorruptError

    ok = isinstance(a, dict) and isinstance(a.get("scale"), (int, float)) and not isinstance(a.get("scale"), bool) \
        and all(isinstance(a.get(k), int) and not isinstance(a.get(k), bool) for k in ("good_steps", "bad_steps"))
    if not ok:
        raise CheckpointCorruptError(f"loss scaler state: expected {{'scale': number, 'good_steps': int, "
                                     f"'bad_steps': int}}, got {a!r}")
    return a


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
        lr = None
    if isinstance(lr, LRScheduler):
        return lr
    from autoparallel.checkpoint.state import wrapper_chain

    for opt in wrapper_chain(optimizer):    # a wrapper over two optimizers (SplitOptimizer: ZeRO + the kept part)
        lr = getattr(opt, "_learning_rate", None)       # forwards its user's optimizer's learning rate
        if isinstance(lr, LRScheduler):
            return lr
    return None


def _json_values(d: dict) -> dict:
    """A scheduler's ``state_dict()`` as JSON; a wrapped scheduler's nested state (``LinearWarmup_LR``) too."""
    out = {}
    for k, v in d.items():
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, dict):
            out[k] = _json_values(v)
        elif isinstance(v, (int, float, str, bool, list)) or v is None:
            out[k] = v
    return out


# ---- the LR schedule of ap.training_state saved with ap.save_state_dict -----------------------------------
def schedule_runtime(state) -> dict | None:
    """``{"lr_scheduler": ...}`` for a state ``ap.training_state`` built over an optimizer with an
    LRScheduler (saved beside the tensors by ``save_state_dict``), else None."""
    sched = _scheduler(getattr(state, "optimizer", None))
    return None if sched is None else _schedule(sched)


def restore_schedule(state, runtime) -> bool:
    """Put a saved LR schedule back into the scheduler of the optimizer ``state`` (an ``ap.training_state``)
    was built over; True if restored. A checkpoint without one leaves the scheduler as it is, with a warning."""
    sched = _scheduler(getattr(state, "optimizer", None))
    if sched is None:
        return False
    lr = runtime.get("lr_scheduler") if isinstance(runtime, dict) else None
    if lr is None:
        import warnings

        warnings.warn(f"the checkpoint holds no LR schedule: the optimizer's {type(sched).__name__} keeps its "
                      f"current state (last_epoch={sched.last_epoch}); save with ap.save_state_dict("
                      f"ap.training_state(model, optimizer), path) to keep it", stacklevel=3)
        return False
    if not isinstance(lr, dict):
        from autoparallel.checkpoint.errors import CheckpointCorruptError

        raise CheckpointCorruptError(f"LR schedule state: expected a dict, got {type(lr).__name__}")
    _put_schedule(sched, runtime)
    return True


# attributes a paddle scheduler changes as it steps without listing them in its state_dict (the constructor's
# settings are not saved: a run rebuilt with other settings keeps them)
STEPPED_ATTRIBUTES = {"CosineAnnealingWarmRestarts": ("T_cur", "T_i")}


def _schedule(sched) -> dict:
    names = next((v for k, v in STEPPED_ATTRIBUTES.items() if type(sched).__name__ == k), ())
    attrs = {k: getattr(sched, k) for k in names if _plain(getattr(sched, k, None))}
    return {"lr_scheduler": _json_values(sched.state_dict()), "lr_scheduler_attributes": attrs}


def _plain(v) -> bool:
    scalar = (int, float, str, bool)
    return isinstance(v, scalar) or (isinstance(v, list) and all(isinstance(x, scalar) for x in v))


def _put_schedule(sched, runtime: dict) -> None:
    """The scheduler's saved state, then its saved plain attributes that it still has with a value of the same
    kind (a number stays a number)."""
    sched.set_state_dict(dict(runtime["lr_scheduler"]))
    attrs = runtime.get("lr_scheduler_attributes")
    for k, v in (attrs.items() if isinstance(attrs, dict) else ()):
        cur = getattr(sched, k, None)
        same = isinstance(v, type(cur)) or (isinstance(v, (int, float)) and isinstance(cur, (int, float))
                                            and not isinstance(v, bool) and not isinstance(cur, bool))
        if hasattr(sched, k) and same and _plain(cur):
            setattr(sched, k, v)
