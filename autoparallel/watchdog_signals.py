"""The watchdog's process hooks: SIGTERM, the exception hook and exit, installed while it runs."""
from __future__ import annotations

import signal
import sys
import threading
import time

from autoparallel.watchdog_messages import (_bounded, _ended_note, _exited_reason, _never_started_note,
                                            _write_stderr)
from autoparallel.watchdog_settings import PREFIX
from autoparallel.watchdog_store import process_state


class SignalsMixin:
    """The process-hook side of ``Watchdog``."""

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
                            f"{self.term_grace:g} s) while in {self._op_text()}"
                            f"{_never_started_note(self._peers.values())}{_ended_note(self._peers.values())}")
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
