"""The watchdog's heartbeat: publishing this rank's record to the store and reading its peers'."""
from __future__ import annotations

import json
import os
import time

from autoparallel.watchdog_messages import _exited_reason, _jsonable, _process_note, _their_op
from autoparallel.watchdog_store import process_state


class HeartbeatMixin:
    """The store side of ``Watchdog``: this rank's record out, the peers' records in."""

    def _key(self, what: str, rank: int) -> str:
        return f"{self._prefix}/{what}/{rank}"

    def _publish(self, stopped: bool = False, error: str = None) -> None:
        self._seq += 1
        op = self._error_op if stopped and error and self._error_op else self._op
        record = {"seq": self._seq, "op": op[0] if op else None, "step": _jsonable(self._step),
                  "long_wait": max(self._long_waits) if self._long_waits else 0, "pid": os.getpid(),
                  "host": self._host, "start": self._start_time, "stopped": stopped, "error": error,
                  "exiting": stopped and self._exiting}
        if self._clog is not None:          # the collectives made since the last beat (comm/collective_log.py)
            record["clog"] = self._clog.summary()
        self.store.set(self._key("rec", self.rank), json.dumps(record).encode())

    def _op_text(self) -> str:
        op = self._op
        if op is None:
            return "no operation"
        step = f" (step {self._step})" if self._step is not None else ""
        return f"'{op[0]}'{step} for {time.monotonic() - op[1]:.1f} s"

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
        self._fail(f"exiting because rank {note['rank']} reported: {note['reason']}", publish=False,
                   mismatch=note.get("mismatch", False))
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
            why = self._beyond(self._peers[host_rank])
            if why:                         # it ended before collectives this rank made on a group with it
                self._fail(why)
                return
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
