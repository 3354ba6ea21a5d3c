"""A rank that ends its program early and cleanly (a ``break`` or a shorter loop on some ranks, ``sys.exit(0)``
mid-training) left its peers in a collective nobody could join: they waited for gloo's own error (a bare
"TIMEOUT self_rank = 0 pair_rank = 1", or the 30 s timeout) and the watchdog, which had seen a clean stop, named
nobody. A process's exit now publishes its final collective log with its stop record, and a peer that has made more
collectives on a group they share is ended (exit code 75) naming the rank that ended, its count and last call, and
this rank's collective that can never be joined. In process (threads, a MemoryStore) and on 2 real gloo ranks
(dist_scripts/hangs8_early_end.py, one launch per case, bounded by the watchdog and a launch timeout)."""
import os
import re
import threading
import time

import pytest

from autoparallel.comm.collective_log import Log
from autoparallel.testing.launch import run_job
from autoparallel.watchdog import MemoryStore, Watchdog

HERE = os.path.join(os.path.dirname(__file__), "dist_scripts")
DP, OTHER = (0, 1), (1, 2)


def step(log, group=DP):
    log.note("all_reduce", group, ([4, 8], "float32"))        # one gradient bucket per training step


class Exits(dict):
    def __init__(self):
        super().__init__()
        self.messages = {}
        self.event = threading.Event()

    def exit_fn(self, rank):
        def fn(code):
            self.setdefault(rank, code)
            self.event.set()
        return fn


def _watchdogs(logs, exits):
    store = MemoryStore()
    return [Watchdog(timeout=3, interval=0.1, store=store, rank=r, world_size=len(logs), collective_log=log,
                     install_handlers=False, exit_fn=exits.exit_fn(r), namespace="hangs8",
                     on_failure=lambda m, r=r: exits.messages.setdefault(r, m)).start()
            for r, log in enumerate(logs)]


def _run(after_end, at_exit=True):
    """Ranks 0..2 each make 3 training collectives; rank 0 then ends (its process's exit, or a plain ``stop()``),
    and ``after_end(logs)`` runs on the others. Returns (exits, watchdogs)."""
    logs, exits = [Log(), Log(), Log()], Exits()
    dogs = _watchdogs(logs, exits)
    for _ in range(3):
        for r in (0, 1):
            step(logs[r])
    time.sleep(3 * dogs[0].interval)                             # the counts are published
    (dogs[0]._stop_at_exit if at_exit else dogs[0].stop)()
    time.sleep(3 * dogs[0].interval)                             # ... and the stop record read
    after_end(logs)
    exits.event.wait(2.0)
    time.sleep(3 * dogs[0].interval)
    for wd in dogs[1:]:
        wd.stop()
    return exits, dogs


def test_a_rank_left_in_a_collective_after_a_peer_exited_is_ended_naming_it():
    exits, dogs = _run(lambda logs: step(logs[1]))               # rank 1's 4th step: nobody joins it
    assert exits == {1: 75, 2: 75}, exits                        # rank 2 follows rank 1's abort note
    assert "exiting because rank 1 reported: rank 0 ended its process" in dogs[2].failure, dogs[2].failure
    msg = dogs[1].failure
    assert "rank 0 ended its process cleanly (its script returned or called sys.exit) after 3 collectives on " \
           "group [0,1]" in msg, msg
    assert "this rank has made 4: its collective #4 on that group (all_reduce@test_probe_hangs8.py:" in msg, msg
    assert "(128 bytes)) can never be joined" in msg and "a `break` or a loop of another length" in msg, msg
    assert "Exiting with code 75" in msg


@pytest.mark.parametrize("case", ["same count", "another group", "a stop that is not the exit"])
def test_no_verdict_without_a_collective_the_ended_rank_never_made(case):
    """Negative controls: rank 1 makes no more collectives with rank 0; it makes some on a group without rank 0;
    rank 0 stopped its watchdog (``stop()``) but its process goes on, so its count is no final one."""
    after = {"same count": lambda logs: None, "another group": lambda logs: [step(logs[r], OTHER) for r in (1, 2)],
             "a stop that is not the exit": lambda logs: step(logs[1])}[case]
    exits, dogs = _run(after, at_exit=case != "a stop that is not the exit")
    assert exits == {} and all(wd.failure is None for wd in dogs), exits.messages


# ---- real ranks ---------------------------------------------------------------------------------------------------
WORKER = os.path.join(HERE, "hangs8_early_end.py")
TIMEOUT = 3.0                                                    # AP_WATCHDOG_TIMEOUT of these jobs
_jobs: dict = {}


def _job(mode, log="on"):
    if (mode, log) not in _jobs:
        for _ in range(3):                                       # a gloo start-up flake: start again
            job = run_job(WORKER, 2, [mode], timeout=120, env={"AP_WATCHDOG_TIMEOUT": str(TIMEOUT),
                                                               "AP_COLLECTIVE_LOG": log})
            if not job.startup_flake or "step 0" in job.tails:
                break
        _jobs[mode, log] = job
    return _jobs[mode, log]


def _logs(job):
    parts = re.split(r"^--- workerlog\.(\d) ---$", job.tails, flags=re.M)
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _forward_line():
    with open(WORKER) as f:
        return next(n for n, line in enumerate(f, 1) if "loss = F.cross_entropy" in line)


