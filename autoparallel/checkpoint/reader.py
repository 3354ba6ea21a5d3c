"""Read a box of a saved shard, touching only the bytes it spans and verifying their block checksums."""
from __future__ import annotations

import os
import zlib

import numpy as np
from numpy.lib.stride_tricks import as_strided

from autoparallel.checkpoint.errors import CheckpointCorruptError
from autoparallel.checkpoint.layout import numel


class ShardReader:
    """Reads boxes from the data files of one checkpoint; use as a context manager (closes its files)."""

    def __init__(self, ckpt_dir: str, files: dict):
        self.dir = ckpt_dir
        self.files = files                  # {file name: {"size", "crc32"}} from the metadata
        self._fds: dict = {}
        self._verified: set = set()         # (file, byte offset of a verified block)
        self.bytes_read = 0

    def check_file(self, fname: str) -> None:
        """Existence and size of a data file, before anything is read from it."""
        if fname in self._fds:
            return
        path = os.path.join(self.dir, fname)
        info = self.files.get(fname)
        if info is None:
            raise CheckpointCorruptError(f"{path}: a shard refers to a data file the metadata does not list")
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{path}: data file missing (the metadata lists it with "
                                         f"{info['size']} bytes)") from None
        if size != info["size"]:
            raise CheckpointCorruptError(f"{path}: data file is {size} bytes, the metadata expects "
                                         f"{info['size']} (truncated or overwritten)")
        self._fds[fname] = os.open(path, os.O_RDONLY)

    def read_box(self, shard: dict, dtype: np.dtype, off, shape) -> np.ndarray:
        """The box (global ``off``, ``shape``) of ``shard``, which must contain it."""
        fname = shard["file"]
        self.check_file(fname)
        if numel(shape) == 0:
            return np.empty(shape, dtype)
        item = dtype.itemsize
        sshape = shard["shape"]
        strides = _c_strides(sshape)
        rel = [o - so for o, so in zip(off, shard["offsets"])]
        first = sum(r * s for r, s in zip(rel, strides))
        last = sum((r + n - 1) * s for r, n, s in zip(rel, shape, strides))
        lo_byte, hi_byte = first * item, (last + 1) * item
        bb = shard["block_bytes"]
        b0, b1 = lo_byte // bb, -(-hi_byte // bb)
        start = b0 * bb
        stop = min(b1 * bb, shard["nbytes"])
        buf = self._pread(fname, shard["byte_offset"] + start, stop - start)
        for b in range(b0, b1):
            key = (fname, shard["byte_offset"] + b * bb)
            if key in self._verified:
                continue
            chunk = memoryview(buf)[(b - b0) * bb:(b - b0 + 1) * bb]
            if zlib.crc32(chunk) != shard["crc32"][b]:
                raise CheckpointCorruptError(
                    f"{os.path.join(self.dir, fname)}: checksum mismatch in block {b} (bytes "
                    f"{shard['byte_offset'] + b * bb}..{shard['byte_offset'] + b * bb + len(chunk)}) of a shard "
                    f"at {shard['offsets']} shape {shard['shape']}: the file was modified after it was written")
            self._verified.add(key)
        flat = np.frombuffer(buf, dtype=dtype)
        base = flat[(lo_byte - start) // item:]
        view = as_strided(base, shape=tuple(shape), strides=tuple(s * item for s in strides))
        return np.array(view, copy=True)

    def _pread(self, fname: str, offset: int, length: int) -> bytes:
        fd = self._fds[fname]
        out = bytearray()
        while len(out) < length:
            chunk = os.pread(fd, length - len(out), offset + len(out))
            if not chunk:
                raise CheckpointCorruptError(f"{os.path.join(self.dir, fname)}: unexpected end of file at byte "
                                             f"{offset + len(out)}")
            out += chunk
        self.bytes_read += length
        return bytes(out)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _c_strides(shape) -> list:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return list(reversed(out))
