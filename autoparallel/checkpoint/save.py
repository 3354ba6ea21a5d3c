"""``save_state_dict``: every rank writes the shards it owns, rank 0 writes the metadata, then commits.

Replicas are written once (the owner has coordinate 0 on every Replicate mesh dim, see layout.py).
Ranks may hold different entries (pipeline stages): rank 0's metadata is the union of every rank's.
Partial tensors are reduced first (one collective per Partial tensor, before any file is written), so a
checkpoint stores values, never pending terms, and loads under any layout. Plain paddle tensors and numpy
arrays are taken to be identical on every rank and written by rank 0; JSON values and ``extra`` go into
the metadata. The rendezvous of a real job is described in sync.py; in one process (a single rank or the
simulated world) the process writes every rank's file itself.
"""
from __future__ import annotations

import json
import os
import shutil
import time

from autoparallel.checkpoint import save_agree, shared_dir, sync
from autoparallel.checkpoint.atomic import (fault_point, is_empty_dir, new_nonce, publish_dir, temp_dir_for,
                                            write_file_atomic)
from autoparallel.checkpoint.collect import check_values, collect, json_value, plain_step
from autoparallel.checkpoint.errors import CheckpointOwnershipError, CheckpointSaveError
from autoparallel.checkpoint.flatten import flatten
from autoparallel.checkpoint.format import BLOCK_BYTES, FORMAT, METADATA, VERSION, encode_metadata
from autoparallel.checkpoint.ownership import CKPT_MARKER, check_replaceable, marker_bytes, not_a_checkpoint
from autoparallel.config.fields import integral
from autoparallel.checkpoint.writer import write_rank_file

RUNTIME_PREFIX = "/runtime/"        # no state name starts with "/" (flatten.py): the run state's arrays

FAILED = "FAILED"


def save_state_dict(state: dict, path: str, *, step=None, extra=None, overwrite: bool = False,
                    block_bytes: int = BLOCK_BYTES, runtime=None) -> str:
    """Save a (nested) dict of DistTensor / DistParameter / paddle.Tensor / numpy / JSON values to ``path``.

    Every rank of a job must call it with the same structure. ``step`` and ``extra`` (JSON: data-loader
    position, strategy dict, ...) are stored in the metadata and returned by ``load_state_dict``. ``path``
    appears only when the checkpoint is complete; an existing ``path`` needs ``overwrite=True``, which replaces
    only a single checkpoint directory written by autoparallel (anything else: CheckpointOwnershipError, nothing
    changed; ownership.py). A save that fails removes its temporary directory.
    ``block_bytes``: checksum granularity (a partial read verifies whole blocks). Returns the absolute
    path of the checkpoint. ``runtime``: the run state beyond tensors (generators, loss scale, LR schedule;
    runtime_state.py): a dict of JSON values and numpy arrays, kept apart from the user's ``extra``.
    """
    from autoparallel import watchdog

    multi, rank, world_size = sync.job()
    step = plain_step(step)             # np.int64 from a numpy counter: the int it is
    block_bytes = plain_step(block_bytes)
    if runtime is None:                 # ap.training_state over an optimizer with an LR scheduler: keep its schedule
        from autoparallel.checkpoint.runtime_state import schedule_runtime

        runtime = schedule_runtime(state)
    if multi:                           # every rank must call it: on some ranks only, refused on every rank
        from autoparallel.comm import agreement
        from autoparallel.comm.world import current_world

        agreement.check_world("save_state_dict", rank, world_size, current_world().backend)
        from autoparallel.comm import collective_log

        if collective_log.enabled():    # the collectives so far agree on every rank, or nothing is written
            collective_log.check_save_entry(rank, world_size)
    token, probe = new_nonce(), None
    try:                                # a rank's own input error stops every rank at the exchange, at once
        flat, final, extra, runtime, runtime_arrays = _checked(state, path, step, extra, overwrite, block_bytes,
                                                               runtime)
        if multi:                       # every rank's mark in the directory it would write (shared_dir.py)
            probe = shared_dir.leave_probe(final, token, rank)
        problem = None
    except BaseException as e:          # an input error, a Ctrl-C, ...: sent in the exchange, raised on every rank
        flat, final, problem = {}, os.fspath(path) if isinstance(path, (str, os.PathLike)) else repr(path), e
    try:                                # the same reductions and one directory on every rank, before any write
        nonce = save_agree.agree(flat, token, final, problem, probe)
    finally:
        shared_dir.remove_probe(probe)
    tmp = temp_dir_for(final, nonce)

    def collect_and_write():
        _collect_and_write(flat, runtime_arrays, tmp, final, nonce, step, extra, runtime, overwrite, block_bytes,
                           (multi, rank, world_size))

    with watchdog.long_wait("checkpoint write"):
        if multi:
            _with_status_exchange(final, rank, collect_and_write)
        else:
            collect_and_write()
    return final


