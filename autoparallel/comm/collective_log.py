"""Every rank must make the same collectives in the same order: a log of them, compared off the hot path.

gloo and NCCL pair a group's collectives by order alone, so a collective made on some ranks only (an evaluation
forward inside ``if rank == 0:``) pairs with whatever the others do next -- and when the sizes agree the run goes
on with wrong values. On by default (``AP_COLLECTIVE_LOG=off`` turns it off), the real transport notes each
collective here before it runs, with no communication: the group's sequence number on this rank, the kind, the
payload bytes and the user's call path (frames outside autoparallel, paddle and the standard library, as
comm/agreement.py names them). The note is a tuple appended to a ring; the text, its hash and a running digest
per group are made later, by whoever drains the ring (the watchdog's heartbeat thread, a checkpoint's entry).

The watchdog publishes ``summary()`` with each heartbeat; every rank's judge compares its peers' summaries with
its own log for the same (group, sequence number) (``compare``) and, on the first disagreement, ends the run on
every rank with ``CollectiveMismatchError`` naming each rank's call. ``check_save_entry`` agrees on the digests
at a checkpoint's entry (one small all_gather per save), so nothing is written after an undetected mismatch.
The strict mode ``AP_COLLECTIVE_CHECK=on`` (comm/agreement.py) still refuses before any payload moves.
"""
from __future__ import annotations

import collections
import hashlib
import os
import sys
import threading

from autoparallel.comm.agreement import CollectiveMismatchError, _library_dirs

RING = 8192             # notes kept between two drains (a heartbeat interval); older ones are counted as lost
RECENT = 64             # records per group published with each heartbeat, to name the calls
HISTORY = 8192          # digests per group remembered, to compare with a peer that is behind
MAX_FRAMES = 8          # user frames kept per call path
OFF = ("0", "off", "false", "no")
RULE = ("every rank must make the same collectives in the same order: code that runs on some ranks only "
        "(an evaluation forward, a state_dict gather, a save or a read of a distributed value inside "
        "`if rank == 0:`) made a collective the other ranks did not make, and the collectives paired wrongly")


def enabled() -> bool:
    """On unless ``AP_COLLECTIVE_LOG`` is ``off`` (``0``, ``false``, ``no``)."""
    value = os.environ.get("AP_COLLECTIVE_LOG", "").strip().lower()
    if value not in OFF + ("", "on", "1", "true", "yes"):
        raise ValueError(f"AP_COLLECTIVE_LOG must be 'on' or 'off', got {value!r}")
    return value not in OFF


def _hash(text: str, prev: int = 0) -> int:
    data = prev.to_bytes(8, "little") + text.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def group_key(ranks) -> str:
    return ",".join(str(r) for r in ranks)


class _Group:
    __slots__ = ("count", "digest", "recent", "history")

    def __init__(self):
        self.count, self.digest = 0, 0
        self.recent = collections.deque(maxlen=RECENT)        # [seq, kind, bytes, "kind@site"]
        self.history = collections.deque(maxlen=HISTORY)      # digests of seq count-len+1 .. count


class Log:
    """One process's log: ``note`` on the hot path, ``drain``/``summary``/``compare`` off it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ring = collections.deque(maxlen=RING)
        self._seq: dict = {}           # group tuple -> collectives noted on it
        self._groups: dict = {}        # group key -> _Group (drained)
        self._noted = self._drained = 0
        self.lost = 0                  # notes that fell off the ring before a drain
        self._user_code: dict = {}     # code object -> is it user code
        self._dirs = None

    def note(self, kind: str, ranks, nbytes=None, depth: int = 1) -> None:
        """This rank is about to make ``kind`` on the group ``ranks``: a tuple appended, nothing sent."""
        key = tuple(ranks)
        user, f, out = self._user_code, sys._getframe(depth), []
        while f is not None and len(out) < MAX_FRAMES:
            code = f.f_code
            mine = user.get(code)
            if mine is None:
                mine = user[code] = self._is_user(code.co_filename)
            if mine:
                out.append((code.co_filename, f.f_lineno))
            f = f.f_back
        with self._lock:
            seq = self._seq[key] = self._seq.get(key, 0) + 1
            self._ring.append((key, seq, kind, nbytes, tuple(out)))
            self._noted += 1

    def _is_user(self, filename: str) -> bool:
        if self._dirs is None:
            self._dirs = _library_dirs()
        return not filename.startswith(self._dirs) and not filename.startswith("<frozen")

    def drain(self) -> None:
        """Fold the notes made since the last drain into each group's digest and recent records."""
        with self._lock:
            notes, lost = list(self._ring), self._noted - self._drained - len(self._ring)
            self._ring.clear()
            self._drained = self._noted
        self.lost += max(lost, 0)
        for key, seq, kind, nbytes, frames in notes:
            g = self._groups.setdefault(group_key(key), _Group())
            site = " < ".join(f"{os.path.basename(f)}:{n}" for f, n in frames) or "inside the library"
            text = f"{kind}@{site}"
            g.count, g.digest = seq, _hash(f"{text}#{_bytes(nbytes)}", g.digest)
            g.history.append(g.digest)
            g.recent.append([seq, kind, _bytes(nbytes), text])

    def summary(self) -> dict:
        """What a heartbeat publishes: per group its count, digest and recent records (JSON)."""
        self.drain()
        return {k: {"n": g.count, "d": g.digest, "r": list(g.recent)} for k, g in self._groups.items()}

    def digest_at(self, key: str, seq: int):
        """This rank's digest of ``key`` after its collective ``seq`` (None: not made yet, or forgotten)."""
        g = self._groups.get(key)
        if g is None or seq < 1 or seq > g.count or seq <= g.count - len(g.history):
            return None
        return g.history[len(g.history) - 1 - (g.count - seq)]

    def compare(self, me: int, peer: int, theirs: dict):
        """None when the peer's published log agrees with this rank's on every group both belong to, else the
        ``CollectiveMismatchError`` text naming each rank's call at the first disagreement found."""
        self.drain()
        for key, t in sorted(theirs.items()):
            mine = self._groups.get(key)
            if mine is None:
                continue
            seq = min(t["n"], mine.count)
            if seq < 1:
                continue
            ours = self.digest_at(key, seq)
            if seq == t["n"]:
                same = ours is None or ours == t["d"]
            else:                      # they are ahead: compare their recent records up to our count
                same = all(r == m for r in t["r"] for m in mine.recent if r[0] == m[0])
            if not same:
                return mismatch_text(key, me, peer, list(mine.recent), t["r"])
        return None


