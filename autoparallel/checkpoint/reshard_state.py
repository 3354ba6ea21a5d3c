"""Move a whole training state from one layout to another through a checkpoint round-trip.

``reshard_state(state_from, state_to)`` saves ``state_from`` to a scratch checkpoint (in /dev/shm when it
exists, so the round-trip stays in memory) and loads it into ``state_to``, whose tensors may live on other
meshes, placements or a different part of the world. ``reconfigure`` applies it to a model and optimizer
rebuilt under a new strategy. In a multi-node job pass a ``tmp_dir`` every rank sees.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from autoparallel.checkpoint import sync
from autoparallel.compat import fresh_parameter_names
from autoparallel.checkpoint.atomic import new_nonce, write_file_atomic
from autoparallel.checkpoint.load import load_state_dict
from autoparallel.checkpoint.save import save_state_dict


def _check_tmp_dir(tmp_dir) -> None:
    if tmp_dir is None:
        return
    if not isinstance(tmp_dir, (str, os.PathLike)):
        raise TypeError(f"tmp_dir must be a path (str or os.PathLike) or None, got {type(tmp_dir).__name__}")
    if not os.path.isdir(tmp_dir):
        raise NotADirectoryError(f"tmp_dir {os.fspath(tmp_dir)!r} is not an existing directory")


def _scratch_root(tmp_dir) -> str:
    if tmp_dir is not None:
        return os.fspath(tmp_dir)
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


def reshard_state(state_from: dict, state_to: dict, *, tmp_dir=None, strict: bool = True) -> None:
    """Fill ``state_to`` (same names and global shapes, any layouts) with the values of ``state_from``."""
    if not isinstance(state_from, dict) or not isinstance(state_to, dict):
        raise TypeError(f"state_from and state_to must be dicts (nested allowed), got "
                        f"{type(state_from).__name__} and {type(state_to).__name__}")
    _check_tmp_dir(tmp_dir)
    multi, rank, world_size = sync.job()
    token = sync.broadcast_token(new_nonce())
    root = os.path.join(_scratch_root(tmp_dir), f"ap-reshard-{token}")
    path = os.path.join(root, "state")
    os.makedirs(root, exist_ok=True)
    saved = False
    try:
        save_state_dict(state_from, path)
        saved = True
        load_state_dict(state_to, path, strict=strict)
    finally:
        if saved:
            _remove_when_all_done(root, multi, rank, world_size)
        else:       # a failed save fails on every rank (save.py): no rank reads the scratch, and on node-local
            shutil.rmtree(root, ignore_errors=True)     # scratch rank 0 would wait for markers it never sees


def _remove_when_all_done(root: str, multi: bool, rank: int, world_size: int) -> None:
    """Rank 0 removes the scratch checkpoint once every rank has finished loading (file rendezvous)."""
    if not multi:
        shutil.rmtree(root, ignore_errors=True)
        return
    write_file_atomic(os.path.join(root, f"loaded-{rank:05d}"), b"")
    if rank != 0:
        return
    done = [os.path.join(root, f"loaded-{r:05d}") for r in range(world_size)]
    try:
        sync.wait_until(lambda: all(os.path.exists(d) for d in done), sync.save_timeout(),
                        lambda: f"reshard_state: ranks {[r for r, d in enumerate(done) if not os.path.exists(d)]} "
                                f"did not finish loading {root}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def reconfigure(model, optimizer, new_strategy, *, build=None, state_fn=None, tmp_dir=None):
    """Rebuild ``model`` and ``optimizer`` under ``new_strategy`` keeping every trained value.

    ``build(new_strategy) -> (new_model, new_optimizer)`` constructs them in the new layout; by default
    (``build=None``) a fresh model of the same class and ``config`` is built under ``paddle.LazyGuard`` (no
    values are drawn for it: they are overwritten, and the random generators are left as they were), the
    optimizer cloned with the same hyperparameters, and both passed to ``ap.parallelize``. ``state_fn(model,
    optimizer) -> dict`` names their state the same way under both layouts (default: ``training_state``).
    Returns ``(new_model, new_optimizer)``.
    """
    from autoparallel.checkpoint.state import training_state

    if build is None:                       # every problem of the default rebuild named at once
        from autoparallel.strategy import Strategy

        problems = []
        if not isinstance(new_strategy, Strategy):
            problems.append(f"new_strategy must be an ap.Strategy (the default build parallelizes with it), got "
                            f"{type(new_strategy).__name__} {new_strategy!r}")
        try:
            build = default_build(model, optimizer)
        except TypeError as e:
            problems.append(str(e))
        if problems:
            raise TypeError("; ".join(problems))
    if not callable(build):
        raise TypeError(f"build must be a callable new_strategy -> (model, optimizer), got {type(build).__name__}")
    if state_fn is not None and not callable(state_fn):
        raise TypeError(f"state_fn must be a callable (model, optimizer) -> dict, got {type(state_fn).__name__}")
    _check_tmp_dir(tmp_dir)
    state_fn = state_fn or training_state
    built = build(new_strategy)
    if not isinstance(built, tuple) or len(built) != 2:
        raise TypeError(f"build(new_strategy) must return (model, optimizer), got {type(built).__name__}")
    new_model, new_optimizer = built
    reshard_state(state_fn(model, optimizer), state_fn(new_model, new_optimizer), tmp_dir=tmp_dir)
    return new_model, new_optimizer


def _old_names(model, fresh) -> dict:
    """{fresh parameter name: the name of the model's parameter at the same structured name}: the rebuilt
    optimizer's groups and name-based hooks (``apply_decay_param_fun``) see the names the user's optimizer knew."""
    old = dict(model.named_parameters())
    return {p.name: old[n].name for n, p in fresh.named_parameters() if n in old}


def _carry_param_attrs(model, fresh) -> None:
    """``fresh``'s parameters take what the user set on ``model``'s after building it (``p.stop_gradient``,
    ``p.regularizer``, ``p.optimize_attr``, ``p.need_clip``, attributes of their own): a model rebuilt from its
    config has only what its constructor set, and trained on silently without them."""
    from autoparallel.param_carry import carry_attributes, follow_optimizer_attrs

    old = dict(model.named_parameters())
    for n, p in fresh.named_parameters():
        if n in old:
            p.stop_gradient = old[n].stop_gradient
            follow_optimizer_attrs(old[n], p)
            carry_attributes(old[n], p)


def default_build(model, optimizer):
    """``build`` for a model constructed as ``type(model)(model.config)`` and a paddle optimizer (any wrapper)."""
    cls, config = type(model), getattr(model, "config", None)
    if config is None:
        raise TypeError(f"reconfigure can rebuild only models constructed as type(model)(model.config); "
                        f"{cls.__name__} has no .config: pass build=lambda strategy: (model, optimizer)")

    def build(strategy):
        import paddle

        import autoparallel as ap
        from autoparallel.checkpoint.state import paddle_optimizer
        from autoparallel.parallel.optim_clone import clone_optimizer, copy_group_clips

        rng = paddle.get_rng_state()
        lazy = strategy.pipeline_parallel.degree <= 1        # the pipeline builds its stages from real values
        with fresh_parameter_names(), (paddle.LazyGuard() if lazy else contextlib.nullcontext()):
            fresh = cls(config)
        _carry_param_attrs(model, fresh)
        opt = None
        if optimizer is not None:
            inner = paddle_optimizer(optimizer)
            opt = clone_optimizer(inner, fresh.parameters(), _old_names(model, fresh))
            opt._grad_clip = inner._grad_clip
            copy_group_clips(inner, opt)
        out = ap.parallelize(fresh, opt, strategy)
        paddle.set_rng_state(rng)
        return out

    return build
