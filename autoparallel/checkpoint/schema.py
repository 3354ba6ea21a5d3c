"""Check a checkpoint's metadata before anything is allocated or read from it.

A metadata file is input like any other: every size, count and name in it is checked for type, range and
consistency here, so a truncated, hand-edited or crafted metadata is refused with a CheckpointCorruptError
naming the field, never trusted with an allocation. The invariants:

* data files are named ``data-r<5 digits>.bin`` (no path may leave the checkpoint directory), with an int
  size >= 0 and crc32;
* every tensor has a known numeric dtype, a shape of ints >= 0, and shards that lie inside it, each with
  ``nbytes == elements x itemsize``, one crc32 per block, and bytes inside the size of its (listed) file;
* the shards of a tensor hold exactly its element count (each element is stored once), so no tensor can
  claim more elements than its files hold: loaders check the files' real sizes before reading
  (reader.py), which bounds every allocation by the bytes on disk.
"""
from __future__ import annotations

import re

from autoparallel.checkpoint.errors import CheckpointCorruptError
from autoparallel.checkpoint.layout import numel

DATA_FILE = re.compile(r"^data-r\d{5}\.bin$")
DTYPES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
          "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}
MAX_NDIM = 64


def _int(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def validate_metadata(meta: dict, path: str) -> None:
    """Raise CheckpointCorruptError (naming ``path`` and the field) unless ``meta`` is well formed."""
    def bad(what: str):
        raise CheckpointCorruptError(f"{path}: invalid checkpoint metadata: {what}")

    for key, kind in (("tensors", dict), ("values", dict), ("files", dict)):
        if not isinstance(meta.get(key), kind):
            bad(f"{key!r} must be a {kind.__name__}, got {type(meta.get(key)).__name__}")
    if meta.get("step") is not None and not _int(meta["step"]):
        bad(f"'step' must be an int >= 0 or null, got {meta['step']!r}")
    if meta.get("runtime") is not None and not isinstance(meta["runtime"], dict):
        bad(f"'runtime' must be a dict or null, got {type(meta['runtime']).__name__}")
    rt = meta.get("runtime_tensors", {})
    if not isinstance(rt, dict):
        bad(f"'runtime_tensors' must be a dict, got {type(rt).__name__}")
    for fname, info in meta["files"].items():
        if not isinstance(fname, str) or not DATA_FILE.match(fname):
            bad(f"data file name {fname!r} is not of the form data-r<5 digits>.bin")
        if not isinstance(info, dict) or not _int(info.get("size")) or not _int(info.get("crc32")):
            bad(f"file {fname!r}: expected {{'size': int >= 0, 'crc32': int >= 0}}, got {info!r}")
    for group in (meta["tensors"], rt):
        for name, rec in group.items():
            _tensor(name, rec, meta["files"], bad)


def _tensor(name: str, rec, files: dict, bad) -> None:
    if not isinstance(rec, dict):
        bad(f"tensor {name!r}: expected a record, got {type(rec).__name__}")
    dtype, shape, shards = rec.get("dtype"), rec.get("shape"), rec.get("shards")
    if dtype not in DTYPES:
        bad(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if not _shape(shape):
        bad(f"tensor {name!r}: shape must be a list of at most {MAX_NDIM} ints >= 0, got {shape!r}")
    if not isinstance(shards, list):
        bad(f"tensor {name!r}: 'shards' must be a list, got {type(shards).__name__}")
    held = 0
    for shard in shards:
        held += _shard(name, shard, shape, DTYPES[dtype], files, bad)
    if held != numel(shape):
        bad(f"tensor {name!r}: its shards hold {held} elements, its shape {shape} has {numel(shape)}")


def _shape(shape) -> bool:
    return isinstance(shape, list) and len(shape) <= MAX_NDIM and all(_int(s) for s in shape)


def _shard(name: str, shard, shape: list, itemsize: int, files: dict, bad) -> int:
    if not isinstance(shard, dict):
        bad(f"tensor {name!r}: a shard must be a record, got {type(shard).__name__}")
    off, sshape, fname = shard.get("offsets"), shard.get("shape"), shard.get("file")
    if not _shape(sshape) or not _shape(off) or len(off) != len(shape) or len(sshape) != len(shape):
        bad(f"tensor {name!r}: shard offsets {off!r} / shape {sshape!r} must be {len(shape)} ints >= 0")
    if any(o + n > s for o, n, s in zip(off, sshape, shape)):
        bad(f"tensor {name!r}: shard at {off} shape {sshape} lies outside the tensor's shape {shape}")
    if fname not in files:
        bad(f"tensor {name!r}: a shard refers to file {fname!r}, which the metadata does not list")
    count = numel(sshape)
    nbytes, start, block = shard.get("nbytes"), shard.get("byte_offset"), shard.get("block_bytes")
    if nbytes != count * itemsize or not _int(start) or not _int(block, 64) or block % 64:
        bad(f"tensor {name!r}: shard at {off}: nbytes {nbytes!r} must be {count} x {itemsize}, byte_offset an "
            f"int >= 0 and block_bytes a positive multiple of 64 (got {start!r}, {block!r})")
    if start + nbytes > files[fname]["size"]:
        bad(f"tensor {name!r}: shard at {off} spans bytes {start}..{start + nbytes} of {fname}, which holds "
            f"{files[fname]['size']}")
    crcs = shard.get("crc32")
    blocks = max(1, -(-nbytes // block))
    if not isinstance(crcs, list) or len(crcs) != blocks or not all(_int(c) for c in crcs):
        bad(f"tensor {name!r}: shard at {off}: expected {blocks} block crc32 ints, got "
            f"{len(crcs) if isinstance(crcs, list) else type(crcs).__name__}")
    return count
