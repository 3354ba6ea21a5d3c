"""Every rank must make the same collectives in the same order: a check that refuses anything else.

gloo (and NCCL) pair a group's collectives by order alone. Code that runs on some ranks only -- reading a
distributed value, gathering a state_dict, running an evaluation forward inside ``if rank == 0:`` -- makes
a collective the other ranks do not make; theirs next pairs with it. Today that is a gloo abort (sizes
differ), a 30 s hang (the others never come), or, when sizes agree, the run going on with wrong values.

Before each collective of the real transport, every member of the group sends the others a 128-byte record:
how many collectives it has made on this group, the kind (all_reduce, all_gather, ...) and the user's call
path that asked for it (every frame outside autoparallel, paddle and the standard library). The records
travel in one all_gather of 16 int64 words per rank, so a rank-only collective always pairs with another
rank's check, never with its payload; when the records differ, every member raises
``CollectiveMismatchError`` naming each rank's call and the rule. Cost: one extra 128-byte all_gather per
collective (a latency term, no bandwidth), measured by ``tools/bench_agreement.py``; it is not counted among the
payload calls of ``count_comm`` (``stats()`` counts it). Off by default (not cheap: ``enabled``); turn it on
with ``AP_COLLECTIVE_CHECK=on`` while writing or debugging a script's rank-0 logging, saving and evaluation. The simulated world runs every rank in one process and never checks.
Without it, the collective log (comm/collective_log.py, on by default) finds the same mismatch after the payloads
moved, within about two heartbeats, with no extra collective.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import time

import numpy as np

from autoparallel.switch import env_on

WORDS = 16                                   # int64 words per record: [count, hash, 14 words of text]
TEXT_BYTES = 8 * (WORDS - 2)
_counts: dict = {}                           # (this rank, group ranks) -> collectives made on it
_state = threading.local()                   # .raised: the mismatch raised on this thread (typed_in_backward)
_stats = {"checks": 0, "seconds": 0.0}


class CollectiveMismatchError(RuntimeError):
    """The members of a group are not making the same collective: code ran on some ranks only."""

    every_rank_knows = True              # raised by every member of the group: the watchdog looks for no lost rank


def enabled(backend: str = "gloo") -> bool:
    """``AP_COLLECTIVE_CHECK=on`` turns the check on (any backend); unset or ``off``: no check. Off by default:
    one more small collective per collective is not cheap (docs/rank_divergent_code.md: +45-60 % on the
    collective-heavy 4-rank training jobs on 2 CPU cores)."""
    return env_on("AP_COLLECTIVE_CHECK", False)


def raw_all_gather():
    """paddle's all_gather from its own module: the records are not payload, so wrappers of the
    ``paddle.distributed`` namespace (comm/counter.py's ``count_comm``, ap.profile) do not count them;
    ``stats()`` does."""
    import importlib

    return importlib.import_module("paddle.distributed.communication.all_gather").all_gather


def stats() -> dict:
    """Checks this process made and the seconds they took (the cost of the agreement)."""
    return dict(_stats)


def _library_dirs() -> tuple:
    """autoparallel, reshard, spmd_rules (siblings in the source tree), paddle, the standard library, and the
    code paddle's translator generates from a user's function (a temp file of a random name per process: the
    ranks would differ by it; the user's own frames around the static call remain)."""
    import importlib.util

    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(pkg)
    paddle_dir = os.path.dirname(importlib.util.find_spec("paddle").origin)
    dirs = [pkg, os.path.join(root, "reshard"), os.path.join(root, "spmd_rules"), paddle_dir,
            os.path.dirname(os.__file__), os.path.join(os.path.expanduser("~/.cache"), "paddle", "to_static_tmp")]
    return tuple(d + os.sep for d in dirs)


_DIRS: list = []


def user_site() -> str:
    """The user's call path to here: each frame outside autoparallel, paddle and the standard library as
    ``file:line``, innermost first, joined by `` < `` (a model's ``forward`` line alone does not tell a
    training step from an evaluation)."""
    if not _DIRS:
        _DIRS.extend(_library_dirs())
    dirs, out = tuple(_DIRS), []
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(dirs) and not name.startswith("<frozen"):
            out.append(f"{os.path.basename(name)}:{f.f_lineno}")
        f = f.f_back
    return " < ".join(out) if out else "inside the library"


def record(count: int, kind: str, site: str) -> np.ndarray:
    """The 16-word record one rank sends: its count on the group, a 63-bit hash of ``kind@site``, then that
    text in utf-8 (truncated to 112 bytes; the hash covers all of it)."""
    full = f"{kind}@{site}".encode()
    digest = int.from_bytes(hashlib.blake2b(full, digest_size=8).digest(), "little") >> 1
    text = full[:TEXT_BYTES].ljust(TEXT_BYTES, b"\0")
    return np.concatenate([np.array([count, digest], dtype=np.int64), np.frombuffer(text, dtype=np.int64)])


def parse(words) -> tuple:
    """(count, hash, 'kind@site' as sent) of a record."""
    words = np.asarray(words, dtype=np.int64).reshape(-1)
    return int(words[0]), int(words[1]), words[2:].tobytes().rstrip(b"\0").decode(errors="replace")


def verdict(ranks, records, me: int):
    """None when every member's record (``records`` in ``ranks`` order) equals ours, else the error text."""
    got = [parse(r) for r in records]
    mine = got[ranks.index(me)]
    if all(g == mine for g in got):
        return None
    calls = "; ".join(f"rank {r}: collective #{c} on this group, {what}" for r, (c, _, what) in zip(ranks, got))
    return (f"the ranks of group {list(ranks)} are not making the same collective ({calls}). Code that runs on "
            f"some ranks only made a collective: every rank of the group must make each collective, from the "
            f"same line -- reading a distributed value (float(), item(), numpy(), print), gathering a "
            f"state_dict or running a forward inside `if rank == 0:` needs every rank to call it (or compute "
            f"it on every rank and print on one). This rank is {me}, at {mine[2]}.")


def check(exchange, kind: str, ranks, me: int, site: str = None) -> None:
    """Agree with the other members of ``ranks`` on this collective before it runs, or raise
    ``CollectiveMismatchError`` on every member. ``exchange(np record) -> [record of each member in
    ranks order]`` is the transport's all_gather of the records."""
    key = (me, tuple(sorted(ranks)))
    count = _counts.get(key, 0) + 1
    _counts[key] = count
    mine = record(count, kind, site if site is not None else user_site())
    start = time.perf_counter()
    records = exchange(mine)
    _stats["checks"] += 1
    _stats["seconds"] += time.perf_counter() - start
    why = verdict(list(ranks), records, me)
    if why is not None:
        _state.raised = CollectiveMismatchError(why)
        raise _state.raised


@contextlib.contextmanager
def typed_in_backward():
    """paddle's backward turns an exception raised in a hook or PyLayer into ``SystemError``/``OSError``
    "(External) ..."; re-raise a mismatch found during the block as itself."""
    _state.raised = None
    try:
        yield
    except Exception as e:
        found, _state.raised = getattr(_state, "raised", None), None
        if found is not None and found is not e:
            raise found from e
        raise


def reset() -> None:
    """Forget the per-group counts (a new job in the same process)."""
    _counts.clear()


def check_world(kind: str, rank: int, world_size: int, backend: str = "gloo") -> None:
    """The check on the whole job (paddle's default group), for entry points that exchange on it with raw
    ``paddle.distributed`` calls (a checkpoint save): called on some ranks only, they meet another rank's record
    and raise here, instead of pairing their first exchange with another rank's collective."""
    if world_size < 2 or not enabled(backend):
        return
    import paddle

    gather = raw_all_gather()

    def exchange(rec):
        out = []
        gather(out, paddle.to_tensor(rec))
        return list(paddle.stack(out).numpy())

    # the kind alone: every rank in the entry point is right, whichever line calls it
    check(exchange, kind, list(range(world_size)), rank, site="every rank")

