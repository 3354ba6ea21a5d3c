"""Fail fast when a rank dies or freezes: heartbeats through a store every rank reaches.

paddle 3.3.1's gloo waits 30 s in a collective whose peer is gone (not configurable) and then reports
"pair_rank = -1"; a frozen peer can stall a job for good. A ``Watchdog`` runs two daemon threads on every
rank (gloo releases the GIL while it waits, so they run while the main thread is blocked):

* the I/O thread publishes this rank's heartbeat record (a counter, the operation in flight, the step,
  pid and host) and reads the records of the ranks it watches;
* the judge thread decides. A watched rank whose counter has not moved for ``timeout`` seconds is lost;
  so is one whose process has exited (seen at once for ranks on this host, through /proc); a store that
  stops answering means its host, rank 0, is lost. The first rank to decide publishes an abort note (rank
  0, whose process serves the TCP store, stays up until the others have read it); every rank prints
  ``autoparallel watchdog: ...`` naming the lost rank and the operations in flight and exits with
  ``exit_code`` (``os._exit``: a thread cannot unblock a collective any other way).

```python
wd = Watchdog(timeout=8).start()          # or AP_WATCHDOG_TIMEOUT=8; after init_parallel_env
with wd.op("all_reduce", step=step):      # what this rank is doing, named in the report
    dist.all_reduce(x)
with wd.long_wait("checkpoint write"):    # slow but alive: peers allow up to 2 x timeout of silence
    save_state_dict(...)
wd.stop()                                 # a clean exit: peers stop watching this rank
```

On the default path nobody writes this: ``ap.parallelize``, the training examples and the checkpoint
rendezvous call ``start_default()`` in a real multi-process job (opt out with ``AP_WATCHDOG=off`` or the
examples' ``--no-watchdog``). Defaults: a 10 s heartbeat timeout, so a frozen rank is named in about
12 s and every survivor has exited within about 15 s; a killed rank on this host is named at once.

The module-level ``op``, ``long_wait``, ``set_current_op`` and ``set_step`` act on the running watchdog and
do nothing when none runs, so library code (checkpoint writes) can call them unconditionally.

Stores: under ``paddle.distributed.launch`` a client of the job's TCP store (the one
``init_parallel_env`` creates, served by rank 0); ``AP_WATCHDOG_STORE=file:<dir>`` uses a directory every
rank sees; a single process needs none. The TCP store costs ~45 ms per request, so a rank watches all peers
up to 16 ranks and its next ``AP_WATCHDOG_PEERS`` (default 4) ranks in a ring beyond, everyone polling the
abort note. Other ways a rank ends are reported too: an exception in the main thread (for example the
"Connection reset by peer" of a collective whose peer died) first waits up to ``timeout`` for the judge to
name a lost rank, and SIGTERM (the launcher tearing the job down after a peer died) is held for
``term_grace`` seconds so the report is written before the process ends.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import signal
import socket
import sys
import threading
import time

PREFIX = "autoparallel watchdog"
DEFAULT_TIMEOUT = 10.0
LONG_WAIT_FACTOR = 2.0        # a long wait may stretch a running peer's silence to at most 2 x timeout
DEFAULT_EXIT_CODE = 75
RING_ABOVE = 16


from autoparallel.watchdog_store import (FileStore, MemoryStore, TCPStoreClient, _proc_start_time,  # noqa: F401
                                      default_store, process_state)


# ---- the watchdog --------------------------------------------------------------------------------------
class _Peer:
    __slots__ = ("rank", "up", "seq", "changed", "record")

    def __init__(self, rank: int, now: float):
        self.rank, self.up, self.seq, self.changed, self.record = rank, False, None, now, {}


def _env_float(name: str, default):
    text = os.environ.get(name)
    if text in (None, ""):
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive, got {text!r}")
    return value


def _seconds(name: str, value):
    """A positive finite number of seconds as float, or None when ``value`` is None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number of seconds, got {value!r}")
    return float(value)


def _exit_code(value) -> int:
    try:
        code = int(value)
    except (TypeError, ValueError):
        raise TypeError(f"exit_code (AP_WATCHDOG_EXIT_CODE) must be an int in [1, 255], got {value!r}") from None
    if isinstance(value, bool) or not 1 <= code <= 255:
        raise ValueError(f"exit_code (AP_WATCHDOG_EXIT_CODE) must be in [1, 255] (0 would report success), "
                         f"got {value!r}")
    return code


