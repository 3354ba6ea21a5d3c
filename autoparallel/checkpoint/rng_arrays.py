"""Random generator states as plain arrays: paddle's, numpy's global and python's ``random``.

A checkpoint is data only, so generator states are never pickled. Each generator's state is a handful of
integers (Mersenne-Twister words, a position, a seed, an offset) and a cached gaussian, stored as the
int64 / float64 arrays below (64-bit unsigned words as their int64 bit pattern); the checkpoint writes them
like any tensor (raw bytes, block checksums).

===================== ======= ============ ==================================================
field                 dtype   shape        meaning
===================== ======= ============ ==================================================
paddle_device         int64   [G]          device id of each of paddle's G generators (-1: CPU)
paddle_seed_offset    int64   [G, 2]       seed and offset of each generator (uint64 bits)
paddle_engine         int64   [G, E]       the mt19937_64 words and index of each generator (uint64 bits)
numpy_key             int64   [624]        numpy's MT19937 key (32-bit words)
numpy_pos_gauss       int64   [2]          numpy's position and has-gauss flag
numpy_gauss           float64 [1]          numpy's cached gaussian
python_state          int64   [625]        python ``random``'s MT words (32-bit) and index
python_gauss          float64 [2]          has-gauss flag and python's cached gaussian
===================== ======= ============ ==================================================

A restore validates every field against this process's own layout (names, dtypes, shapes, value ranges)
before touching any generator.
"""
from __future__ import annotations

import random

import numpy as np

from autoparallel.checkpoint.errors import CheckpointCorruptError

MT_N = 624


def capture() -> dict:
    """This process's generator states as {field: array}."""
    import paddle

    devices, seeds, engines = [], [], []
    for g in paddle.get_rng_state():
        device, seed, offset, text = g.__getstate__()
        devices.append(device)
        seeds.append([seed, offset])
        engines.append([int(w) for w in bytes(text).decode("ascii").split()])
    key, pos, has_gauss, gauss = np.random.get_state()[1:]
    version, words, gauss_next = random.getstate()
    return {
        "paddle_device": np.array(devices, dtype=np.int64),
        "paddle_seed_offset": np.array(seeds, dtype=np.uint64).reshape(len(seeds), 2).view(np.int64),
        "paddle_engine": np.array(engines, dtype=np.uint64).reshape(len(engines), -1).view(np.int64),
        "numpy_key": np.array(key, dtype=np.int64),
        "numpy_pos_gauss": np.array([pos, has_gauss], dtype=np.int64),
        "numpy_gauss": np.array([gauss], dtype=np.float64),
        "python_state": np.array(words, dtype=np.int64),
        "python_gauss": np.array([gauss_next is not None, gauss_next or 0.0], dtype=np.float64),
    }


def restore(states: dict) -> None:
    """Set every generator from ``capture``-shaped arrays (already checked by ``validate``)."""
    import paddle

    live = paddle.get_rng_state()
    gens = []
    for i, cls in enumerate(type(g) for g in live):
        engine = " ".join(str(int(w)) for w in states["paddle_engine"][i].view(np.uint64)).encode("ascii")
        seed, offset = (int(v) for v in states["paddle_seed_offset"][i].view(np.uint64))
        g = cls.__new__(cls)
        g.__setstate__((int(states["paddle_device"][i]), seed, offset, list(engine)))
        gens.append(g)
    paddle.set_rng_state(gens)
    pos, has_gauss = (int(v) for v in states["numpy_pos_gauss"])
    gauss = float(states["numpy_gauss"][0])
    np.random.set_state(("MT19937", states["numpy_key"].astype(np.uint32), pos, has_gauss, gauss))
    has, value = states["python_gauss"]
    random.setstate((3, tuple(int(w) for w in states["python_state"]), float(value) if has else None))


def validate(rng: dict) -> dict:
    """The per-field arrays of a saved ``rng`` record ({"world_size": n, field: array [n, ...]}) after
    checking them against this process's layout; CheckpointCorruptError naming the first bad field."""
    if not isinstance(rng, dict):
        raise CheckpointCorruptError(f"generator states: expected a dict of arrays, got {type(rng).__name__}")
    template = capture()
    world = rng.get("world_size")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise CheckpointCorruptError(f"generator states: world_size must be a positive int, got {world!r}")
    unknown = sorted(set(rng) - set(template) - {"world_size"})
    if unknown:
        raise CheckpointCorruptError(f"generator states: unexpected fields {unknown} (expected {sorted(template)}); "
                                     f"generator states are loaded only as plain arrays, never unpickled")
    out = {}
    for name, want in template.items():
        got = rng.get(name)
        shape = (world, *want.shape)
        if not isinstance(got, np.ndarray) or got.dtype != want.dtype or got.shape != shape:
            given = (f"{got.dtype} {list(got.shape)}" if isinstance(got, np.ndarray) else type(got).__name__)
            raise CheckpointCorruptError(f"generator states: field {name!r} must be a {want.dtype} array of shape "
                                         f"{list(shape)}, got {given}")
        out[name] = got
    _check_ranges(out)
    return out


def _check_ranges(states: dict) -> None:
    pos = states["numpy_pos_gauss"]
    if ((pos[:, 0] < 0) | (pos[:, 0] > MT_N) | ~np.isin(pos[:, 1], (0, 1))).any():
        raise CheckpointCorruptError(f"generator states: numpy position must be in [0, {MT_N}] and has-gauss 0 "
                                     f"or 1, got {pos.tolist()}")
    for name in ("numpy_key", "python_state"):
        words = states[name][:, :MT_N]
        if ((words < 0) | (words >= 1 << 32)).any():
            raise CheckpointCorruptError(f"generator states: {name} words must be 32-bit unsigned")
    if ((states["python_state"][:, -1] < 0) | (states["python_state"][:, -1] > MT_N)).any():
        raise CheckpointCorruptError(f"generator states: python random index must be in [0, {MT_N}], got "
                                     f"{states['python_state'][:, -1].tolist()}")
    if not np.isin(states["python_gauss"][:, 0], (0.0, 1.0)).all():
        raise CheckpointCorruptError("generator states: python has-gauss flag must be 0 or 1")


def pack(states: dict) -> np.ndarray:
    """One uint8 buffer of every field's bytes, in field order (for one all_gather)."""
    return np.concatenate([np.ascontiguousarray(states[k]).reshape(-1).view(np.uint8) for k in sorted(states)])


def unpack(buf: np.ndarray, template: dict) -> dict:
    """``pack``'s inverse, with the fields' dtypes and shapes taken from ``template``."""
    out, pos = {}, 0
    for k in sorted(template):
        t = template[k]
        n = t.size * t.itemsize
        out[k] = np.frombuffer(np.ascontiguousarray(buf[pos:pos + n]).tobytes(), dtype=t.dtype).reshape(t.shape)
        pos += n
    if pos != buf.size:
        raise ValueError(f"generator states: gathered {buf.size} bytes, expected {pos} (ranks disagree on the "
                         f"number of paddle generators)")
    return out
