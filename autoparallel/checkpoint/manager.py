"""CheckpointManager: periodic saves under one root, ``keep_last`` pruning, resume from the newest complete.

```
<dir>/.autoparallel-run      marks the directory as one run's root (run_root.py)
<dir>/step-00000100/        complete checkpoints (save_state_dict output)
<dir>/step-00000200.tmp-…   a save in progress, or interrupted (removed by the next start or successful save)
<dir>/latest                "step-00000200": the newest complete checkpoint, the one resume loads
```

A root belongs to one run. ``start(state, resume=...)`` validates it before the first training step (a
writable directory with room for one checkpoint, not another run's checkpoints or the user's files
unless resuming; run_root.py), tidies what an interrupted save left and, with ``resume=True``, restores the
newest checkpoint. A ``save`` or ``restore`` before ``start`` does the same checks then. Steps only grow:
saving a step older than the root's newest checkpoint is refused, so ``latest`` and resume always agree.

With ``optimizer=`` the manager also saves and restores the run state that is not a tensor: every rank's
random generators (restored under the same world size), the AMP loss scale and the LR schedule
(runtime_state.py), in the metadata's ``runtime``.

Resume loads the highest-step complete directory (discovery.py); ``latest`` is rewritten to name it at
start-up and after every save (a crash between a commit and the pointer update is repaired then). Rank 0
alone writes ``latest`` and prunes (``latest`` first: a failed pointer write prunes nothing), and every rank
learns the outcome before going on (sync.rank_zero_step): a failure there is a CheckpointSaveError on every rank.

Preemption: ``install_sigterm_handler()`` turns SIGTERM into a request; the training loop calls
``should_stop()`` at a step boundary (all ranks agree through one small all_reduce in a real job) and then
``save(state, step)`` a final time before exiting.
"""
from __future__ import annotations

import json
import os
import shutil
import signal

from autoparallel.checkpoint import run_root, runtime_state, schedule_follow, shared_dir, sync
from autoparallel.checkpoint.atomic import new_nonce, temp_dir_for
from autoparallel.checkpoint.collect import plain_step
from autoparallel.checkpoint.discovery import (complete_checkpoints, is_committed_aside, newest_complete,
                                               refuse_nested, step_dir_name)
from autoparallel.checkpoint.errors import (CheckpointCorruptError, CheckpointError, CheckpointLayoutError,
                                          CheckpointRootError)
from autoparallel.checkpoint.format import METADATA
from autoparallel.checkpoint.load import CheckpointInfo, load_state_dict
from autoparallel.checkpoint.ownership import is_owned_partial
from autoparallel.checkpoint.run_root import LATEST  # noqa: F401  (the pointer's name, as before)
from autoparallel.checkpoint.save import save_state_dict
from autoparallel.compat import WeakAttr


