"""A random draw on distributed tensors (dropout's keep-mask, ``rand_like``, ``x.uniform_()``, ``bernoulli``,
``rrelu``, ``fractional_max_pool2d``, ``svd_lowrank``, a lazily built parameter's initialiser, ...) is made for
the GLOBAL shape on each rank, which keeps its slice: replicas and shards come from one global draw only when
every rank's generator holds the same state. ``agreed_generator(ranks)`` makes it so: a CRC of this rank's paddle
generator states is compared over ``ranks`` (one small all-reduce); when they differ (a per-rank
``paddle.seed(base + rank)``, no seed at all, or per-rank draws of plain tensors since) the first rank's states
are broadcast and set for the draw, and the other ranks get their own states back afterwards (their later
per-rank draws stay their own). The values are then a single process's under the first rank's generator state.

``agreed_value`` does the same for a parameter laid out by ``shard_tensor`` (hence ``shard_layer`` and
``parallelize``): its value, built on each rank from that rank's generator, is the one full value of the contract;
when the ranks of the mesh hold different values (CRC compared in one small all-reduce) the first rank's is
broadcast, so replicas agree and shards are slices of one initialisation, as paddle's ``DataParallel`` and torch's
DDP broadcast their parameters at construction."""
from __future__ import annotations

import contextlib
import warnings
import zlib

import numpy as np
import paddle

from autoparallel.comm import collectives as C
from autoparallel.comm.world import current_world
from autoparallel.context import state as _ctx


def agreement_mesh(mesh_or_ranks):
    """The mesh to agree over, whose dim groups exist on real ranks: a ProcessMesh as given; a rank list (a union
    of meshes) as the whole world when it is the world (the default group), else None (not agreed here)."""
    from autoparallel.core.mesh import ProcessMesh

    if isinstance(mesh_or_ranks, ProcessMesh):
        return mesh_or_ranks
    ranks = sorted(int(r) for r in mesh_or_ranks)
    world = current_world()
    return ProcessMesh(ranks, dim_names=["ranks"]) if ranks == list(range(world.world_size)) else None


def skip(mesh) -> bool:
    """Nothing to agree here: the simulated world (one draw for all ranks), no mesh, one rank, this rank outside it,
    or graph tracing (no values)."""
    world = current_world()
    return world.is_simulated or mesh is None or mesh.size < 2 or not mesh.contains(world.rank) \
        or _ctx.tracer is not None


def _disagree(values: list, mesh) -> bool:
    """True when ``values`` is not the same on every rank of ``mesh`` (max and -min, one all-reduce per mesh dim, in
    the mesh's own groups: a flat group of a sub-mesh's ranks need not exist)."""
    out = C.mesh_max(np.array(values + [-x for x in values], dtype="float32"), mesh).numpy()
    return bool(np.any(out[:len(values)] != -out[len(values):]))


def from_first(t, mesh):
    """The tensor of the mesh's first rank (coordinates 0, ...), on every rank of ``mesh``: a broadcast from
    coordinate 0 along each mesh dim in turn."""
    rank = current_world().rank
    xs = {rank: t}
    for d in range(mesh.ndim):
        if mesh.shape[d] > 1:
            xs = C.mesh_groups_apply(xs, mesh, d, lambda held, ranks: C.broadcast(held, ranks, ranks[0]))
    return xs[rank]


def _raw() -> list:
    """This process's paddle generator states as read: per generator, (device, seed, offset, engine text bytes)."""
    out = []
    for g in paddle.get_rng_state():
        device, seed, offset, text = g.__getstate__()
        out.append((int(device), int(seed), int(offset), bytes(text)))
    return out


def _crc(raw: list) -> int:
    """A CRC of the generator states (compared across ranks without parsing the engine text: the hot path)."""
    crc = 0
    for device, seed, offset, text in raw:
        crc = zlib.crc32(np.array([v % (1 << 64) for v in (device, seed, offset)], dtype=np.uint64).tobytes() + text,
                          crc)
    return crc


def _states(raw: list) -> np.ndarray:
    """The states of ``_raw`` as uint64 words (what is broadcast): per generator, device, seed, offset, the number
    of engine words, the engine words."""
    words = []
    for device, seed, offset, text in raw:
        engine = [int(w) for w in text.decode("ascii").split()]
        words += [device % (1 << 64), seed % (1 << 64), offset % (1 << 64), len(engine), *engine]
    return np.array(words, dtype=np.uint64)


def _set_states(words: np.ndarray) -> None:
    live, gens, i = paddle.get_rng_state(), [], 0
    for g in live:
        n = int(words[i + 3])
        device, seed, offset = (int(v) for v in words[i:i + 3])
        engine = " ".join(str(int(w)) for w in words[i + 4:i + 4 + n]).encode("ascii")
        new = type(g).__new__(type(g))
        new.__setstate__((device - (1 << 64) if device >= 1 << 63 else device, seed, offset, list(engine)))
        gens.append(new)
        i += 4 + n
    paddle.set_rng_state(gens)


@contextlib.contextmanager
def agreed_generator(mesh_or_ranks):
    """Inside, this rank's paddle generators hold the same state as the first rank of the mesh (module docstring)."""
    mesh = agreement_mesh(mesh_or_ranks)
    if skip(mesh):
        yield
        return
    try:
        raw = _raw()
        crc = _crc(raw)
    except (ValueError, TypeError, AttributeError, OverflowError) as e:    # a generator state of another form
        _warn_unread(e)
        yield
        return
    if not _disagree([float(crc >> 16), float(crc & 0xFFFF), float(sum(len(r[3]) for r in raw))], mesh):
        yield
        return
    try:
        own = _states(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"the random generator's engine state is not the text of integers paddle writes "
                         f"({type(e).__name__}: {e}); random draws on distributed tensors cannot be agreed over "
                         f"the ranks of {mesh}") from e
    sent = from_first(paddle.to_tensor(own.view(np.int64)), mesh).numpy().view(np.uint64)
    differs = not np.array_equal(sent, own)
    if differs:
        _set_states(sent)
    try:
        yield
    finally:
        if differs:
            _set_states(own)


_WARNED: list = []


def _warn_unread(e) -> None:
    if not _WARNED:
        _WARNED.append(True)
        warnings.warn(f"the random generator's state could not be read ({type(e).__name__}: {e}); random draws on "
                      f"distributed tensors are not agreed over the ranks: seed every rank alike "
                      f"(paddle.seed(s) on all ranks) so that replicas draw alike", UserWarning, stacklevel=3)


def agreed_value(t, mesh):
    """``t`` (this rank's full value of a parameter being laid out), or the mesh's first rank's when they differ."""
    mesh = agreement_mesh(mesh)
    if skip(mesh):
        return t
    crc = zlib.crc32(np.ascontiguousarray(t.numpy()).tobytes())
    if not _disagree([float(crc >> 16), float(crc & 0xFFFF)], mesh):
        return t
    got = from_first(t.detach(), mesh)
    got.stop_gradient = t.stop_gradient
    return got