def _collect_and_write(flat, runtime_arrays, tmp, final, nonce, step, extra, runtime, overwrite, block_bytes,
                       job) -> None:
    multi, rank, world_size = job
    try:
        tensors, values, writes = collect(flat, rank, multi)
        more, _, more_writes = collect(runtime_arrays, rank, multi)
        tensors.update(more)
        for r, items in more_writes.items():
            writes.setdefault(r, []).extend(items)
        os.makedirs(tmp, exist_ok=True)
    except BaseException as e:
        if multi:
            _failed_before_writing(tmp, rank, world_size, e)
        raise
    meta = {"format": FORMAT, "version": VERSION, "step": step, "extra": extra, "runtime": runtime, "nonce": nonce,
            "world_size": world_size, "created": time.time(),
            "tensors": tensors, "values": values, "files": {}}
    if multi:
        _save_multi(meta, tmp, final, overwrite, rank, world_size, writes.get(rank, []), block_bytes)
        return
    try:
        write_file_atomic(os.path.join(tmp, CKPT_MARKER), marker_bytes("checkpoint"))   # ours, first
        for r in sorted(writes):
            _merge(meta, *write_rank_file(tmp, r, writes[r], block_bytes))
        _commit(meta, tmp, final, overwrite)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)       # a failed save leaves nothing behind
        if isinstance(e, Exception) and _committed(final, nonce):
            raise _after_commit(final, e) from e
        raise


def _with_status_exchange(final, rank, fn) -> None:
    """``fn()`` (this rank's collect and write), then one status exchange: a rank that failed raises its own
    error, every other rank a CheckpointSaveError naming it. Without it a failure on rank 0 after the commit's
    rename (the directory's fsync) left the other ranks, which had seen the commit, in their next collective until
    gloo's timeout."""
    error = None
    try:
        fn()
    except BaseException as e:          # a Ctrl-C too: the others must not wait for this rank in vain
        error = e
    try:
        failures = sync.gather_errors(error, f"checkpoint {final}: save status (all_gather)")
    except RuntimeError as e:           # gloo: a peer that left the save before the exchange
        if error is not None:
            raise error from None
        raise CheckpointSaveError(f"checkpoint {final}: a rank did not take part in the save's status exchange "
                                  f"(it left the save before it): {e}") from None
    if error is not None:
        zero = [(name, msg) for r, name, msg in failures if r == 0 and r != rank]
        if zero and isinstance(error, CheckpointSaveError) and any(u in str(error) for u in (_NO_NOTE, _BAD_NOTE)):
            # rank 0's failure note was missing or unreadable (a full disk): its own error, from the exchange
            raise CheckpointSaveError(f"{error}; rank 0 reported: {zero[0][0]}: {zero[0][1]}") from error
        raise error
    if failures:
        raise CheckpointSaveError(f"checkpoint {final}: the save failed on " +
                                  "; ".join(f"rank {r}: {name}: {msg}" for r, name, msg in failures))