class CheckpointManager:
    optimizer = WeakAttr()             # held weakly: the current run keeps its manager (auto_checkpoint)

    def __init__(self, dir: str = "checkpoints", save_interval_steps: int = 100, keep_last=None,
                 enable: bool = True, optimizer=None):
        save_interval_steps, keep_last = plain_step(save_interval_steps), plain_step(keep_last)   # numpy ints
        if isinstance(save_interval_steps, bool) or not isinstance(save_interval_steps, int) or save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be a positive int, got {save_interval_steps!r}")
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None (keep all), got {keep_last!r}")
        if not isinstance(dir, (str, os.PathLike)):
            raise TypeError(f"dir must be a path (str or os.PathLike), got {type(dir).__name__} {dir!r}")
        if not isinstance(enable, bool):
            raise TypeError(f"enable must be a bool, got {type(enable).__name__} {enable!r}")
        if enable and os.path.lexists(dir) and not os.path.isdir(dir):     # found now, not at the first save
            raise CheckpointRootError(f"checkpoint root {os.fspath(dir)!r} is a file, expected a directory (or a "
                                      f"path that does not exist yet)")
        self.dir = os.path.abspath(os.fspath(dir))
        self.save_interval_steps = save_interval_steps
        self.keep_last = keep_last
        self.enable = bool(enable)
        self._stop_requested = False
        self._previous_handler = None
        self._started = False                  # start() validated and claimed the root for this run
        self._resumed = False                  # restore() continued the run found in the root
        self.optimizer = optimizer             # its loss scaler and LR schedule are saved with the generators

    @classmethod
    def from_strategy(cls, strategy, optimizer=None) -> "CheckpointManager":
        """From ``strategy.checkpoint`` (enable, save_interval_steps, dir, keep_last)."""
        c = strategy.checkpoint
        return cls(c.dir, c.save_interval_steps, c.keep_last, c.enable, optimizer)

    # ---- the run root ---------------------------------------------------------------------------------
    def start(self, state=None, *, resume: bool = False):
        """Before the first training step (collective): validate the root for ``state`` (a writable
        directory with the free space of one checkpoint), refuse it if it is another run's (``resume=False``
        and checkpoints already there) or holds the user's files, tidy interrupted saves, mark it, point
        ``latest`` at the newest checkpoint. ``resume=True`` with a ``state``: restore the newest checkpoint
        into it and return the CheckpointInfo (None if the root has none). Raises CheckpointRootError or
        CheckpointOwnershipError with nothing changed."""
        if not isinstance(resume, bool):
            raise TypeError(f"resume must be a bool, got {type(resume).__name__} {resume!r}")
        self._claim(state, resume)
        if resume and state is not None:
            return self.restore(state)
        return None

    def _claim(self, state, resume: bool) -> None:
        """``start`` without the restore (collective): validate, claim and mark the root."""
        need = run_root.estimate_bytes(state)
        _, rank, _ = sync.job()
        problem = None
        try:
            run_root.check_usable(self.dir, need, rank)
        except BaseException as e:      # CheckpointRootError, or anything else: every rank learns it (agree)
            problem = e
        run_root.agree(problem)
        shared_dir.check_one_directory(self.dir)          # one directory every rank sees, before rank 0 marks it
        try:
            if rank == 0:
                run_root.claim(self.dir, resume)
        except BaseException as e:      # CheckpointOwnershipError, a Ctrl-C, ...: the others wait in agree for it
            problem = e
        run_root.agree(problem)
        self._started = True
        self._resumed = self._resumed or resume

    # ---- saving -------------------------------------------------------------------------------------
    def path_for(self, step: int) -> str:
        return os.path.join(self.dir, step_dir_name(step))

    def should_save(self, step: int) -> bool:
        return self.enable and step > 0 and step % self.save_interval_steps == 0

    def maybe_save(self, state: dict, step: int, extra=None):
        """Save when ``step`` is a multiple of ``save_interval_steps`` (and enabled); returns the path or None."""
        return self.save(state, step, extra) if self.should_save(step) else None

    def save(self, state: dict, step: int, extra=None) -> str:
        """Save now as ``step`` (replacing an existing checkpoint of that step), update ``latest``, prune."""
        step = plain_step(step)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r} ({type(step).__name__})")
        if not self._started:      # claim the root; never load here (after restore() that would undo the steps since)
            self._claim(state, self._resumed)
        newest = complete_checkpoints(self.dir)
        if newest and step < newest[-1][0]:
            raise ValueError(f"step {step} is older than the newest checkpoint in {self.dir!r} (step "
                             f"{newest[-1][0]}): a run's steps only grow, and resume loads the newest")
        optimizer = self._optimizer_of(state)
        path = save_state_dict(state, self.path_for(step), step=step, extra=extra, overwrite=True,
                               runtime=runtime_state.capture(optimizer))
        schedule_follow.follow(optimizer, path)        # the loop's scheduler step after this one belongs to it
        doomed = []
        try:                                   # rank 0 only, its outcome shared with every rank before any goes on
            sync.rank_zero_step(f"checkpoint {path} is saved, but updating its run root after it (rank 0 only)",
                                lambda: self._update_root(doomed))
        finally:
            for old in doomed:                 # best effort: what stays is a temporary directory of ours, which the
                shutil.rmtree(old, ignore_errors=True)      # next save or start removes
        return path

    def _update_root(self, doomed: list) -> None:
        """Rank 0 after a commit: point ``latest`` at the newest checkpoint, then prune. ``latest`` first: if it
        cannot be written, nothing is pruned, so the checkpoint it still names stays loadable."""
        try:
            run_root.write_latest(self.dir)
        except OSError as e:
            raise _in_context(e, "writing 'latest' (it still names the previous checkpoint; nothing was pruned)")
        try:
            self._prune(doomed)
        except OSError as e:
            raise _in_context(e, "pruning (after 'latest' was updated)")

    def _prune(self, doomed: list) -> None:
        """Collect in ``doomed`` the temporary directories a save of ours left and the checkpoints beyond
        ``keep_last``, each renamed first to a temporary name: one rename takes it out of the complete ones at
        once, so a failure (or a crash) while removing its files never leaves a half-removed checkpoint that
        looks complete. The caller removes them once every rank knows the outcome."""
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            if is_owned_partial(path):
                doomed.append(path)
        if self.keep_last is None:
            return
        done = complete_checkpoints(self.dir)
        for _, path in done[:max(0, len(done) - self.keep_last)]:
            aside = temp_dir_for(path, new_nonce())
            os.rename(path, aside)
            doomed.append(aside)

    def _optimizer_of(self, state):
        """The optimizer whose loss scaler and LR schedule go with the generators: the manager's, else the one
        ``ap.training_state`` was built over (saving such a state without ``optimizer=`` dropped its schedule)."""
        return self.optimizer if self.optimizer is not None else getattr(state, "optimizer", None)

    # ---- resuming -----------------------------------------------------------------------------------
    def latest(self):
        """The newest complete checkpoint under ``dir`` (None if there is none)."""
        return newest_complete(self.dir, with_aside=True)

    def steps(self) -> list:
        return [s for s, _ in complete_checkpoints(self.dir)]

    def restore(self, state: dict, strict: bool = True):
        """Load the newest complete checkpoint into ``state`` and the run state it saved (generators, loss
        scale, LR schedule: ``info.restored`` names what was restored); CheckpointInfo, or None."""
        path = _same_on_every_rank(self.latest(), self.dir)
        if path is None:                       # nothing to resume, unless the checkpoints are one level down
            problem = None
            try:
                if os.path.isdir(self.dir):
                    refuse_nested(self.dir)
            except CheckpointLayoutError as e:
                problem = e
            run_root.agree(problem)
            return None
        info, problem = None, None
        try:
            schedule_follow.forget(self._optimizer_of(state))     # the loaded schedule is not the saved step's
            info = load_state_dict(state, path, strict=strict)
            done = runtime_state.restore(info.runtime, self._optimizer_of(state), state)
            info.restored = done + [x for x in info.restored if x not in done]
        except CheckpointCorruptError as e:
            problem = CheckpointCorruptError(f"{e}. {self._previous_hint(path)}")
        except BaseException as e:             # any failure, a Ctrl-C too: the other ranks wait in agree for it
            problem = e
        run_root.agree(problem)                # a rank that could not load stops every rank, not only itself
        self._resumed = True                   # later saves continue this run
        sync.rank_zero_step(f"checkpoint {path} is loaded on every rank, but repairing {self.dir}/latest after it "
                            f"(rank 0 only)", lambda: self._repair_latest(path), CheckpointError)
        return info

    def _repair_latest(self, loaded: str) -> None:
        """Rank 0 after a restore: ``latest`` names the checkpoint loaded (a crash between a commit and its pointer
        update); a read-only root, or a checkpoint still aside (the next start puts it back), is left as it is."""
        if os.access(self.dir, os.W_OK) and not is_committed_aside(loaded):
            run_root.write_latest(self.dir)

    def _previous_hint(self, broken: str) -> str:
        """Resume never falls back on its own (a run would silently lose steps): name the way back."""
        older = [p for s, p in complete_checkpoints(self.dir) if p != broken]
        if not older:
            return "No older complete checkpoint is in the root"
        return (f"The newest older complete checkpoint is {os.path.basename(older[-1])}: move "
                f"{os.path.basename(broken)} out of {self.dir!r} to resume from it")

    # ---- preemption ---------------------------------------------------------------------------------
    def install_sigterm_handler(self) -> None:
        """SIGTERM sets a stop request (main thread only); the previous handler is restored by
        ``uninstall_sigterm_handler``."""
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def uninstall_sigterm_handler(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def _on_sigterm(self, signum, frame) -> None:
        self._stop_requested = True

    def request_stop(self) -> None:
        self._stop_requested = True

    def should_stop(self) -> bool:
        """True on every rank when any rank was asked to stop (one all_reduce(max) in a real job)."""
        multi, _, _ = sync.job()
        if not multi:
            return self._stop_requested
        import paddle
        import paddle.distributed as dist

        flag = paddle.to_tensor([1 if self._stop_requested else 0], dtype="int32")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(int(flag.numpy()[0]))


def _in_context(e: OSError, what: str) -> OSError:
    """``e`` (same type, errno and file) saying which step of the run root's update it stopped."""
    if e.errno is None:
        return type(e)(f"{what}: {e}")
    return type(e)(e.errno, f"{what}: {e.strerror or e}", e.filename)


def _same_on_every_rank(path, root: str):
    """``path`` (the checkpoint this rank would resume from) once every rank of a real job found the same one,
    by path and by the save that wrote it (its metadata's nonce: node-local roots can hold different saves under
    one path); CheckpointError on every rank otherwise (a root that is not one shared directory for every rank)."""
    multi, _, _ = sync.job()
    if not multi:
        return path
    from autoparallel import watchdog

    with watchdog.op("checkpoint resume (all_gather)"):
        found = sync.all_gather_json([path, _save_nonce(path)])
    if len({json.dumps(f) for f in found}) > 1:
        raise CheckpointError(f"checkpoint root {root!r}: the ranks would resume from different checkpoints ("
                              + ", ".join(f"rank {r}: {p} (save {n})" for r, (p, n) in enumerate(found))
                              + "); the root must be one directory every rank sees. Nothing was loaded")
    return path


def _save_nonce(path):
    """The nonce of the save that wrote the checkpoint at ``path`` (None if none or unreadable: the load that
    follows names the problem, and every rank agrees on it)."""
    if path is None:
        return None
    try:
        with open(os.path.join(path, METADATA), "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    return meta.get("nonce") if isinstance(meta, dict) and isinstance(meta.get("nonce"), str) else None


__all__ = ["CheckpointManager", "CheckpointInfo"]
