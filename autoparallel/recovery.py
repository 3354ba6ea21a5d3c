"""Recovery calls of the article's training loop: resume, offload fallback, reconfiguration.

    strategy.checkpoint.enable = True
    strategy.checkpoint.save_interval_steps = 1000
    try:
        trainer.train()
    except RuntimeError as e:
        if "CUDA out of memory" in str(e):
            fallback_to_cpu_offload(model)       # optimizer states and master weights to host memory
            resume_from_last_checkpoint()        # back to the newest complete checkpoint

Called without the objects, these act on the *current run*: the model, optimizer and strategy the last
entry point (``ap.parallelize``, ``ap.DataParallel`` + ``ap.Optimizer``) set up in this process
(auto_checkpoint.py). Pass them explicitly to act on others.
"""
from __future__ import annotations

import os

from autoparallel import layer_state
from autoparallel.auto_checkpoint import current_run, same_object


def _run_objects(model, optimizer, caller: str):
    run = current_run()
    if model is None:
        run = current_run(required=caller)
        model = run.model
    if optimizer is None and run is not None and same_object(run.model, model):
        optimizer = run.optimizer
    return run, model, optimizer


# ---- resume ------------------------------------------------------------------------------------------------
def resume_from_last_checkpoint(model=None, optimizer=None, dir=None, strict: bool = True):
    """Load the newest complete checkpoint under ``dir`` into ``model`` and ``optimizer`` (parameters,
    optimizer states, every rank's generators, loss scale, LR schedule); returns its ``CheckpointInfo``
    (``info.step``: the step to continue from) or None when there is none yet.

    Defaults: the current run's model and optimizer, and its ``strategy.checkpoint.dir``. The current run's
    step counter (which drives the periodic saves) continues from the loaded step. Every rank calls it."""
    from autoparallel.checkpoint.manager import CheckpointManager

    if not isinstance(strict, bool):
        raise TypeError(f"resume_from_last_checkpoint: strict must be a bool, got {type(strict).__name__} {strict!r}")
    run, model, optimizer = _run_objects(model, optimizer, "resume_from_last_checkpoint")
    if dir is None:
        if run is None or not same_object(run.model, model) or run.strategy is None:
            raise ValueError("resume_from_last_checkpoint: give dir= (no strategy.checkpoint of the current run "
                             "names a directory for this model)")
        dir = run.manager.dir if run.manager is not None else run.strategy.checkpoint.dir
    manager = run.manager if run is not None and run.manager is not None and \
        os.path.abspath(run.manager.dir) == os.path.abspath(dir) else CheckpointManager(dir, optimizer=optimizer)
    from autoparallel.checkpoint.state import training_state

    info = manager.restore(training_state(model, optimizer), strict=strict)
    if info is not None and run is not None and same_object(run.model, model) and isinstance(info.step, int):
        run.step = info.step
    return info


# ---- offload -----------------------------------------------------------------------------------------------
def fallback_to_cpu_offload(model=None, optimizer=None):
    """Move the optimizer states and fp32 master weights of a ZeRO optimizer to host memory from now on,
    in place (the same optimizer object keeps training; every value is kept). Returns the optimizer.

    Offload moves ZeRO-sharded chunks (as ``strategy.sharding.offload`` does). An optimizer built without
    sharding is rebuilt in place under the run's strategy plus ZeRO stage 1 with offload (through
    ``reconfigure_distributed_model``: every value kept, the held model and optimizer objects become the
    rebuilt ones); that needs the current run's model, constructible as ``type(model)(model.config)``.
    Already offloaded: nothing changes."""
    from autoparallel.checkpoint.state import wrapper_chain
    from autoparallel.parallel.sharding import ZeroOptimizer

    run, model, optimizer = _run_objects(model, optimizer, "fallback_to_cpu_offload")
    if optimizer is None:
        raise ValueError(f"fallback_to_cpu_offload: no optimizer for the {type(model).__name__}; pass it "
                         f"(fallback_to_cpu_offload(model, optimizer))")
    zero = next((o for o in wrapper_chain(optimizer) if isinstance(o, ZeroOptimizer)), None)
    if zero is None:
        return _offload_by_rebuild(run, model, optimizer)
    if zero.model is not model and layer_state.build_of(zero.model) is not layer_state.get(model, "build", 0):
        raise ValueError(f"fallback_to_cpu_offload: the optimizer shards another model's parameters "
                         f"({type(zero.model).__name__}), not the given {type(model).__name__}")
    offload_zero(zero)
    if run is not None and run.strategy is not None and run.optimizer is optimizer:
        run.strategy.sharding.offload = True
    return optimizer


def _offload_by_rebuild(run, model, optimizer):
    """No ZeRO optimizer: rebuild in place under the same strategy plus ZeRO stage 1 with offload (states
    sharded over the data axis and held in host memory, parameters unchanged), through the checkpoint
    round-trip of ``reconfigure_distributed_model``."""
    strategy = run.strategy if run is not None and same_object(run.model, model) else None
    if strategy is None or getattr(model, "config", None) is None:
        raise ValueError(f"fallback_to_cpu_offload: offload moves ZeRO-sharded optimizer states to host memory; "
                         f"this {type(optimizer).__name__} has no sharding, and the "
                         f"{type(model).__name__} cannot be rebuilt with it (that needs a model set up by "
                         f"ap.parallelize / ap.DataParallel and constructible as type(model)(model.config)); "
                         f"build it with strategy.sharding.enable=True and sharding.offload=True instead")
    new = strategy.copy()
    new.sharding.enable, new.sharding.stage, new.sharding.offload = True, 1, True
    reconfigure_distributed_model(model, new, optimizer)
    return optimizer