def _checked(state, path, step, extra, overwrite, block_bytes, runtime) -> tuple:
    """This rank's arguments checked (nothing is written or communicated): (flat, final, extra, runtime JSON,
    runtime arrays)."""
    flat = flatten(state)
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__} {path!r}")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {type(overwrite).__name__} {overwrite!r}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"step must be an int or None, got {type(step).__name__} {step!r}")
    if step is not None and step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    extra = json_value("extra", extra)
    runtime, runtime_arrays = split_runtime(runtime)
    if integral(block_bytes) is None or block_bytes < 64 or block_bytes % 64:
        raise ValueError(f"block_bytes must be a positive multiple of 64, got {block_bytes!r}")
    check_values(flat)
    final = os.path.abspath(os.fspath(path))
    if os.path.lexists(final) and not is_empty_dir(final):
        if not overwrite:
            _refuse_existing(final)
        check_replaceable(final)
    parent = os.path.dirname(final)
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise NotADirectoryError(f"cannot save checkpoint {final!r}: {parent!r} is a file, not a directory")
    os.makedirs(parent, exist_ok=True)      # a parent that cannot be created fails here, before the exchange
    return flat, final, extra, runtime, runtime_arrays


def _refuse_existing(final: str) -> None:
    """A path that exists (without overwrite=True): a checkpoint of ours is offered overwrite=True; a file or a
    directory of something else is named for what it is (overwrite=True would not replace it either)."""
    why = not_a_checkpoint(final)
    if why is None:
        raise FileExistsError(f"checkpoint {final!r} already exists; pass overwrite=True to replace it")
    raise CheckpointOwnershipError(f"cannot save checkpoint {final!r}: the path already exists and {why}; save to a "
                                   f"new or empty directory (overwrite=True replaces only a checkpoint written by "
                                   f"autoparallel)")


def _failed_before_writing(tmp: str, rank: int, world_size: int, e: BaseException) -> None:
    """A rank that fails after the exchange, before its write, tells the others as a failed write does (rank 0
    also fails the save), rather than leaving them to wait for its marker."""
    try:
        os.makedirs(tmp, exist_ok=True)
    except OSError:
        pass                            # best effort, like the note itself; the caller raises the real error
    _note(_marker(tmp, rank) + ".failed", f"{type(e).__name__}: {e}")
    if rank == 0:
        _note(os.path.join(tmp, FAILED), f"{type(e).__name__}: {e}")
        _remove_after_acks(tmp, world_size)


def split_runtime(runtime) -> tuple:
    """(JSON part, {RUNTIME_PREFIX + name: (container, key, array)}) of the run state: its arrays are
    written like tensors (runtime_tensors in the metadata), everything else is JSON."""
    import numpy as np

    if runtime is None:
        return None, {}
    if not isinstance(runtime, dict):
        raise TypeError(f"runtime must be a dict of JSON values and numpy arrays, got {type(runtime).__name__}")
    arrays = {}

    def strip(d: dict, prefix: str) -> dict:
        out = {}
        for k, v in d.items():
            name = f"{prefix}{k}"
            if isinstance(v, np.ndarray):
                arrays[RUNTIME_PREFIX + name] = (out, k, v)
            else:
                out[k] = strip(v, name + "/") if isinstance(v, dict) else v
        return out

    return json_value("runtime", strip(runtime, "")), arrays


def _merge(meta: dict, entries: dict, file_info) -> None:
    for name, shards in entries.items():
        meta["tensors"][name].setdefault("shards", []).extend(shards)
    if file_info is not None:
        meta["files"][file_info["name"]] = {"size": file_info["size"], "crc32": file_info["crc32"]}


