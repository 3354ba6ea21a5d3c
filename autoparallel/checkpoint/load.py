"""``load_state_dict`` (into any layout, reading only the needed bytes) and ``load_merged_state_dict``.

Loading moves no tensor between ranks: each process reads, for every shard it holds in the target layout, the
parts of the saved shards that overlap it (saved and target layouts, meshes and world sizes are independent).
Everything is validated and read before any tensor is touched, so a failed load changes nothing. A real job's
load of a state spread over every rank makes one small status exchange between the reads and the first assignment,
so a failure on some ranks only fails every rank's load and leaves every rank's state as it was
(``_share_load_outcome``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

from autoparallel.checkpoint.discovery import resolve_checkpoint
from autoparallel.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError
from autoparallel.checkpoint.flatten import flatten, unflatten
from autoparallel.checkpoint.format import read_metadata, storage_dtype
from autoparallel.checkpoint.layout import intersect, local_pieces, numel, relative_slices
from autoparallel.checkpoint.leaves import HeldElsewhere, ShardedLeaf
from autoparallel.checkpoint.reader import ShardReader


@dataclass
class CheckpointInfo:
    path: str                 # the checkpoint directory that was loaded
    step: object              # the step given to save_state_dict (None if none)
    extra: object             # the extra given to save_state_dict
    bytes_read: int = 0       # data bytes this process read
    names: list = field(default_factory=list)   # loaded entries
    runtime: object = None    # the run state beyond tensors (generators, loss scale, LR schedule), if saved
    restored: list = field(default_factory=list)  # what of it CheckpointManager.restore put back


@dataclass
class _Target:
    kind: str                 # "tensor" (dist, plain paddle) | "ndarray" | "value" | "leaf" | "elsewhere"
    shape: tuple = ()
    dtype: str = ""
    boxes: list = field(default_factory=list)    # [(destination, offsets, shape, zero)]


AFTER_LOAD: list = []      # callables(state) run after a load filled ``state`` (parallel/zero_state_dict.py)


def load_state_dict(state: dict, path: str, *, strict: bool = True) -> CheckpointInfo:
    """Fill ``state`` in place from the checkpoint at ``path`` (a checkpoint, or a directory of them: the
    newest complete one is used).

    DistTensor / DistParameter entries get the shards their own layout needs, plain tensors ``set_value``,
    numpy arrays are overwritten, JSON values replaced, ``ShardedLeaf`` entries (a ZeRO optimizer's state)
    get the boxes they ask for; ``HeldElsewhere`` entries (another rank's) must exist and read nothing.
    ``strict``: the checkpoint may not hold entries the state lacks. Raises FileNotFoundError,
    CheckpointMismatchError (names, kinds, shapes, dtypes) or CheckpointCorruptError (a missing, truncated
    or modified file) with nothing overwritten.
    """
    from autoparallel import watchdog

    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__} {strict!r}")
    with watchdog.long_wait("checkpoint load"):     # named to peers like a save's "checkpoint write"
        info = _load(state, path, strict)
    from autoparallel.checkpoint.runtime_state import restore_schedule
    from autoparallel.parallel import precision_cast

    precision_cast.write_back(state)                # a decorated model's save_dtype copies reach its parameters
    for hook in AFTER_LOAD:                         # a ZeRO optimizer's state_dict() values reach its chunks
        hook(state)
    if restore_schedule(state, info.runtime):       # ap.training_state's optimizer: its LR schedule goes on
        info.restored.append("lr_scheduler")
    return info


def _load(state: dict, path: str, strict: bool) -> CheckpointInfo:
    flat = flatten(state)
    shared = _every_rank_loads(flat)
    try:
        ckpt, meta, targets, loaded, runtime, bytes_read = _read(flat, path, strict)
    except BaseException as e:      # a rank's failure (a Ctrl-C too) stops every rank of a shared state, before any
                                    # assignment
        if shared:
            _share_load_outcome(path, e)
        raise
    if shared:
        _share_load_outcome(path, None)
    _assign(flat, targets, loaded, meta)
    return CheckpointInfo(ckpt, meta.get("step"), meta.get("extra"), bytes_read, list(targets), runtime)


def _read(flat: dict, path: str, strict: bool) -> tuple:
    """Everything a load needs before it touches the state: (checkpoint, metadata, targets, loaded boxes, run
    state, bytes read); raises with nothing assigned."""
    ckpt = resolve_checkpoint(path)
    meta = read_metadata(ckpt)
    targets = {name: _describe(name, leaf) for name, (_, _, leaf) in flat.items()}
    _validate(targets, meta, strict, ckpt)
    loaded = {}
    with ShardReader(ckpt, meta["files"]) as reader:
        for name, t in targets.items():            # every file to read exists with its size: before reading
            for _, off, shape, zero in t.boxes:
                for shard in meta["tensors"][name]["shards"]:
                    if not zero and intersect(off, shape, shard["offsets"], shard["shape"]) is not None:
                        reader.check_file(shard["file"])
        for name, t in targets.items():
            if not t.boxes:
                continue
            rec = meta["tensors"][name]
            loaded[name] = [(dest, _fill(reader, ckpt, name, rec, off, shape, zero))
                            for dest, off, shape, zero in t.boxes]
        _check_ties(flat, targets, loaded, ckpt, meta)
        runtime = _runtime(reader, ckpt, meta)
        return ckpt, meta, targets, loaded, runtime, reader.bytes_read


def _every_rank_loads(flat: dict) -> bool:
    """A real job's load of a state spread over every rank of the job (distributed tensors whose meshes cover
    every rank together, a ZeRO optimizer's chunks, another pipeline stage's entries): every rank loads it
    together, as it saves it, so a failure on some ranks only must reach every rank (_share_load_outcome). A
    state of plain values or of tensors on a part of the job (a sub-mesh's ranks loading alone, an evaluation on
    rank 0) exchanges nothing: the ranks outside it may not be loading at all."""
    from autoparallel.checkpoint import sync
    from autoparallel.dist_tensor import DistTensor, as_dist, is_dist

    multi, _, world_size = sync.job()
    if not multi:
        return False
    covered = set()
    for _, _, leaf in flat.values():
        if isinstance(leaf, (ShardedLeaf, HeldElsewhere)):
            return True
        if isinstance(leaf, DistTensor) or is_dist(leaf):
            covered.update(int(p) for p in np.asarray(as_dist(leaf).spec.mesh.process_ids).reshape(-1))
    return covered >= set(range(world_size))


def _share_load_outcome(path, error) -> None:
    """One status exchange after every rank has read, before any rank assigns (sync.gather_errors): a rank whose
    load failed (a file it cannot read, its own state's mismatch, an interrupt) raises its own error; every other
    rank the first failing rank's, prefixed with that rank (a type the exchange cannot carry: CheckpointError).
    Nothing is assigned on any rank then, so the state stays as it was everywhere. A rank failing early waits
    here for the others' reads (gloo's 30 s bound on a collective: a rank whose peer failed and left is told by a
    transport error, typed here too)."""
    from autoparallel.checkpoint import sync
    from autoparallel.checkpoint.errors import CheckpointError, raise_first_failure

    try:
        failures = sync.gather_errors(error, "checkpoint load (status all_gather)")
    except RuntimeError as e:       # gloo: a peer that failed and left, or one never coming
        if error is not None:
            raise error from None
        raise CheckpointError(f"checkpoint {path}: the ranks did not finish the load together (every rank of "
                              f"the job loads a distributed state at the same point); nothing was loaded on this "
                              f"rank: {e}") from None
    if error is not None or not failures:
        return
    r, name, msg = failures[0]
    raise_first_failure(failures, f"(rank {r}) checkpoint {path}: the load failed there: {name}: {msg}; nothing "
                                  f"was loaded on any rank")


def load_merged_state_dict(path: str, *, flat: bool = False) -> dict:
    """The whole checkpoint in this process: full numpy arrays (bfloat16 as uint16 bit patterns) and JSON
    values, nested like the saved state (or ``{"a/b": value}`` with ``flat=True``)."""
    if not isinstance(flat, bool):
        raise TypeError(f"flat must be a bool, got {type(flat).__name__} {flat!r}")
    ckpt = resolve_checkpoint(path)
    meta = read_metadata(ckpt)
    out = {}
    with ShardReader(ckpt, meta["files"]) as reader:
        for fname in meta["files"]:                # real sizes before any allocation (schema.py)
            reader.check_file(fname)
        for name, rec in meta["tensors"].items():
            shape = tuple(rec["shape"])
            out[name] = _fill(reader, ckpt, name, rec, (0,) * len(shape), shape, False)
    out.update(meta["values"])
    ordered = {n: out[n] for n in list(meta["tensors"]) + list(meta["values"])}
    return ordered if flat else unflatten(ordered)


def read_checkpoint_info(path: str) -> CheckpointInfo:
    """Step, extra and path of a checkpoint (or the newest complete one under ``path``) without loading."""
    ckpt = resolve_checkpoint(path)
    meta = read_metadata(ckpt)
    return CheckpointInfo(ckpt, meta.get("step"), meta.get("extra"), 0, list(meta["tensors"]) + list(meta["values"]))


def _runtime(reader: ShardReader, ckpt: str, meta: dict):
    """The saved run state: the metadata's JSON ``runtime`` with its arrays (``runtime_tensors``) put back."""
    import copy

    runtime = copy.deepcopy(meta.get("runtime"))
    arrays = meta.get("runtime_tensors") or {}
    if arrays and not isinstance(runtime, dict):
        runtime = {}
    for rec in arrays.values():                    # real sizes before any allocation (schema.py)
        for shard in rec["shards"]:
            reader.check_file(shard["file"])
    for name, rec in arrays.items():
        *path, key = name.split("/")
        node = runtime
        for p in path:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise CheckpointCorruptError(f"{ckpt}: run-state array {name!r} lies under a non-dict value")
        shape = tuple(rec["shape"])
        node[key] = _fill(reader, ckpt, name, rec, (0,) * len(shape), shape, False)
    return runtime


# ---- target description ------------------------------------------------------------------------------
def _describe(name: str, leaf) -> _Target:
    import paddle

    from autoparallel.dist_tensor import DistTensor, as_dist, is_dist
    from autoparallel.placement import Partial
    from autoparallel.spec import normalize_dtype

    if isinstance(leaf, HeldElsewhere):
        return _Target("elsewhere")
    if isinstance(leaf, ShardedLeaf):
        return _Target("leaf", tuple(leaf.shape), leaf.dtype,
                       [(key, tuple(off), tuple(shape), False) for key, off, shape in leaf.wanted_boxes()])
    if isinstance(leaf, DistTensor) or is_dist(leaf):
        dt = as_dist(leaf)
        spec = dt.spec
        boxes = []
        for rank, local in sorted(dt.locals.items()):
            coords = spec.mesh.coords_of(rank)
            zero = any(isinstance(p, Partial) and p.reduce_type == "sum" and coords[i] != 0
                       for i, p in enumerate(spec.placements))
            pieces = local_pieces(spec, rank)
            if len(pieces) == 1:
                boxes.append((local, pieces[0][0], pieces[0][1], zero))
                continue
            whole = _Assembled(local, len(pieces))          # a block-sharded local: one box per block
            boxes += [(_Piece(whole, sl), off, shape, zero) for off, shape, sl in pieces]
        return _Target("tensor", tuple(spec.shape), spec.dtype, boxes)
    if isinstance(leaf, paddle.Tensor):
        shape = tuple(leaf.shape)
        return _Target("tensor", shape, normalize_dtype(leaf.dtype), [(leaf, (0,) * len(shape), shape, False)])
    if isinstance(leaf, np.ndarray):
        try:
            dtype = normalize_dtype(leaf.dtype)
        except ValueError as e:
            raise TypeError(f"state entry {name!r}: {e}") from None
        if not leaf.flags.writeable:        # found by the write otherwise: after the entries before it were loaded
            raise TypeError(f"state entry {name!r}: a read-only numpy array (a memory map opened with mode 'r', a "
                            f"broadcast view) cannot take the loaded values; pass a writable array; nothing was loaded")
        return _Target("ndarray", leaf.shape, dtype, [(leaf, (0,) * leaf.ndim, leaf.shape, False)])
    return _Target("value")


def _validate(targets: dict, meta: dict, strict: bool, ckpt: str) -> None:
    saved_t, saved_v = meta["tensors"], meta["values"]
    problems = []
    missing = [n for n in targets if n not in saved_t and n not in saved_v]
    if missing:
        problems.append(f"missing from the checkpoint: {missing}")
    if strict:
        unexpected = [n for n in list(saved_t) + list(saved_v) if n not in targets]
        if unexpected:
            problems.append(f"in the checkpoint but not in the state (strict=True): {unexpected}")
    for name, t in targets.items():
        if name in saved_v and t.kind != "value":
            problems.append(f"{name!r}: the state has a tensor of shape {list(t.shape)}, the checkpoint a value")
        elif t.kind == "elsewhere":
            continue
        elif name in saved_t and t.kind == "value":
            problems.append(f"{name!r}: the state has a value, the checkpoint a tensor of shape "
                            f"{saved_t[name]['shape']}")
        elif name in saved_t:
            rec = saved_t[name]
            if tuple(rec["shape"]) != tuple(t.shape):
                problems.append(f"{name!r}: shape {list(t.shape)} in the state, {rec['shape']} in the checkpoint")
            if rec["dtype"] != t.dtype:
                problems.append(f"{name!r}: dtype {t.dtype} in the state, {rec['dtype']} in the checkpoint")
    if problems:
        raise CheckpointMismatchError(f"checkpoint {ckpt} (step {meta.get('step')}) does not match the state; "
                                      f"nothing was loaded:\n  " + "\n  ".join(problems))


def _check_ties(flat: dict, targets: dict, loaded: dict, ckpt: str, meta: dict) -> None:
    """Names of one tensor in the state (tied weights: an embedding and its head) must read equal values. A
    checkpoint of a model that does not tie them holds two; writing both into the one tensor kept the last
    silently (the loaded model was neither the saved one nor the state's)."""
    groups: dict = {}
    for name, (_, _, leaf) in flat.items():
        if targets[name].kind in ("tensor", "ndarray") and name in loaded:
            groups.setdefault(id(leaf), []).append(name)
    for first, *others in groups.values():
        for other in others:
            if any(a.tobytes() != b.tobytes() for (_, a), (_, b) in zip(loaded[first], loaded[other])):
                raise CheckpointMismatchError(
                    f"checkpoint {ckpt} (step {meta.get('step')}) does not match the state; nothing was loaded:\n  "
                    f"{first!r} and {other!r} are one tensor in the state (tied weights), but the checkpoint holds "
                    f"different values for them (it was saved from a model that does not tie them); load it into "
                    f"such a model, or leave one of the two names out of the state to choose the value")


# ---- reading and assigning ------------------------------------------------------------------------------
def _fill(reader: ShardReader, ckpt: str, name: str, rec: dict, off, shape, zero: bool) -> np.ndarray:
    """The box (``off``, ``shape``) of saved tensor ``name`` assembled from the shards overlapping it."""
    dtype = storage_dtype(rec["dtype"])
    out = np.zeros(shape, dtype)
    if zero or numel(shape) == 0:
        return out
    covered = 0
    for shard in rec["shards"]:
        common = intersect(off, shape, shard["offsets"], shard["shape"])
        if common is None:
            continue
        c_off, c_shape = common
        out[relative_slices(c_off, c_shape, off)] = reader.read_box(shard, dtype, c_off, c_shape)
        covered += numel(c_shape)
    if covered != numel(shape):
        raise CheckpointCorruptError(f"{ckpt}: the shards of {name!r} cover {covered} of the {numel(shape)} "
                                     f"elements of box offsets {list(off)} shape {list(shape)}")
    return out


def _assign(flat: dict, targets: dict, loaded: dict, meta: dict) -> None:
    import paddle

    from autoparallel.local_mode import local_mode

    order = sorted(targets, key=lambda n: targets[n].kind == "leaf")   # a ZeRO optimizer's chunks after parameters
    with paddle.no_grad(), local_mode():
        for name in order:
            t = targets[name]
            container, key, leaf = flat[name]
            if t.kind == "value":
                value = meta["values"][name]             # JSON has no tuples: the state's tuple stays one
                container[key] = tuple(value) if isinstance(leaf, tuple) and isinstance(value, list) else value
            elif t.kind == "ndarray":
                leaf[...] = loaded[name][0][1]
            elif t.kind == "leaf":
                leaf.assign(loaded.get(name, []))
            elif t.kind != "elsewhere":
                with _zero_managed(leaf):
                    for dest, array in loaded.get(name, []):
                        _write_into(dest, array)


@contextlib.contextmanager
def _zero_managed(leaf):
    """Writing a parameter a ZeRO optimizer steps (``model.state_dict()``'s entries, as paddle's
    ``load_state_dict(model.state_dict(), path)`` passes them): a ZeRO-3 parameter released between steps is
    gathered first (the values were written into storage it did not hold, then lost), and its fp32 master chunks
    take the loaded values after (the next step wrote the stale masters back over them). The chunks a state
    names itself (``ap.training_state``, ``opt.state_dict()``) are assigned after every parameter."""
    from autoparallel.dist_tensor_forms import ZERO_OWNERS

    ref = ZERO_OWNERS.get(leaf) if ZERO_OWNERS._items else None
    owner = ref() if ref is not None else None
    if owner is None:
        yield
        return
    released = any((id(leaf), r) in owner._freed for r in owner.held)
    if released:
        owner.gather([leaf])
    yield
    owner.reload([leaf])
    if released:
        owner.free([leaf])


class _Assembled:
    """A local tensor filled from several boxes (its pieces of each block): written once all have arrived."""

    def __init__(self, local, n: int):
        self.local, self.left = local, n
        self.buffer = None

    def put(self, sl, array: np.ndarray) -> None:
        if self.buffer is None:
            self.buffer = np.zeros(tuple(self.local.shape), dtype=array.dtype)
        self.buffer[sl] = array
        self.left -= 1
        if self.left == 0:
            _write_into(self.local, self.buffer)


@dataclass
class _Piece:
    whole: _Assembled
    slices: tuple


def _write_into(dest, array: np.ndarray) -> None:
    """Copy ``array`` into ``dest`` in place, honouring its strides: a shard made by slicing can be a
    strided view, where ``set_value`` would write contiguous bytes over its neighbours."""
    import paddle

    if isinstance(dest, _Piece):
        dest.whole.put(dest.slices, array)
        return

    src = paddle.to_tensor(array)
    if array.dtype == np.uint16 and str(dest.dtype).endswith("bfloat16"):
        src = src.view(paddle.bfloat16)
    paddle.assign(src, output=dest)
