"""A manager's checkpoint holds the LR schedule the resumed loop starts from, not the one inside the step.

paddle's loop steps its scheduler after the optimizer (``opt.step(); opt.clear_grad(); scheduler.step()``). A
save made from inside an optimizer step (``strategy.checkpoint``'s post-step hook) captured the schedule one
scheduler step behind the parameters, and a resumed run trained on with the previous step's learning rate
(measured: GPT-tiny, StepDecay, every resumed update one schedule step behind; the second resumed loss off by 5e-4).

So a save made from an optimizer's post-step hook follows the optimizer's scheduler until the optimizer's next
step: each ``scheduler.step()`` made in between rewrites the checkpoint's saved schedule (rank 0,
``metadata.json`` replaced atomically with its checksum renewed). A step the loss scaler skips runs no hooks; its
counters end the window too, and so does a restore. A save the loop itself makes (``manager.save(state, step)``)
holds the schedule as it stands at the call, as every other value: the loop chose the point. The window needs the
optimizer's post-step hooks (the ap wrappers, parallel/step_hooks.py).

A loop that steps its scheduler at the start of an iteration, before the forward (against paddle's order), is
recorded one scheduler step ahead: keep paddle's order, or save after the step with ``ap.save_state_dict``.
"""
from __future__ import annotations

import os
import sys
import types
import warnings
import weakref

_WINDOWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # scheduler -> its open _Window


class _Window:
    """Checkpoint ``path`` (written by the save ``nonce``) follows ``sched`` until ``optimizer``'s next step."""

    def __init__(self, sched, path: str, nonce: str, optimizer):
        self.sched, self.path, self.nonce = weakref.ref(sched), path, nonce
        self.optimizer, self.marks = weakref.ref(optimizer), _amp_marks(optimizer)
        self.handle = optimizer.register_step_post_hook(lambda _opt: self.close())

    def stepped(self) -> bool:
        """Whether the optimizer took a step since the save that ran no post-step hooks (a step the loss scaler
        skipped on overflow moves its counters)."""
        opt = self.optimizer()
        return opt is None or _amp_marks(opt) != self.marks

    def close(self) -> None:
        self.handle.remove()
        sched = self.sched()
        if sched is not None and _WINDOWS.get(sched) is self:
            del _WINDOWS[sched]
            if isinstance(vars(sched).get("step"), types.MethodType) and vars(sched)["step"].__func__ is _step:
                del vars(sched)["step"]             # the class's step again


def follow(optimizer, path: str) -> None:
    """After a save of ``path`` made from a post-step hook: let ``optimizer``'s scheduler steps before its next
    step reach the checkpoint's saved schedule (rank 0; nothing without a scheduler or post-step hooks)."""
    from autoparallel.checkpoint import runtime_state, sync

    sched = runtime_state._scheduler(optimizer)
    register = getattr(optimizer, "register_step_post_hook", None)
    if sched is None or not callable(register) or sync.job()[1] != 0 or not in_step_hook():
        return
    nonce = _nonce(path)
    if nonce is None:
        return
    old = _WINDOWS.get(sched)
    if old is not None:
        old.close()
    _WINDOWS[sched] = _Window(sched, path, nonce, optimizer)
    vars(sched)["step"] = types.MethodType(_step, sched)


def forget(optimizer) -> None:
    """Close the window of ``optimizer``'s scheduler (a restore replaced the state the saved step left)."""
    from autoparallel.checkpoint import runtime_state

    sched = runtime_state._scheduler(optimizer)
    window = _WINDOWS.get(sched) if sched is not None else None
    if window is not None:
        window.close()


def in_step_hook() -> bool:
    """Whether this call runs inside an optimizer's post-step hooks (parallel/step_hooks.py), i.e. before the
    loop's own code after ``opt.step()``."""
    from autoparallel.parallel.step_hooks import StepHooks

    code, frame = StepHooks._after_step.__code__, sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _step(sched, *args, **kwargs):
    """The scheduler's own ``step``, then the open window's checkpoint takes the new schedule."""
    out = type(sched).step(sched, *args, **kwargs)
    window = _WINDOWS.get(sched)
    if window is not None and window.stepped():
        window.close()                  # the loop is past the saved step: this scheduler step is not its
    elif window is not None:
        _rewrite(window, sched)
    return out


def _amp_marks(optimizer) -> tuple:
    """The loss scaler's skipped-step count, scale and counters (empty without AMP)."""
    from autoparallel.checkpoint.state import wrapper_chain

    for opt in wrapper_chain(optimizer):
        scaler = vars(opt).get("scaler") if hasattr(opt, "__dict__") else None
        if hasattr(scaler, "scale_value"):
            return (getattr(opt, "skipped", None), scaler.scale_value, scaler.good_steps, scaler.bad_steps)
    return ()


def _nonce(path: str):
    import json

    from autoparallel.checkpoint.format import METADATA

    try:
        with open(os.path.join(path, METADATA), "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return meta.get("nonce") if isinstance(meta, dict) else None


def _rewrite(window: _Window, sched) -> None:
    """The checkpoint's saved schedule becomes ``sched``'s; a failure closes the window with a warning naming the
    checkpoint and the schedule it keeps."""
    from autoparallel.checkpoint.atomic import write_file_atomic
    from autoparallel.checkpoint.errors import CheckpointError
    from autoparallel.checkpoint.format import METADATA, METADATA_CRC, encode_metadata, read_metadata
    from autoparallel.checkpoint.runtime_state import _schedule

    try:
        meta = read_metadata(window.path)
        if meta.get("nonce") != window.nonce:       # replaced by another save since: not this window's to change
            window.close()
            return
        runtime = meta.get("runtime") if isinstance(meta.get("runtime"), dict) else {}
        new = _schedule(sched)
        if all(runtime.get(k) == v for k, v in new.items()):
            return
        meta["runtime"] = {**runtime, **new}
        meta.pop(METADATA_CRC, None)
        write_file_atomic(os.path.join(window.path, METADATA), encode_metadata(meta))
    except (OSError, CheckpointError) as e:
        window.close()
        warnings.warn(f"checkpoint {window.path} keeps the LR schedule it was saved with, from before this "
                      f"{type(sched).__name__}.step() (now last_epoch {sched.last_epoch}): updating its "
                      f"metadata failed ({type(e).__name__}: {e}); a resume from it starts one scheduler step "
                      f"behind", RuntimeWarning, stacklevel=3)