def _union(meta: dict, part: dict, final: str, rank: int = 0) -> None:
    """Add the entries only another rank has (a pipeline stage's) to rank 0's metadata; a name recorded by
    several ranks must agree on shape and dtype, a JSON value on its value."""
    for name, rec in part.get("tensors", {}).items():
        have = meta["tensors"].setdefault(name, {k: v for k, v in rec.items() if k != "shards"})
        if (list(have["shape"]), have["dtype"]) != (list(rec["shape"]), rec["dtype"]):
            raise CheckpointSaveError(f"checkpoint {final}: ranks disagree on {name!r}: shape {have['shape']} "
                                      f"{have['dtype']} and shape {rec['shape']} {rec['dtype']}")
    for name, value in part.get("values", {}).items():
        have = meta["values"].setdefault(name, value)
        if json.dumps(have) != json.dumps(value):      # one value per name is stored: the others would be lost
            raise CheckpointSaveError(f"checkpoint {final}: ranks disagree on the value {name!r}: "
                                      f"{json.dumps(have)[:200]} and {json.dumps(value)[:200]} (rank {rank}); a "
                                      f"checkpoint stores one value per name, so a per-rank value needs a name of "
                                      f"its own on its rank, or a tensor")


def _commit(meta: dict, tmp: str, final: str, overwrite: bool) -> None:
    for name, rec in meta["tensors"].items():
        rec.setdefault("shards", [])
    meta["runtime_tensors"] = {n[len(RUNTIME_PREFIX):]: meta["tensors"].pop(n) for n in list(meta["tensors"])
                               if n.startswith(RUNTIME_PREFIX)}
    _check_complete(meta, final)
    write_file_atomic(os.path.join(tmp, METADATA), encode_metadata(meta),
                      before_rename=lambda: fault_point("before_metadata_rename"))
    fault_point("after_metadata_rename")
    publish_dir(tmp, final, overwrite)
    fault_point("after_dir_rename")


def _check_complete(meta: dict, final: str) -> None:
    """Commit only what a load accepts: every tensor's shards, from every rank, hold each element once. A rank
    that did not pass an entry its peers hold (or held no shard of it) would otherwise leave a checkpoint that
    looks complete and fails only when it is needed."""
    from autoparallel.checkpoint.errors import CheckpointCorruptError
    from autoparallel.checkpoint.schema import validate_metadata

    try:
        validate_metadata(meta, final)
    except CheckpointCorruptError as e:
        raise CheckpointSaveError(f"checkpoint {final}: the ranks' shards do not make a complete checkpoint, "
                                  f"nothing was committed (every rank holding a part of an entry must pass it to "
                                  f"save_state_dict): {e}") from None


_NO_NOTE = "its temporary directory was removed without a commit"    # rank 0 failed, its note is missing
_BAD_NOTE = "the failure note is unreadable"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        return f"({_BAD_NOTE}: {e})"


def _note(path: str, text: str) -> None:
    """Best effort: a failure note on a full disk may itself fail; the caller raises the real error."""
    try:
        write_file_atomic(path, text.encode())
    except OSError:
        pass


ACK_WAIT_S = 5.0


def _remove_after_acks(tmp: str, world_size: int) -> None:
    """Rank 0 after a failed save: give the other ranks a moment to read the FAILED note (each drops an
    ``ack-<r>``, or has its own ``rank-<r>.json.failed``), then remove the temporary directory."""
    def acked(r: int) -> bool:
        return os.path.exists(os.path.join(tmp, f"ack-{r:05d}")) or os.path.exists(_marker(tmp, r) + ".failed")

    deadline = time.monotonic() + ACK_WAIT_S
    while time.monotonic() < deadline and not all(acked(r) for r in range(1, world_size)):
        time.sleep(0.05)
    shutil.rmtree(tmp, ignore_errors=True)


def _after_commit(final: str, e: Exception) -> CheckpointSaveError:
    return CheckpointSaveError(f"checkpoint {final}: rank 0 failed after the commit's rename: {type(e).__name__}: "
                               f"{e}; the checkpoint is complete on disk, but its directory entry may not be durable "
                               f"(a crash now could lose it)")