def _bytes(nbytes) -> int:
    if nbytes is None or isinstance(nbytes, int):
        return -1 if nbytes is None else nbytes
    shape, dtype = nbytes           # (shape, dtype) taken on the hot path: sized here
    n = 1
    for s in shape:
        n *= int(s)
    return n * _ITEM.get(str(dtype).split(".")[-1], 4)


_ITEM = {"float64": 8, "int64": 8, "complex64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2,
         "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex128": 16}


def mismatch_text(key: str, me: int, peer: int, mine: list, theirs: list) -> str:
    """Both ranks' calls at the first sequence number whose records differ (the digests say they do)."""
    by_seq = {r[0]: r for r in theirs}
    first = next(((m, by_seq[m[0]]) for m in mine if m[0] in by_seq and by_seq[m[0]] != m), None)
    if first is None:
        where = (f"the digests of the group's collectives differ before the last {len(theirs)} records each rank "
                 f"published (rank {me}: last {_call(mine[-1]) if mine else 'none'}; rank {peer}: last "
                 f"{_call(theirs[-1]) if theirs else 'none'})")
    else:
        a, b = first
        where = f"collective #{a[0]} on this group: rank {me}: {_call(a)}; rank {peer}: {_call(b)}"
    return f"the ranks of group [{key}] did not make the same collective ({where}). The rule: {RULE}"


def _call(rec) -> str:
    return f"{rec[3]} ({rec[2]} bytes)"


def check_save_entry(rank: int, world_size: int, log: "Log" = None, gather=None) -> None:
    """Before a checkpoint is written: every rank's count and digest on each group it shares with another rank
    must agree (one all_gather of 3 x 64 int64 words), else ``CollectiveMismatchError`` on every rank."""
    import numpy as np

    log = log or LOG
    log.drain()
    words = np.zeros(1 + 3 * 64, dtype=np.int64)
    items = sorted(log._groups.items())[-64:]
    words[0] = len(items)
    for i, (key, g) in enumerate(items):
        words[1 + 3 * i: 4 + 3 * i] = (_group_id(key), g.count, g.digest)
    got = (gather or _world_gather)(words)
    why = entry_verdict([np.asarray(w) for w in got], {_group_id(k): k for k, _ in items})
    if why is not None:
        raise CollectiveMismatchError(f"refusing to save a checkpoint: {why}")


def entry_verdict(records: list, names: dict):
    """None when every group present on two ranks has one count and digest on both, else the reason."""
    seen: dict = {}
    for rank, w in enumerate(records):
        for i in range(int(w[0])):
            h, n, d = (int(x) for x in w[1 + 3 * i: 4 + 3 * i])
            if h in seen and seen[h][1:] != (n, d):
                r0, n0, _ = seen[h]
                name = names.get(h) or (",".join(str(r) for r in range(63) if h >> r & 1) if h > 0 else f"#{-h:x}")
                return (f"on group [{name}], rank {r0} has made {n0} collectives and rank {rank} {n}"
                        f"{' with different calls' if n0 == n else ''}. The rule: {RULE}")
            seen.setdefault(h, (rank, n, d))
    return None


def _group_id(key: str) -> int:
    """A group as one int64: the bit mask of its ranks (below 63), else minus a hash of its key."""
    ranks = [int(r) for r in key.split(",")]
    return sum(1 << r for r in ranks) if max(ranks) < 63 else -_hash(key)


def _world_gather(words):
    import paddle

    from autoparallel.comm.agreement import raw_all_gather

    out = []
    raw_all_gather()(out, paddle.to_tensor(words))
    return [t.numpy() for t in out]


LOG = Log()
_pending = [None]           # a mismatch the watchdog found: raised at this rank's next collective


def set_pending(error: CollectiveMismatchError) -> None:
    _pending[0] = error


def raise_pending() -> None:
    error = _pending[0]
    if error is not None:
        _pending[0] = None
        raise error
