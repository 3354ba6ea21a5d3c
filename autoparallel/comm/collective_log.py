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
from autoparallel.switch import env_on

RING = 8192             # notes kept between two drains (a heartbeat interval); older ones are counted as lost
RECENT = 64             # records per group published with each heartbeat, to name the calls
HISTORY = 8192          # digests per group remembered, to compare with a peer that is behind
MAX_FRAMES = 8          # user frames kept per call path
RULE = ("every rank must make the same collectives in the same order: code that runs on some ranks only "
        "(an evaluation forward, a state_dict gather, a save or a read of a distributed value inside "
        "`if rank == 0:`) made a collective the other ranks did not make, and the collectives paired wrongly")


def enabled() -> bool:
    """On unless ``AP_COLLECTIVE_LOG`` is ``off`` (``0``, ``false``, ``no``)."""
    return env_on("AP_COLLECTIVE_LOG", True)


def _hash(text: str, prev: int = 0) -> int:
    data = prev.to_bytes(8, "little") + text.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


_MASK, _ODD = (1 << 63) - 1, 0x9E3779B97F4A7C15


def _chain(digest: int, h: int) -> int:
    """The running digest of a group's records: a polynomial hash of their hashes, in order."""
    return (digest * 1000003 + h) & _MASK


def group_key(ranks) -> str:
    return ",".join(str(r) for r in ranks)


class _Group:
    __slots__ = ("count", "digest", "recent", "history", "gap")

    def __init__(self):
        self.count, self.digest, self.gap = 0, 0, False    # gap: notes were lost, the digest is this rank's own
        self.recent = collections.deque(maxlen=RECENT)        # [seq, kind, bytes, "kind@site"]
        self.history = collections.deque(maxlen=HISTORY)      # digests of seq count-len+1 .. count


class Log:
    """One process's log: ``note`` on the hot path, ``drain``/``summary``/``compare`` off it."""

    def __init__(self):
        self._ring = collections.deque(maxlen=RING)      # append/popleft: safe across threads without a lock
        self._seq: dict = {}           # group tuple -> collectives noted on it (written by the calling thread)
        self._groups: dict = {}        # group tuple -> _Group (drained)
        self._drain_lock = threading.RLock()  # the heartbeat (summary) and the judge (compare) threads
        self.lost = 0                  # notes that fell off the ring before a drain
        self._user_code: dict = {}     # code object -> is it user code
        self._sites: dict = {}         # (code, instruction offset) -> "file:line"
        self._texts: dict = {}         # (kind, call path) -> ("kind@site", its hash)
        self._dirs = None

    def note(self, kind: str, ranks, nbytes=None, depth: int = 1, site: bool = True) -> None:
        """This rank is about to make ``kind`` on the group ``ranks``: a tuple appended, nothing sent. The call
        path is kept as (code, instruction offset) pairs; their lines are looked up when drained. ``site=False``
        (a ``paddle.distributed`` call of the user's own: ranks may make it from different lines) keeps none."""
        key = tuple(ranks)
        if not site:
            seq = self._seq[key] = self._seq.get(key, 0) + 1
            self._ring.append((key, seq, kind, nbytes, None))
            return
        user, f, out = self._user_code, sys._getframe(depth), []
        while f is not None and len(out) < MAX_FRAMES:
            code = f.f_code
            mine = user.get(code)
            if mine is None:
                mine = user[code] = self._is_user(code.co_filename)
            if mine:
                out.append((code, f.f_lasti))
            f = f.f_back
        seq = self._seq[key] = self._seq.get(key, 0) + 1
        self._ring.append((key, seq, kind, nbytes, tuple(out)))

    def _is_user(self, filename: str) -> bool:
        if self._dirs is None:
            self._dirs = _library_dirs()
        return not filename.startswith(self._dirs) and not filename.startswith("<frozen")

    def _site(self, frame) -> str:
        text = self._sites.get(frame)
        if text is None:
            code, lasti = frame
            line = next((n for a, b, n in code.co_lines() if a <= lasti < b), None)
            text = self._sites[frame] = f"{os.path.basename(code.co_filename)}:{line}"
        return text

    def _text(self, kind: str, frames: tuple) -> tuple:
        got = self._texts.get((kind, frames))
        if got is None:
            where = "the user's paddle.distributed call" if frames is None else \
                ' < '.join(self._site(fr) for fr in frames) or 'inside the library'
            text = f"{kind}@{where}"
            got = self._texts[(kind, frames)] = (text, _hash(text))
        return got

    def drain(self) -> None:
        """Fold the notes made since the last drain into each group's digest and recent records."""
        with self._drain_lock:
            ring = self._ring
            while ring:
                key, seq, kind, nbytes, frames = ring.popleft()
                g = self._groups.get(key) or self._groups.setdefault(key, _Group())
                if seq != g.count + 1:                   # fell off the ring: the digest is no longer comparable
                    self.lost += seq - g.count - 1
                    g.gap = True
                text, h = self._text(kind, frames)
                size = _bytes(nbytes)
                g.count, g.digest = seq, _chain(g.digest, h ^ (size * _ODD & _MASK))
                g.history.append(g.digest)
                g.recent.append([seq, kind, size, text])

    def summary(self) -> dict:
        """What a heartbeat publishes: per group its count, digest and recent records (JSON)."""
        with self._drain_lock:
            self.drain()
            texts: dict = {}            # each call path once: records carry its index
            groups = {group_key(k): {"n": g.count, "d": -1 if g.gap else g.digest,
                                     "r": [[q, b, texts.setdefault(t, len(texts))] for q, _, b, t in g.recent]}
                      for k, g in self._groups.items()}
            return {"groups": groups, "texts": list(texts)}

    def digest_at(self, key: str, seq: int):
        """This rank's digest of ``key`` after its collective ``seq`` (None: not made yet, or forgotten)."""
        g = self._groups.get(tuple(int(r) for r in key.split(",")))
        if g is None or seq < 1 or seq > g.count or seq <= g.count - len(g.history):
            return None
        return g.history[len(g.history) - 1 - (g.count - seq)]

    def compare(self, me: int, peer: int, theirs: dict):
        """None when the peer's published log agrees with this rank's on every group both belong to, else the
        ``CollectiveMismatchError`` text naming each rank's call at the first disagreement found."""
        with self._drain_lock:
            self.drain()
            return self._compare(me, peer, theirs)

    def beyond(self, me: int, peer: int, final: dict):
        """None unless this rank has made more collectives on a group it shares with ``peer`` than ``peer`` made
        in its whole run (``final``: the log its process published as it ended); else the text naming the first
        collective nobody can join (a rank that ended early: a ``break``, a shorter loop, ``sys.exit(0)``)."""
        with self._drain_lock:
            self.drain()
            theirs = final.get("groups", {})
            texts = final.get("texts", [])
            for key, g in sorted(self._groups.items()):
                if peer not in key or me not in key:
                    continue
                t = theirs.get(group_key(key), {})
                n = int(t.get("n", 0))
                if g.count <= n:
                    continue
                first = next((r for r in g.recent if r[0] == n + 1), None)
                call = f" ({_call(first)})" if first is not None else ""
                last = [r for r in t.get("r", []) if r[0] == n]
                theirs_last = f"{texts[last[0][2]]} ({last[0][1]} bytes)" if last and last[0][2] < len(texts) \
                    else "none"
                return (f"rank {peer} ended its process cleanly (its script returned or called sys.exit) after {n} "
                        f"collectives on group [{group_key(key)}] (its last: {theirs_last}), and this rank has made "
                        f"{g.count}: its collective #{n + 1} on that group{call} can never be joined. The ranks ran "
                        f"different numbers of steps or collectives (a `break` or a loop of another length on some "
                        f"ranks, `sys.exit(0)` or a return on some ranks mid-training); every rank must make the "
                        f"same collectives")
        return None

    def _compare(self, me: int, peer: int, published: dict):
        texts = published["texts"]
        theirs = {k: dict(t, r=[[q, texts[i].split("@")[0], b, texts[i]] for q, b, i in t["r"]])
                  for k, t in published["groups"].items()}
        for key, t in sorted(theirs.items()):
            mine = self._groups.get(tuple(int(r) for r in key.split(",")))
            if mine is None:
                continue
            seq = min(t["n"], mine.count)
            if seq < 1:
                continue
            ours = None if mine.gap or t["d"] == -1 else self.digest_at(key, seq)
            if seq == t["n"] and ours is not None:
                same = ours == t["d"]
            else:                      # they are ahead, or a digest is not comparable: the records both hold
                by_seq = {m[0]: m for m in mine.recent}
                same = all(by_seq.get(r[0], r) == r for r in t["r"])
            if not same:
                return mismatch_text(key, me, peer, list(mine.recent), t["r"])
        return None


