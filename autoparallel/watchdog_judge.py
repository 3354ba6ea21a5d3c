"""The watchdog's judgement: which peer is lost or frozen, and what failing a job does."""
from __future__ import annotations

import contextlib
import json
import time

from autoparallel.watchdog_messages import _bounded, _process_note, _their_op, _write_stderr
from autoparallel.watchdog_settings import LONG_WAIT_FACTOR, PREFIX
from autoparallel.watchdog_store import process_state


class JudgingMixin:
    """The judging side of ``Watchdog``: silence limits, the verdict, the exit."""

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
            if self._compare_log(peer):
                return
            if rec.get("stopped"):
                why = self._beyond(peer)
                if why:
                    self._fail(why)
                    return
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

    def _beyond(self, peer):
        """The reason to end this rank when ``peer``'s process ended cleanly and this rank has made collectives
        on a group with it that it never made (they can never be joined), else None."""
        rec = peer.record
        if self._clog is None or not rec.get("exiting") or rec.get("error") or rec.get("clog") is None:
            return None
        try:
            return self._clog.beyond(self.rank, peer.rank, rec["clog"])
        except Exception as e:             # a malformed record must not stop the judge: report, go on
            _write_stderr(f"{PREFIX}: rank {self.rank}: could not read rank {peer.rank}'s final collective log: "
                          f"{e!r}")
            return None

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

    def _compare_log(self, peer) -> bool:
        """Compare a peer's newly published collective log with this rank's; end the run on a disagreement."""
        clog = peer.record.get("clog")
        if self._clog is None or clog is None or peer.clog_seen == peer.record.get("seq"):
            return False
        peer.clog_seen = peer.record.get("seq")
        try:
            why = self._clog.compare(self.rank, peer.rank, clog)
        except Exception as e:                 # a malformed record must not stop the judge: report, go on
            _write_stderr(f"{PREFIX}: rank {self.rank}: could not compare rank {peer.rank}'s collective log: {e!r}")
            return False
        if why is None:
            return False
        self._fail(f"CollectiveMismatchError: {why}", mismatch=True)
        return True

    def _fail(self, reason: str, publish: bool = True, mismatch: bool = False) -> None:
        with self._lock:
            if self.failure is not None or self._halt.is_set():
                return
            message = (f"{PREFIX}: rank {self.rank}: {reason}. This rank was in {self._op_text()}. "
                       f"Exiting with code {self.exit_code}.")
            self.failure = message
        if mismatch:                           # raised as itself at this rank's next collective, if it makes one
            from autoparallel.comm import collective_log      # within the grace below

            collective_log.set_pending(collective_log.CollectiveMismatchError(message))
        if publish:           # the note, and this rank's own acknowledgement: the host of the store need not wait for it
            note = json.dumps({"rank": self.rank, "reason": reason, "mismatch": mismatch}).encode()
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
        if mismatch:                           # the main thread may raise the typed error meanwhile
            time.sleep(self.interval)
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
