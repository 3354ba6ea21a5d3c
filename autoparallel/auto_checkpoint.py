"""``strategy.checkpoint`` in the plain training loop: saves without extra calls, and the current run.

    strategy.checkpoint.enable = True
    strategy.checkpoint.save_interval_steps = 1000          # optimizer steps between saves
    strategy.checkpoint.dir = "checkpoints"                 # one step-NNNNNNNN/ directory per save
    model, opt = ap.parallelize(model, opt, strategy=strategy)      # or ap.DataParallel + ap.Optimizer
    for batch in loader:
        loss = model(batch); loss.backward(); opt.step(); opt.clear_grad()   # saves at steps 1000, 2000, ...

The entry points call ``attach(model, optimizer, strategy)``. It records the run (model, optimizer,
strategy) as the process's *current run* — what ``resume_from_last_checkpoint()``,
``fallback_to_cpu_offload(model)`` and ``PerformanceMonitor.suggest_optimal_strategy()`` use when the
article calls them without the objects — and, when ``strategy.checkpoint.enable``, registers a post-step
hook on the optimizer the entry point returned. The hook counts the steps that updated the parameters (a
step skipped by the loss scaler on overflow does not count; under gradient accumulation one count per
accumulation window) and saves ``training_state(model, optimizer)`` through a ``CheckpointManager``
(atomic directories, ``keep_last`` pruning, generators, loss scale and LR schedule) every
``save_interval_steps``. Every rank steps, so every rank saves: the save is collective, as it must be.
"""
from __future__ import annotations

from typing import Optional

from autoparallel.compat import WeakAttr


class Run:
    """The current run. The model and optimizer are held weakly: the run is a module global, and a notebook
    that drops its model (or builds the next one) must get the memory back; a run whose model is gone is no
    longer current."""
    model = WeakAttr()
    optimizer = WeakAttr()

    def __init__(self, model, optimizer=None, strategy=None):
        self.model, self.optimizer, self.strategy = model, optimizer, strategy
        self.manager = None            # CheckpointManager when strategy.checkpoint.enable
        self.step = 0                  # optimizer steps taken (restored by resume)
        self.saved: list = []          # paths saved by the hook, oldest first
        self.input_shape: Optional[list] = None     # global shape of the last batch the model saw (the planner's)
        self._handle = None

    def after_step(self, _optimizer=None) -> Optional[str]:
        self.step += 1
        if self.manager is None or not self.manager.should_save(self.step):
            return None
        path = self.manager.save(self.state(), self.step)
        self.saved.append(path)
        return path

    def state(self) -> dict:
        from autoparallel.checkpoint.state import training_state

        return training_state(self.model, self.optimizer)


_current: Optional[Run] = None


def attach(model=None, optimizer=None, strategy=None) -> Run:
    """Make (model, optimizer, strategy) the current run; hook periodic saves when the strategy asks.

    ``ap.DataParallel(model, strategy=s)`` attaches the model (no optimizer yet: nothing is hooked);
    ``ap.Optimizer(opt)`` then attaches the optimizer with ``model=None``, taking the model and strategy of
    the current run."""
    global _current
    from autoparallel.parallel.amp_scaler import install

    install()                                   # paddle.amp.GradScaler understands our optimizers
    if model is None:
        if current_run() is None:
            raise RuntimeError("attach(optimizer=...) without a model needs a model set up first "
                               "(ap.DataParallel(model, strategy=...))")
        model = _current.model
        strategy = _current.strategy if strategy is None else strategy
    if _current is not None and _current._handle is not None and optimizer is not None \
            and _current.optimizer is optimizer:
        _current._handle.remove()             # the same optimizer attached again: one hook
    run = Run(model, optimizer, strategy)     # earlier runs keep their hooks (and keep saving)
    if _current is not None and same_object(_current.model, model):
        run.input_shape, run.step = _current.input_shape, _current.step
    else:
        _watch_inputs(model, run)
    ck = getattr(strategy, "checkpoint", None)
    if ck is not None and ck.enable and optimizer is not None:
        from autoparallel.checkpoint.manager import CheckpointManager

        run.manager = CheckpointManager.from_strategy(strategy, optimizer)
        run._handle = _register(optimizer, run.after_step)
    elif callable(getattr(optimizer, "register_step_post_hook", None)):
        run._handle = optimizer.register_step_post_hook(run.after_step)     # counts steps (resume, reconfigure)
    _current = run
    return run


def _watch_inputs(model, run: Run) -> None:
    """Record the global shape of the first tensor input of every forward (for re-planning), positional or
    keyword (``model(**batch)``, ``model(input_ids=ids, labels=labels)``)."""
    hook = getattr(model, "register_forward_pre_hook", None)
    if hook is None:
        return

    def record(values) -> None:
        for x in values:
            shape = getattr(x, "shape", None)
            if shape is not None and len(shape) >= 1:
                cur = _current if _current is not None and same_object(_current.model, model) else run
                cur.input_shape = [int(n) for n in shape]
                return

    try:
        hook(lambda _layer, args, kwargs: record(list(args) + list(kwargs.values())), with_kwargs=True)
    except TypeError:                           # a pre-hook without keyword inputs (not a paddle Layer)
        hook(lambda _layer, inputs: record(inputs))


def same_object(a, b) -> bool:
    """``a is b``, or one was turned into an alias of the other (``reconfigure_distributed_model`` in place:
    they share the attribute dict)."""
    return a is b or (a is not None and b is not None and hasattr(a, "__dict__") and a.__dict__ is b.__dict__)


def _register(optimizer, fn):
    register = getattr(optimizer, "register_step_post_hook", None)
    if not callable(register):
        raise TypeError(f"strategy.checkpoint needs an optimizer returned by ap.parallelize / ap.Optimizer / "
                        f"ap.shard_optimizer (it saves from their post-step hook), got {type(optimizer).__name__}")
    return register(fn)


def current_run(required: str = None) -> Optional[Run]:
    """The run the last entry point set up; with ``required`` (the caller's name) a RuntimeError if none."""
    global _current
    if _current is not None and _current.model is None:       # its model was collected
        _current = None
    if _current is None and required is not None:
        raise RuntimeError(f"{required}() without arguments acts on the current run, but no model was set up by "
                           f"ap.parallelize / ap.DataParallel + ap.Optimizer in this process; pass the model and "
                           f"optimizer explicitly")
    return _current


def reset() -> None:
    """Forget the current run (tests; a new entry point call replaces it anyway)."""
    global _current
    if _current is not None and _current._handle is not None:
        _current._handle.remove()
    _current = None


__all__ = ["attach", "current_run", "Run", "reset"]