def _bytes(nbytes) -> int:
    if nbytes is None or isinstance(nbytes, int):
        return -1 if nbytes is None else nbytes
    shape, dtype = nbytes           # (shape, dtype) taken on the hot path: sized here
    n = 1
    for s in shape:
        n *= s
    item = _SIZES.get(dtype)
    if item is None:
        item = _SIZES[dtype] = _ITEM.get(str(dtype).split(".")[-1], 4)
    return n * item


_SIZES: dict = {}           # dtype object -> bytes per element
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
    with log._drain_lock:
        log.drain()
        items = sorted((group_key(k), g.count, -1 if g.gap else g.digest) for k, g in log._groups.items())[-64:]
    words = np.zeros(1 + 3 * 64, dtype=np.int64)
    words[0] = len(items)
    for i, (key, count, digest) in enumerate(items):
        words[1 + 3 * i: 4 + 3 * i] = (_group_id(key), count, digest)
    got = (gather or _world_gather)(words)
    why = entry_verdict([np.asarray(w) for w in got], {_group_id(k): k for k, _, _ in items})
    if why is not None:
        raise CollectiveMismatchError(f"refusing to save a checkpoint: {why}")


def entry_verdict(records: list, names: dict):
    """None when every group present on two ranks has one count and digest on both, else the reason."""
    seen: dict = {}
    for rank, w in enumerate(records):
        for i in range(int(w[0])):
            h, n, d = (int(x) for x in w[1 + 3 * i: 4 + 3 * i])
            if h in seen and (seen[h][1] != n or -1 not in (d, seen[h][2]) and seen[h][2] != d):
                r0, n0, _ = seen[h]
                name = names.get(h) or (",".join(str(r) for r in range(63) if h >> r & 1) if h > 0 else f"#{-h:x}")
                return (f"on group [{name}], rank {r0} has made {n0} collectives and rank {rank} {n}"
                        f"{' with different calls' if n0 == n else ''}. The rule: {RULE}")
            seen.setdefault(h, (rank, n, d))
    return None


def _group_id(key: str) -> int:
    """A group as one int64: the bit mask of its ranks when they are below 63 and listed in ascending order, else
    minus a hash of its key (``1,0`` is another communicator than ``0,1``, with counts of its own: one mask for
    both made a rank disagree with itself)."""
    ranks = [int(r) for r in key.split(",")]
    return sum(1 << r for r in ranks) if max(ranks) < 63 and ranks == sorted(ranks) else -_hash(key)


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
