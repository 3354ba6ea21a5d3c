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

On the default path nobody writes this: ``ap.init_parallel_env``, ``ap.shard_layer``, ``ap.parallelize``, the
training examples and the checkpoint rendezvous call ``start_default()`` in a real multi-process job (opt out
with ``AP_WATCHDOG=off`` or the examples' ``--no-watchdog``). Defaults: a 10 s heartbeat timeout, so a frozen
rank is named in about 12 s and every survivor has exited within about 15 s; a killed rank on this host is named
at once.

The module-level ``op``, ``long_wait``, ``set_current_op`` and ``set_step`` act on the running watchdog and
do nothing when none runs, so library code (checkpoint writes) can call them unconditionally.

Each heartbeat also carries this rank's collective log (comm/collective_log.py, on by default): the judge
compares every peer's with its own and ends every rank with ``CollectiveMismatchError`` when two ranks' collectives
on a group they share differ (code that ran on some ranks only), about two heartbeats after the collective. A process
that ends cleanly publishes its final log: a peer that has made more collectives on a group with it (a ``break`` or
``sys.exit(0)`` on some ranks) is ended naming it, and without the log a failed collective names it in a note.

Stores: under ``paddle.distributed.launch`` a client of the job's TCP store (the one ``init_parallel_env`` creates,
served by rank 0); ``AP_WATCHDOG_STORE=file:<dir>`` uses a directory every rank sees (on a disk busy with writes, a
heartbeat write can stall past a short timeout and read as an unreachable directory: keep it on tmpfs or a quiet
disk); a single process needs none. The TCP store costs ~45 ms per request, so a rank watches all peers up to 16
ranks and its next ``AP_WATCHDOG_PEERS`` (default 4) ranks in a ring beyond, everyone polling the abort note. Other
ways a rank ends are reported too: an exception in the main thread (for example the "Connection reset by peer" of a
collective whose peer died) first waits up to ``timeout`` for the judge to name a lost rank, and SIGTERM (the
launcher tearing the job down after a peer died) is held for ``term_grace`` seconds so the report is written before
the process ends.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time

from autoparallel.config.fields import integral
from autoparallel.watchdog_heartbeat import HeartbeatMixin
from autoparallel.watchdog_judge import JudgingMixin
from autoparallel.watchdog_messages import _ended_note, _never_started_note, _their_op, _write_stderr
from autoparallel.watchdog_settings import (DEFAULT_EXIT_CODE, DEFAULT_TIMEOUT, LONG_WAIT_FACTOR, PREFIX, RING_ABOVE,
                                            _check_peers, _env_float, _exit_code, _Peer, _seconds)
from autoparallel.watchdog_signals import SignalsMixin
from autoparallel.watchdog_store import (FileStore, MemoryStore, TCPStoreClient, _proc_start_time,  # noqa: F401
                                      default_store, process_state)

_current = [None]