def _check_peers(peers, rank: int, world_size: int) -> list:
    ranks = list(peers) if isinstance(peers, (list, tuple, set, frozenset)) else None
    if ranks is None or any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
        raise TypeError(f"peers must be a list of int ranks, got {peers!r}")
    bad = [r for r in ranks if not 0 <= r < world_size or r == rank]
    if bad:
        raise ValueError(f"peers must be other ranks in [0, {world_size}) (this rank is {rank}), got {bad}")
    return sorted(set(ranks))


_current = [None]


class Watchdog:
    def __init__(self, timeout: float = None, interval: float = None, *, store=None, rank: int = None,
                 world_size: int = None, long_wait_timeout: float = None, op_timeout: float = None,
                 startup_timeout: float = None, term_grace: float = None, exit_code: int = None,
                 on_failure=None, exit_fn=None, install_handlers: bool = True, peers: list = None,
                 namespace: str = "ap_wd"):
        self.timeout = _seconds("timeout", timeout) or _env_float("AP_WATCHDOG_TIMEOUT", DEFAULT_TIMEOUT)
        self.interval = _seconds("interval", interval) or max(0.1, min(self.timeout / 6, 2.0))
        if not self.interval < self.timeout:
            raise ValueError(f"interval must be below timeout={self.timeout:g} s, got {self.interval:g}")
        cap = LONG_WAIT_FACTOR * self.timeout
        self.long_wait_timeout = _seconds("long_wait_timeout", long_wait_timeout) or \
            _env_float("AP_WATCHDOG_LONG_WAIT", cap)
        if not self.long_wait_timeout <= cap:
            raise ValueError(f"long_wait_timeout must be in (0, {cap:g}] s ({LONG_WAIT_FACTOR:g} x timeout: a silent "
                             f"rank is named within that bound even during a long operation), got "
                             f"{self.long_wait_timeout:g}")
        self.op_timeout = _seconds("op_timeout", op_timeout) or _env_float("AP_WATCHDOG_OP_TIMEOUT", None)
        self.startup_timeout = _seconds("startup_timeout", startup_timeout) or max(60.0, self.timeout)
        self.term_grace = _seconds("term_grace", term_grace) or min(self.timeout, 3.0)
        self.exit_code = _exit_code(exit_code if exit_code is not None else
                                    os.environ.get("AP_WATCHDOG_EXIT_CODE", DEFAULT_EXIT_CODE))
        for name, fn in (("on_failure", on_failure), ("exit_fn", exit_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a callable or None, got {type(fn).__name__} {fn!r}")
        if not isinstance(namespace, str) or not namespace:
            raise TypeError(f"namespace must be a non-empty str, got {namespace!r}")
        self.on_failure = on_failure
        self._exit = exit_fn or os._exit
        self._install_handlers = install_handlers
        self.rank, self.world_size = self._identity(rank, world_size)
        self._peer_ranks = _check_peers(peers, self.rank, self.world_size) if peers is not None else \
            self._default_peers()
        if store is not None and not all(callable(getattr(store, m, None)) for m in ("set", "get", "add")):
            raise TypeError(f"store must have set(key, bytes), get(key) and add(key, int) (like MemoryStore, "
                            f"FileStore), got {type(store).__name__}")
        self.store = store if store is not None else default_store(self.world_size)
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._wake = threading.Event()        # publish now (a long operation begins)
        self._verdict = threading.Event()
        self.failure = None
        self._seq = 0
        self._op = None                       # (name, monotonic start)
        self._step = None
        self._long_waits: list = []
        self._error = None
        self._error_op = None
        self._diagnosed = None
        self._threads: list = []
        self._sigterm_at = None
        self._prev_sigterm = None
        self._prev_excepthook = None
        self._prefix = namespace
        self._host = socket.gethostname()
        self._start_time = _proc_start_time(os.getpid())

    # ---- identity --------------------------------------------------------------------------------
    @staticmethod
    def _identity(rank, world_size):
        for name, v in (("rank", rank), ("world_size", world_size)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
        if (rank is None) != (world_size is None):
            raise ValueError(f"pass rank and world_size together (or neither: read from the job), got rank={rank}, "
                             f"world_size={world_size}")
        if rank is not None:
            if world_size < 1:
                raise ValueError(f"world_size must be >= 1, got {world_size}")
            if not 0 <= rank < world_size:
                raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
            return int(rank), int(world_size)
        try:
            import paddle.distributed as dist

            if dist.is_initialized():
                return dist.get_rank(), dist.get_world_size()
        except ImportError:
            pass
        return int(os.environ.get("PADDLE_TRAINER_ID", 0)), int(os.environ.get("PADDLE_TRAINERS_NUM", 1))

    def _default_peers(self) -> list:
        others = [r for r in range(self.world_size) if r != self.rank]
        if self.world_size <= RING_ABOVE:
            return others
        k = int(os.environ.get("AP_WATCHDOG_PEERS", 4))
        return sorted({(self.rank + i) % self.world_size for i in range(1, k + 1)} - {self.rank})

    # ---- public API ---------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return bool(self._threads) and not self._halt.is_set()

    @property
    def beats(self) -> int:
        """Heartbeat records this rank has published so far."""
        return self._seq

    def start(self) -> "Watchdog":
        if self._threads:
            raise RuntimeError("this watchdog is already started")
        now = time.monotonic()
        self._started = now
        self._io_ok = now
        self._peers = {r: _Peer(r, now) for r in self._peer_ranks}
        self._publish()
        self.store.add(f"{self._prefix}/up/{self.rank}", 1)
        if self._install_handlers:
            self._install()
        atexit.register(self.stop)
        self._threads = [threading.Thread(target=self._io_loop, name="ap-watchdog-io", daemon=True),
                         threading.Thread(target=self._judge_loop, name="ap-watchdog-judge", daemon=True)]
        for t in self._threads:
            t.start()
        _current[0] = self
        return self

    def stop(self, error: str = None) -> None:
        """Stop watching; peers see a clean stop (or ``error``) and stop watching this rank."""
        if not self._threads:
            return
        halted = self._halt.is_set()
        self._halt.set()
        self._wake.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=self.timeout)
        if self.failure is None and not halted:
            with contextlib.suppress(Exception):
                self._publish(stopped=True, error=error or self._error)
                if getattr(self.store, "host_rank", None) == self.rank:
                    self._wait_for_peers_to_stop(min(self.timeout, 10.0))
        self._uninstall()
        atexit.unregister(self.stop)
        if _current[0] is self:
            _current[0] = None

    def _wait_for_peers_to_stop(self, seconds: float) -> None:
        """The store lives in this process: keep it up (at most ``seconds``) until the other ranks have
        stopped watching, so that none of them mistakes this clean exit for a lost rank."""
        deadline = time.monotonic() + seconds
        pending = [r for r in range(self.world_size) if r != self.rank]
        while pending and time.monotonic() < deadline:
            still = []
            for r in pending:
                if self.store.add(self._key("up", r), 0) > 0 and \
                        json.loads(self.store.get(self._key("rec", r))).get("stopped"):
                    continue
                still.append(r)
            pending = still
            if pending:
                time.sleep(0.05)

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, exc, tb):
        self.stop(error=None if exc is None else f"{exc_type.__name__}: {exc}")

    @contextlib.contextmanager
    def op(self, name: str, step=None):
        """Mark ``name`` as this rank's operation in flight; on an exception, name a lost rank first."""
        previous = self._op
        self._op = (str(name), time.monotonic())
        if step is not None:
            self._step = step
        try:
            yield self
        except Exception as e:
            self.diagnose(e)
            raise
        finally:
            self._op = previous

    def set_current_op(self, name, step=None) -> None:
        self._op = None if name is None else (str(name), time.monotonic())
        if step is not None:
            self._step = step

    def set_step(self, step) -> None:
        self._step = step

    @contextlib.contextmanager
    def long_wait(self, reason: str = "", seconds: float = None):
        """A legitimately long stretch (a checkpoint write), named ``reason`` as the operation in flight: this
        rank's own op deadline is paused, and peers allow its heartbeat ``seconds`` (default
        long_wait_timeout; at most 2 x timeout) of silence while its process runs. Heartbeats come from a
        thread of their own, so they go on during the long operation; a process found stopped (SIGSTOP) gets
        no allowance, and a silent rank is always named within 2 x timeout."""
        cap = LONG_WAIT_FACTOR * self.timeout
        limit = min(_seconds("long_wait seconds", seconds), cap) if seconds is not None else self.long_wait_timeout
        self._long_waits.append(limit)
        previous = self._op
        if reason:
            self._op = (str(reason), time.monotonic())
        self._wake.set()                      # peers learn of the allowance (and the operation) at once
        try:
            yield self
        finally:
            self._long_waits.remove(limit)
            if reason:
                self._op = previous

    def diagnose(self, exc: BaseException = None) -> None:
        """Wait up to ``timeout`` for the judge to name a lost rank (it ends the process if it does)."""
        if not self.running or self.failure is not None or (exc is not None and exc is self._diagnosed):
            return
        if exc is not None:
            self._diagnosed = exc
            self._error = f"{type(exc).__name__}: {str(exc)[:300]}"
            self._error_op = self._op
            _write_stderr(f"{PREFIX}: rank {self.rank}: {self._op_text()} raised {self._error}; checking the "
                          f"other ranks for up to {self.timeout:.1f} s")
        self._verdict.wait(self.timeout + 2 * self.interval)

    # ---- records --------------------------------------------------------------------------------------
    def _key(self, what: str, rank: int) -> str:
        return f"{self._prefix}/{what}/{rank}"

    def _publish(self, stopped: bool = False, error: str = None) -> None:
        self._seq += 1
        op = self._error_op if stopped and error and self._error_op else self._op
        record = {"seq": self._seq, "op": op[0] if op else None, "step": _jsonable(self._step),
                  "long_wait": max(self._long_waits) if self._long_waits else 0, "pid": os.getpid(),
                  "host": self._host, "start": self._start_time, "stopped": stopped, "error": error}
        self.store.set(self._key("rec", self.rank), json.dumps(record).encode())

    def _op_text(self) -> str:
        op = self._op
        if op is None:
            return "no operation"
        step = f" (step {self._step})" if self._step is not None else ""
        return f"'{op[0]}'{step} for {time.monotonic() - op[1]:.1f} s"

    # ---- the I/O thread ---------------------------------------------------------------------------------
    def _io_loop(self) -> None:
        while not self._halt.is_set():
            try:
                self._io_round()
            except Exception as e:          # the store is gone: its host went down with it
                self._store_lost(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                return
            self._wake.wait(self.interval)
            self._wake.clear()

    def _follow_abort(self) -> bool:
        """Exit with the abort note another rank published, if there is one."""
        if self.store.add(f"{self._prefix}/abort", 0) == 0:
            return False
        note = json.loads(self.store.get(f"{self._prefix}/abort_msg"))
        if getattr(self.store, "host_rank", None) != self.rank:     # the host counts the others' acks
            self.store.add(f"{self._prefix}/abort_ack", 1)
        self._fail(f"exiting because rank {note['rank']} reported: {note['reason']}", publish=False)
        return True

    def _io_round(self) -> None:
        self._publish()
        if self._follow_abort():
            return
        exited = []
        for peer in self._peers.values():
            if not peer.up:
                peer.up = self.store.add(self._key("up", peer.rank), 0) > 0
                if not peer.up:
                    continue
                peer.changed = time.monotonic()
            record = json.loads(self.store.get(self._key("rec", peer.rank)))
            if record["seq"] != peer.seq:
                peer.seq, peer.changed = record["seq"], time.monotonic()
            peer.record = record
            if record.get("error") and record.get("stopped"):
                self._fail(f"rank {peer.rank} exited after an error in {_their_op(record)}: {record['error']}")
                return
            if record.get("host") == self._host and not record.get("stopped"):
                if process_state(record["pid"], record.get("start")) == "exited":
                    exited.append(peer)
        # a rank that reported a loss exits too: read its note first, then blame the earliest silent rank
        if exited and not self._follow_abort():
            self._fail(_exited_reason(exited))
            return
        self._io_ok = time.monotonic()

    def _store_lost(self, error: str) -> None:
        host_rank = getattr(self.store, "host_rank", None)
        record = self._peers[host_rank].record if host_rank in self._peers else {}
        if record.get("stopped") and not record.get("error"):
            self._halt.set()                # its host finished cleanly: nothing left to watch through it
            return
        who = f"rank {host_rank} lost: " if host_rank is not None and host_rank != self.rank else ""
        if record.get("host") == self._host and "pid" in record:      # a reset connection: let it finish exiting
            deadline = time.monotonic() + 0.5
            while process_state(record["pid"], record.get("start")) == "running" and time.monotonic() < deadline:
                time.sleep(0.05)
        last = ""
        if record:
            last = f"{_process_note(record, self._host)}; rank {host_rank} was last in {_their_op(record)}"
        self._fail(f"{who}{self.store.describe()} is unreachable ({error}){last}")

    # ---- the judge thread -------------------------------------------------------------------------------
    def _judge_loop(self) -> None:
        tick = min(self.interval / 2, 0.25)
        while not self._halt.wait(tick):
            self._judge(time.monotonic())

    def _judge(self, now: float) -> None:
        if now - self._io_ok > self.timeout:
            self._store_lost(f"no answer for {now - self._io_ok:.1f} s")
            return
        for peer in self._peers.values():
            rec = peer.record
            if rec.get("stopped"):
                continue
            if not peer.up:
                if now - self._started > self.startup_timeout:
                    self._fail(f"rank {peer.rank} lost: it never started its watchdog within "
                               f"{self.startup_timeout:.0f} s")
                    return
                continue
            silent = self._io_ok - peer.changed
            if silent > self.timeout and silent > self._silence_limit(rec):
                self._fail(f"rank {peer.rank} lost: no heartbeat for {silent:.1f} s (limit "
                           f"{self._silence_limit(rec):.1f} s)"
                           f"{_process_note(rec, self._host)}; it was last in {_their_op(rec)}")
                return
        op = self._op
        if self.op_timeout and op is not None and not self._long_waits and now - op[1] > self.op_timeout:
            self._fail(f"its operation in flight has run beyond the op timeout of {self.op_timeout:g} s "
                       f"(AP_WATCHDOG_OP_TIMEOUT)")
            return
        if self._sigterm_at is not None and now - self._sigterm_at > self.term_grace:
            self._end_for_sigterm()

    def _silence_limit(self, rec: dict) -> float:
        """How long a peer may stay silent: timeout, or its long-wait allowance (<= 2 x timeout) while its
        process is not known to be stopped."""
        allowance = min(rec.get("long_wait") or 0, LONG_WAIT_FACTOR * self.timeout)
        if allowance <= self.timeout:
            return self.timeout
        if rec.get("host") == self._host and "pid" in rec and \
                process_state(rec["pid"], rec.get("start")) == "stopped":
            return self.timeout                  # frozen, not busy: no allowance
        return allowance

    # ---- failing -----------------------------------------------------------------------------------------
    def _fail(self, reason: str, publish: bool = True) -> None:
        with self._lock:
            if self.failure is not None or self._halt.is_set():
                return
            message = (f"{PREFIX}: rank {self.rank}: {reason}. This rank was in {self._op_text()}. "
                       f"Exiting with code {self.exit_code}.")
            self.failure = message
        if publish:                            # the note, and this rank's own acknowledgement: the host of the
            note = json.dumps({"rank": self.rank, "reason": reason}).encode()      # store need not wait for it
            host = getattr(self.store, "host_rank", None) == self.rank
            _bounded(lambda: (self.store.set(f"{self._prefix}/abort_msg", note),
                              self.store.add(f"{self._prefix}/abort", 1),
                              host or self.store.add(f"{self._prefix}/abort_ack", 1)), 1.0)
        _write_stderr(message)
        if getattr(self.store, "host_rank", None) == self.rank:
            self._linger()
        if self.on_failure is not None:
            with contextlib.suppress(Exception):
                self.on_failure(message)
        self._halt.set()
        self._verdict.set()
        self._exit(self.exit_code)

    def _linger(self) -> None:
        """The store lives in this process: keep it up until the other ranks have read the abort note (or
        ``2 * interval + 1`` s passed), so they report the lost rank rather than this exit."""
        deadline = time.monotonic() + min(2 * self.interval + 1.0, self.timeout)
        while time.monotonic() < deadline:
            try:
                if self.store.add(f"{self._prefix}/abort_ack", 0) >= self.world_size - 2:
                    return
            except Exception:
                return
            time.sleep(0.05)

    # ---- signal and exception hooks ---------------------------------------------------------------------
    def _install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._prev_excepthook = sys.excepthook
        sys.excepthook = self._excepthook

    def _uninstall(self) -> None:
        if self._prev_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._prev_sigterm)
            self._prev_sigterm = None
        if self._prev_excepthook is not None and sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook
            self._prev_excepthook = None

    def _on_sigterm(self, signum, frame) -> None:
        if self._sigterm_at is None:
            self._sigterm_at = time.monotonic()
        if callable(self._prev_sigterm):
            self._prev_sigterm(signum, frame)

    def _end_for_sigterm(self) -> None:
        if callable(self._prev_sigterm) or self._prev_sigterm == signal.SIG_IGN:
            self._sigterm_at = None             # someone else handles SIGTERM
            return
        exited = [p for p in self._peers.values() if p.record.get("host") == self._host
                  and not p.record.get("stopped") and process_state(p.record["pid"], p.record.get("start")) == "exited"]
        if exited:                              # the job is torn down because of a lost rank: name it
            self._fail(_exited_reason(exited))
            return
        with self._lock:
            if self.failure is not None or self._halt.is_set():
                return
            self.failure = (f"{PREFIX}: rank {self.rank}: terminated by SIGTERM (no lost rank found within "
                            f"{self.term_grace:g} s) while in {self._op_text()}")
        _write_stderr(self.failure)
        self._halt.set()
        _bounded(lambda: self._publish(stopped=True, error="terminated by SIGTERM"), 2.0)
        self._verdict.set()
        self._exit(128 + signal.SIGTERM)

    def _excepthook(self, exc_type, exc, tb) -> None:
        (self._prev_excepthook or sys.__excepthook__)(exc_type, exc, tb)
        if issubclass(exc_type, Exception):
            self.diagnose(exc)
        self.stop(error=f"{exc_type.__name__}: {str(exc)[:300]}")


def _exited_reason(exited: list) -> str:
    """The loss to report when the processes of ``exited`` peers are gone: the one silent for longest."""
    first = min(exited, key=lambda p: p.changed)
    rec = first.record
    later = sorted(p.rank for p in exited if p is not first)
    also = f"; ranks {later} have exited since" if later else ""
    return (f"rank {first.rank} lost: its process (pid {rec['pid']} on this host) has exited; it was last in "
            f"{_their_op(rec)}{also}")


def _process_note(record: dict, host: str) -> str:
    """What /proc says about the process of a record from this host ("" for other hosts)."""
    if record.get("host") != host or "pid" not in record:
        return ""
    state = process_state(record["pid"], record.get("start"))
    return {"stopped": f"; its process (pid {record['pid']} on this host) is stopped (SIGSTOP?)",
            "exited": f"; its process (pid {record['pid']} on this host) has exited",
            "running": f"; its process (pid {record['pid']} on this host) is running but silent"}.get(state, "")


def _their_op(record: dict) -> str:
    op = record.get("op")
    step = record.get("step")
    text = f"'{op}'" if op else "no operation"
    return text + (f" (step {step})" if step is not None else "")


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def _bounded(fn, seconds: float) -> None:
    """Run ``fn`` in a daemon thread, waiting at most ``seconds`` (a frozen store must not hold us)."""
    t = threading.Thread(target=_quiet, args=(fn,), daemon=True)
    t.start()
    t.join(seconds)


def _quiet(fn) -> None:
    try:
        fn()
    except Exception:
        pass


def _write_stderr(text: str) -> None:
    data = (text.rstrip("\n") + "\n").encode(errors="replace")
    with contextlib.suppress(OSError):
        sys.stderr.flush()
        os.write(2, data)


# ---- module-level functions: act on the running watchdog, do nothing without one ---------------------
def current():
    """The watchdog started in this process (None if none runs)."""
    wd = _current[0]
    return wd if wd is not None and wd.running else None


def op(name: str, step=None):
    wd = current()
    return wd.op(name, step) if wd is not None else contextlib.nullcontext()


def long_wait(reason: str = "", seconds: float = None):
    wd = current()
    return wd.long_wait(reason, seconds) if wd is not None else contextlib.nullcontext()


def set_current_op(name, step=None) -> None:
    wd = current()
    if wd is not None:
        wd.set_current_op(name, step)


def set_step(step) -> None:
    wd = current()
    if wd is not None:
        wd.set_step(step)


OFF_VALUES = ("0", "off", "false", "no")


def disabled() -> bool:
    """True when ``AP_WATCHDOG`` opts out of the default watchdog (``0``, ``off``, ``false`` or ``no``)."""
    return os.environ.get("AP_WATCHDOG", "").strip().lower() in OFF_VALUES


def start_default():
    """The watchdog of a real multi-process job, started with the default settings if none runs yet.

    Called by ``ap.parallelize``, the training examples and the checkpoint rendezvous, so a lost or frozen
    rank is named on the default path. Does nothing (returns None) in one process, in the simulated
    world, before ``init_parallel_env``, or with ``AP_WATCHDOG=off``."""
    wd = current()
    if wd is not None or disabled():
        return wd
    try:
        import paddle.distributed as dist

        from autoparallel.comm.world import current_world
    except ImportError:
        return None
    if current_world().is_simulated or not dist.is_initialized() or dist.get_world_size() <= 1:
        return None
    return Watchdog().start()