def offload_zero(zero) -> bool:
    """Turn on ``zero.offload``: each master chunk and optimizer-state tensor moves to host memory keeping
    its tensor object (the optimizer and every reference see the moved storage). False if already on."""
    from autoparallel.parallel.optim_clone import state_tensors

    if zero.offload:
        return False
    for r in zero.held:
        for t in list(zero.master[r].values()) + state_tensors(zero.inner_opts[r]):
            _move_storage(t, zero.host)
    zero.offload = True
    return True


def _move_storage(t, place) -> None:
    if t._is_initialized() and not t.place._equals(place):
        moved = t._copy_to(place, True)
        t.get_tensor()._share_data_with(moved.get_tensor())


# ---- reconfiguration -------------------------------------------------------------------------------------
def reconfigure_distributed_model(model=None, strategy=None, optimizer=None, **kwargs):
    """The article's ``reconfigure_distributed_model(model, new_strategy)``, over ``ap.reconfigure``: rebuild
    the model and its optimizer under ``strategy`` keeping every trained value (a checkpoint round-trip).

    In place, because the article's call uses no return value: the ``model`` and ``optimizer`` objects the
    caller holds *become* the rebuilt ones (each shares the rebuilt object's class and attribute dict), so
    the training loop continues with the new layout. Also returns ``(model, optimizer)``. ``model`` /
    ``optimizer`` default to the current run's; other keywords go to ``ap.reconfigure`` (``build=``,
    ``state_fn=``, ``tmp_dir=``)."""
    from autoparallel.auto_checkpoint import attach
    from autoparallel.auto_checkpoint import current_run as _cur
    from autoparallel.checkpoint.reshard_state import reconfigure
    from autoparallel.strategy import Strategy

    if not isinstance(strategy, Strategy):
        raise TypeError(f"reconfigure_distributed_model(model, strategy): strategy must be an ap.Strategy (e.g. "
                        f"PerformanceMonitor.suggest_optimal_strategy()), got {type(strategy).__name__}")
    run, model, optimizer = _run_objects(model, optimizer, "reconfigure_distributed_model")
    steps = run.step if run is not None and same_object(run.model, model) else 0
    claimed = run.manager if run is not None else None      # the run's checkpoint root, already claimed
    original = _pipelined_model(model)
    if original is not None and "build" not in kwargs:       # a pipeline: rebuild from the model it split
        from autoparallel.checkpoint.reshard_state import default_build

        kwargs["build"] = default_build(original, optimizer)
    new_model, new_optimizer = reconfigure(model, optimizer, strategy, **kwargs)
    _become(model, new_model)
    if optimizer is not None and new_optimizer is not None:
        _become(optimizer, new_optimizer)
    _repoint(model, new_model, optimizer)
    cur = _cur()
    if cur is None or cur.model is not new_model:       # a custom build= may not go through an entry point
        cur = attach(new_model, new_optimizer, strategy)
    cur.model = model
    cur.optimizer = optimizer if new_optimizer is not None else None
    cur.step = steps
    if claimed is not None and cur.manager is not None and os.path.abspath(cur.manager.dir) == \
            os.path.abspath(claimed.dir):
        claimed.optimizer = cur.manager.optimizer             # the same run goes on writing its own root
        cur.manager = claimed
    return model, cur.optimizer


def _pipelined_model(model):
    """The model a PipelineModule was split from, when it is rebuildable (has a ``config``)."""
    if getattr(model, "config", None) is not None:
        return None
    pieces = getattr(getattr(model, "plan", None), "pieces", None)
    original = getattr(pieces, "model", None)
    return original if getattr(original, "config", None) is not None else None


def _repoint(model, new_model, optimizer) -> None:
    """References to the rebuilt model held by the wrappers (under any attribute name: ``model``, a pipeline
    optimizer's ``_pipe``) and the build record name the held object."""
    from autoparallel.checkpoint.state import wrapper_chain

    holders = list(wrapper_chain(optimizer)) if optimizer is not None else []
    for h in holders:
        attrs = getattr(h, "__dict__", None) or {}
        for name in [k for k, v in attrs.items() if v is new_model]:
            attrs[name] = model
    build = layer_state.build_of(model)
    if build is not None and build.model is new_model:         # the record holds its model weakly
        build.model = model


def _become(old, new) -> None:
    """``old`` turns into an alias of ``new``: the same class, the same attribute dict (no copy, so hooks
    and closures that hold ``new`` see every later change made through ``old`` and the reverse)."""
    if old is new:
        return
    if type(old) is not type(new):
        old.__class__ = type(new)
    object.__setattr__(old, "__dict__", new.__dict__)


__all__ = ["resume_from_last_checkpoint", "fallback_to_cpu_offload", "reconfigure_distributed_model", "offload_zero"]