class Watchdog(HeartbeatMixin, JudgingMixin, SignalsMixin):
    def __init__(self, timeout: float = None, interval: float = None, *, store=None, rank: int = None,
                 world_size: int = None, long_wait_timeout: float = None, op_timeout: float = None,
                 startup_timeout: float = None, term_grace: float = None, exit_code: int = None,
                 on_failure=None, exit_fn=None, install_handlers: bool = True, peers: list = None,
                 namespace: str = "ap_wd", collective_log=None):
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
        self._exiting = False                 # stopped by the process's exit: no collective follows
        self._prev_sigterm = None
        self._prev_excepthook = None
        self._prefix = namespace
        self._host = socket.gethostname()
        self._start_time = _proc_start_time(os.getpid())
        if collective_log is not None and not all(callable(getattr(collective_log, m, None))
                                                  for m in ("summary", "compare")):
            raise TypeError(f"collective_log must have summary() and compare() (a comm.collective_log.Log), got "
                            f"{type(collective_log).__name__}")
        self._clog = collective_log if collective_log is not None else _default_log()

    @staticmethod
    def _identity(rank, world_size):
        rank, world_size = (v if integral(v) is None else integral(v) for v in (rank, world_size))  # numpy ints
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
        text = os.environ.get("AP_WATCHDOG_PEERS", "").strip() or "4"
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"AP_WATCHDOG_PEERS must be a positive integer (peers each rank watches), got {text!r}")
        k = int(text)
        return sorted({(self.rank + i) % self.world_size for i in range(1, k + 1)} - {self.rank})

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
        atexit.register(self._stop_at_exit)
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
        atexit.unregister(self._stop_at_exit)
        if _current[0] is self:
            _current[0] = None

    def _stop_at_exit(self) -> None:
        """``stop`` as the process ends: the record says so, and peers that go on to make collectives this
        rank never made are ended naming it (``collective_log.Log.beyond``)."""
        self._exiting = True
        self.stop()

    def _wait_for_peers_to_stop(self, seconds: float) -> None:
        """The store lives in this process: keep it up (at most ``seconds``) until the other ranks have
        stopped watching, so that none of them mistakes this clean exit for a lost rank."""
        deadline = time.monotonic() + seconds
        pending = [r for r in range(self.world_size) if r != self.rank]
        while pending and time.monotonic() < deadline:
            if self.store.add(f"{self._prefix}/abort", 0) > 0:     # a peer failed: say why here too, stop waiting
                note = json.loads(self.store.get(f"{self._prefix}/abort_msg"))
                _write_stderr(f"{PREFIX}: rank {self.rank}: this rank ended, and rank {note['rank']} reported: "
                              f"{note['reason']}")
                return
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
            if not getattr(e, "every_rank_knows", False):       # a refusal every member raised: nobody is lost
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
        if exc is not None and self._threads and self._halt.is_set() and self.failure is None \
                and exc is not self._diagnosed:      # halted by the store host's clean end: no verdict will come
            self._diagnosed = exc
            note = _ended_note(self._peers.values())
            if note:
                _write_stderr(f"{PREFIX}: rank {self.rank}: {type(exc).__name__} in {self._op_text()}{note}")
            return
        if not self.running or self.failure is not None or (exc is not None and exc is self._diagnosed):
            return
        if exc is not None:
            self._diagnosed = exc
            self._error = f"{type(exc).__name__}: {str(exc)[:300]}"
            self._error_op = self._op
            _write_stderr(f"{PREFIX}: rank {self.rank}: {self._op_text()} raised {self._error}; checking the "
                          f"other ranks for up to {self.timeout:.1f} s{self._peer_ops()}")
        self._verdict.wait(self.timeout + 2 * self.interval)
        note = _never_started_note(self._peers.values()) + _ended_note(self._peers.values()) \
            if exc is not None and self.failure is None else ""
        if note:                               # no verdict: say which ranks cannot be in this collective
            _write_stderr(f"{PREFIX}: rank {self.rank}: no lost rank found{note}")


    def _peer_ops(self) -> str:
        """What the watched ranks last said they were doing: ranks alive in other collectives than this one
        point at calls out of step (one rank saving while the others train on)."""
        ops = [f"rank {p.rank} in {_their_op(p.record)}" for p in sorted(self._peers.values(), key=lambda p: p.rank)
               if p.record and not p.record.get("stopped")]
        return f" (last heard: {', '.join(ops)})" if ops else ""


def _default_log():
    """This process's collective log (comm/collective_log.py), or None with ``AP_COLLECTIVE_LOG=off``."""
    from autoparallel.comm import collective_log

    return collective_log.LOG if collective_log.enabled() else None


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
    """True when ``AP_WATCHDOG`` opts out of the default watchdog (``0``, ``off``, ``false`` or ``no``); any other
    value but ``on`` / ``1`` / ``true`` / ``yes`` is a ValueError naming the variable (a misspelt ``off``)."""
    from autoparallel.switch import env_on

    return not env_on("AP_WATCHDOG", True)


def start_default():
    """The watchdog of a real multi-process job, started with the default settings if none runs yet.

    Called by ``ap.init_parallel_env``, ``ap.shard_layer``, ``ap.parallelize``, the training examples and the
    checkpoint rendezvous, so a lost, frozen or mismatched rank is named on the default path. Does nothing
    (returns None) in one process, in the simulated world, before ``init_parallel_env``, or with
    ``AP_WATCHDOG=off``."""
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