@pytest.mark.parametrize("mode, ended, left", [("break0", 0, 1), ("exit1", 1, 0)])
def test_real_ranks_a_rank_that_ended_early_is_named_by_the_one_left_waiting(mode, ended, left):
    job = _job(mode)
    assert job.stopped is None and any(job.codes), job.failure()       # ended by itself, as a failure
    logs = _logs(job)
    assert "step 1 loss" in logs[ended] and "step 2 loss" not in logs[ended], logs[ended][-2000:]
    text = logs[left]
    assert f"autoparallel watchdog: rank {left}: rank {ended} ended its process cleanly (its script returned or " \
           f"called sys.exit) after " in text, text[-3000:]
    m = re.search(r"after (\d+) collectives on group \[0,1\] \(its last: all_reduce@.*?\), and this rank has made "
                  r"(\d+): its collective #(\d+) on that group \(all_reduce@hangs8_early_end\.py:(\d+)", text)
    assert m, text[-3000:]
    assert int(m.group(2)) == int(m.group(3)) == int(m.group(1)) + 1, m.group(0)
    assert int(m.group(4)) == _forward_line(), m.group(0)            # the loss of step 2: nobody joins it
    assert "Exiting with code 75" in text
    if ended == 0:                                       # the rank that ended says why the job failed, too
        assert "rank 0: this rank ended, and rank 1 reported: rank 0 ended its process" in logs[0], logs[0][-2000:]


# ---- a rank that failed before it started a watchdog ----------------------------------------------------------------
def _alone(**kw):
    """Rank 0 of 2 with its watchdog running; rank 1 never starts one (it raised while building its model, before
    its first autoparallel call, in a script that initialised with paddle's own ``init_parallel_env``)."""
    exits = Exits()
    wd = Watchdog(timeout=1, interval=0.1, store=MemoryStore(), rank=0, world_size=2, collective_log=Log(),
                  install_handlers=False, exit_fn=exits.exit_fn(0), namespace="hangs8_alone", **kw).start()
    return wd, exits


def test_a_collective_error_with_a_peer_that_never_started_names_it(capfd):
    """gloo's bare error after the peer's process ended ("TIMEOUT self_rank = 0 pair_rank = 1") found no lost rank
    and said nothing more; the rank that never started a watchdog is named as where the cause is."""
    wd, exits = _alone()
    try:
        wd.diagnose(RuntimeError("[pair.cc:584] TIMEOUT self_rank = 0 pair_rank = 1"))
    finally:
        wd.stop()
    err = capfd.readouterr().err
    assert "rank 0: no lost rank found; rank 1 never started a watchdog: it ended or stalled before the first " \
           "autoparallel call that starts one" in err, err
    assert exits == {}


def test_sigterm_with_a_peer_that_never_started_names_it():
    """The launcher tears the job down after that rank exited non-zero: the SIGTERM report names it too."""
    wd, exits = _alone(term_grace=0.2)
    try:
        wd._sigterm_at = time.monotonic()                        # what the SIGTERM handler records
        exits.event.wait(3.0)
    finally:
        wd.stop()
    assert exits == {0: 143}, exits
    assert "terminated by SIGTERM" in wd.failure and "rank 1 never started a watchdog" in wd.failure, wd.failure


def test_without_the_collective_log_a_failed_collective_names_the_rank_that_ended(monkeypatch, capfd):
    """With ``AP_COLLECTIVE_LOG=off`` (or a collective the log does not see: pipeline send/recv, the checkpoint
    layer's exchanges) there is no count to compare: the error of the collective left waiting (gloo's bare
    "TIMEOUT ... pair_rank = 0") is followed by a note naming the rank that ended and what it was last doing."""
    monkeypatch.setenv("AP_COLLECTIVE_LOG", "off")
    exits = Exits()
    store = MemoryStore()
    dogs = [Watchdog(timeout=1, interval=0.1, store=store, rank=r, world_size=2, install_handlers=False,
                     exit_fn=exits.exit_fn(r), namespace="hangs8_nolog").start() for r in (0, 1)]
    try:
        assert dogs[0]._clog is None
        with dogs[0].op("all_reduce", step=2):
            pass
        dogs[0].set_current_op("train step", step=2)
        time.sleep(3 * dogs[0].interval)
        dogs[0]._stop_at_exit()                                  # rank 0 left its loop and its script returned
        time.sleep(3 * dogs[0].interval)
        dogs[1].diagnose(RuntimeError("[pair.cc:584] TIMEOUT self_rank = 1 pair_rank = 0"))
    finally:
        dogs[1].stop()
    err = capfd.readouterr().err
    assert "rank 1: no lost rank found; rank 0 (last in 'train step' (step 2)) ended its process cleanly " \
           "(the script returned or called sys.exit): a collective that needs it can never be joined" in err, err
    assert exits == {}


def test_real_ranks_without_the_collective_log_the_rank_that_ended_is_named():
    job = _job("break0", log="off")
    assert job.stopped is None and any(job.codes), job.failure()
    text = _logs(job)[1]
    assert "TIMEOUT self_rank = 1 pair_rank = 0" in text or "Connection" in text, text[-3000:]
    assert "autoparallel watchdog: rank 1: " in text and "rank 0 (last in " in text, text[-3000:]
    assert "ended its process cleanly (the script returned or called sys.exit): a collective that needs it can " \
           "never be joined" in text, text[-3000:]