def _committed(final: str, nonce: str) -> bool:
    """``final`` holds the metadata of the save with ``nonce``."""
    try:
        with open(os.path.join(final, METADATA)) as f:
            return json.load(f).get("nonce") == nonce
    except (OSError, ValueError):
        return False


def _marker(tmp: str, rank: int) -> str:
    return os.path.join(tmp, f"rank-{rank:05d}.json")


def _save_multi(meta, tmp, final, overwrite, rank, world_size, items, block_bytes) -> None:
    try:
        if rank == 0:
            write_file_atomic(os.path.join(tmp, CKPT_MARKER), marker_bytes("checkpoint"))   # ours, first
        entries, info = write_rank_file(tmp, rank, items, block_bytes) if items else ({}, None)
        write_file_atomic(_marker(tmp, rank), json.dumps({"entries": entries, "file": info,
                                                          "tensors": meta["tensors"],
                                                          "values": meta["values"]}).encode())
    except BaseException as e:        # tell rank 0 at once rather than after AP_CKPT_TIMEOUT
        _note(_marker(tmp, rank) + ".failed", f"{type(e).__name__}: {e}")
        raise
    timeout = sync.save_timeout()
    if rank == 0:
        markers = [_marker(tmp, r) for r in range(world_size)]
        try:
            sync.wait_until(lambda: all(os.path.exists(m) or os.path.exists(m + ".failed") for m in markers),
                            timeout, lambda: f"checkpoint {final}: ranks "
                                             f"{[r for r, m in enumerate(markers) if not os.path.exists(m)]} did "
                                             f"not finish writing within {timeout:.0f} s (AP_CKPT_TIMEOUT)")
            failures = [(r, _read(m + ".failed")) for r, m in enumerate(markers) if os.path.exists(m + ".failed")]
            if failures:
                raise CheckpointSaveError(f"checkpoint {final}: writing failed on " +
                                          "; ".join(f"rank {r}: {why}" for r, why in failures))
            for r, m in enumerate(markers):
                with open(m) as f:
                    part = json.load(f)
                _union(meta, part, final, r)
                _merge(meta, part["entries"], part["file"])
            for m in markers:
                os.remove(m)
            _commit(meta, tmp, final, overwrite)
        except BaseException as e:
            if os.path.isdir(tmp):
                _note(os.path.join(tmp, FAILED), f"{type(e).__name__}: {e}")
                _remove_after_acks(tmp, world_size)
            elif _committed(final, meta["nonce"]) and isinstance(e, Exception):
                raise _after_commit(final, e) from e
            if isinstance(e, TimeoutError):
                raise CheckpointSaveError(str(e)) from None
            if isinstance(e, CheckpointSaveError) or not isinstance(e, Exception):
                raise                           # already says what failed where; a Ctrl-C stays a Ctrl-C
            raise CheckpointSaveError(f"checkpoint {final}: rank 0 could not commit: {type(e).__name__}: {e}; "
                                      f"nothing was committed") from e
        return
    failed = os.path.join(tmp, FAILED)

    def ours() -> bool:
        return _committed(final, meta["nonce"])

    def settled() -> bool:          # committed, failed, or the temporary directory removed by rank 0
        return ours() or os.path.exists(failed) or not os.path.isdir(tmp)

    try:
        sync.wait_until(settled, timeout, lambda: f"checkpoint {final}: rank 0 did not commit within "
                                                  f"{timeout:.0f} s (AP_CKPT_TIMEOUT)")
    except TimeoutError as e:           # typed as rank 0's own timeout is
        raise CheckpointSaveError(f"(rank {rank}) {e}") from None
    if ours():
        return
    why = _read(failed) if os.path.exists(failed) else _NO_NOTE
    _note(os.path.join(tmp, f"ack-{rank:05d}"), "")
    raise CheckpointSaveError(f"checkpoint {final}: rank 0 could not commit: {why}")
