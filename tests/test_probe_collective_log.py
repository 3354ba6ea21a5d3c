"""The default-on collective log (comm/collective_log.py): records compared off the hot path, in process."""
import threading
import time

import pytest

from autoparallel.comm import collective_log
from autoparallel.comm.agreement import CollectiveMismatchError
from autoparallel.comm.collective_log import Log
from autoparallel.watchdog import MemoryStore, Watchdog

TP, WORLD = (0, 1), (0, 1, 2)


def train_step(log, ranks=TP):
    log.note("all_reduce", ranks, ([4, 8], "float32"))          # a row-parallel layer's reduction


def evaluate(log):
    log.note("all_reduce", TP, ([4, 8], "float32"))             # the same size, from another line


def steps(log, groups):
    for g in groups:
        train_step(log, g)


def each(logs, *calls):
    """``calls[r](logs[r])`` for each rank, from one line (a rank's call path is part of its record)."""
    for log, (fn, *args) in zip(logs, calls):
        fn(log, *args)


def test_equal_logs_agree_and_a_rank_only_collective_is_named():
    a, b = Log(), Log()
    for _ in range(3):
        each((a, b), (train_step,), (train_step,))
    assert a.compare(0, 1, b.summary()) is None and b.compare(1, 0, a.summary()) is None   # negative control
    each((a, b), (evaluate,), (train_step,))    # rank 0 only: pairs with rank 1's next training collective
    why = a.compare(0, 1, b.summary())
    assert why is not None and "group [0,1]" in why and "collective #4" in why
    line_eval, line_train = evaluate.__code__.co_firstlineno + 1, train_step.__code__.co_firstlineno + 1
    assert f"rank 0: all_reduce@test_probe_collective_log.py:{line_eval}" in why
    assert f"rank 1: all_reduce@test_probe_collective_log.py:{line_train}" in why
    assert "(128 bytes)" in why and "same collectives in the same order" in why
    assert b.compare(1, 0, a.summary()) is not None              # either rank's judge finds it


def test_sequence_numbers_are_per_group_so_interleaving_across_groups_is_fine():
    a, b = Log(), Log()
    each((a, b), (steps, (TP, WORLD)), (steps, (WORLD, TP)))   # another order across groups: still agreed
    assert a.compare(0, 1, b.summary()) is None and b.compare(1, 0, a.summary()) is None
    each((a, b), (steps, (WORLD, TP)), (evaluate,))             # rank 0: world #2, [0, 1] #2; rank 1: other #2
    why = a.compare(0, 1, b.summary())
    assert "group [0,1]" in why and "collective #2" in why


def test_a_peer_behind_or_ahead_is_compared_at_its_own_count():
    a, b = Log(), Log()
    for k in range(5):
        each((a, b), (train_step,), (train_step,) if k < 3 else (lambda log: None,))
    assert a.compare(0, 1, b.summary()) is None and b.compare(1, 0, a.summary()) is None
    each((a, b), (lambda log: None,), (evaluate,))              # b's #4 differs from a's #4
    assert a.compare(0, 1, b.summary()) is not None             # a is ahead: its digest history at #4
    assert b.compare(1, 0, a.summary()) is not None             # b is behind: a's recent records at #4


def test_payload_size_alone_tells_collectives_apart():
    a, b = Log(), Log()
    each((a, b), (Log.note, "all_gather", TP, ([4], "float32")), (Log.note, "all_gather", TP, ([8], "float32")))
    assert "16 bytes" in a.compare(0, 1, b.summary())


def _watchdogs(logs, exits):
    store = MemoryStore()
    return [Watchdog(timeout=3, interval=0.1, store=store, rank=r, world_size=len(logs), collective_log=log,
                     install_handlers=False, exit_fn=lambda code, r=r: exits.setdefault(r, code),
                     namespace="clog_test") for r, log in enumerate(logs)]


@pytest.mark.parametrize("mismatch", [False, True])
def test_the_judge_ends_every_rank_on_a_mismatch_and_only_then(mismatch, capsys):
    logs, exits = [Log(), Log()], {}
    dogs = [wd.start() for wd in _watchdogs(logs, exits)]

    def rank(r):                                                # a threaded rank: its training loop
        for step in range(6):
            (evaluate if mismatch and r == 0 and step == 2 else train_step)(logs[r])   # one line on both ranks
            time.sleep(0.02)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    while len(exits) < 2 * mismatch and time.monotonic() - start < 5:
        time.sleep(0.05)
    took = time.monotonic() - start
    if not mismatch:
        time.sleep(6 * dogs[0].interval)                        # several heartbeats judged after the last step
        assert all(p.clog_seen is not None for wd in dogs for p in wd._peers.values())
    for wd in dogs:
        wd.stop()
    pending, collective_log._pending[0] = collective_log._pending[0], None
    if not mismatch:
        assert exits == {} and pending is None
        return
    assert exits == {0: 75, 1: 75} and took < 3                 # within a few heartbeats (0.1 s here)
    text = " ".join(wd.failure for wd in dogs)
    assert text.count("CollectiveMismatchError") >= 2 and "collective #3 on this group" in text
    assert isinstance(pending, CollectiveMismatchError)
    with pytest.raises(CollectiveMismatchError, match="same collectives in the same order"):
        collective_log.set_pending(pending)
        collective_log.raise_pending()                          # what the next collective of a rank raises


def _save_entries(logs):
    """Each rank's ``check_save_entry`` on its own thread, with a fake all_gather between them."""
    barrier, words, errors = threading.Barrier(len(logs)), {}, {}

    def gather_for(r):
        def gather(w):
            words[r] = w
            barrier.wait(5)
            return [words[q] for q in range(len(logs))]
        return gather

    def run(r):
        try:
            collective_log.check_save_entry(r, len(logs), logs[r], gather_for(r))
        except CollectiveMismatchError as e:
            errors[r] = str(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(logs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_a_save_entry_refuses_on_every_rank_after_an_undetected_mismatch():
    logs = [Log(), Log(), Log()]
    each(logs, (train_step, WORLD), (train_step, WORLD), (train_step, WORLD))
    each(logs, (train_step,), (train_step,))                    # rank 2 is not in [0, 1]
    assert _save_entries(logs) == {}                            # negative control: equal logs save
    each(logs, (evaluate,), (train_step,))                      # paired silently: same count, other calls
    errors = _save_entries(logs)
    assert sorted(errors) == [0, 1, 2] and all("group [0,1]" in e and "different calls" in e
                                               for e in errors.values())
    assert "refusing to save a checkpoint" in errors[2]


def test_the_switch_and_the_ring_bound():
    import os

    old = os.environ.get("AP_COLLECTIVE_LOG")
    try:
        for value, on in (("", True), ("off", False), ("0", False), ("on", True)):
            os.environ["AP_COLLECTIVE_LOG"] = value
            assert collective_log.enabled() is on
        os.environ["AP_COLLECTIVE_LOG"] = "maybe"
        with pytest.raises(ValueError, match="AP_COLLECTIVE_LOG must be 'on' or 'off', got 'maybe'"):
            collective_log.enabled()
    finally:
        os.environ.pop("AP_COLLECTIVE_LOG") if old is None else os.environ.__setitem__("AP_COLLECTIVE_LOG", old)
    log = Log()
    for _ in range(collective_log.RING + 5):
        log.note("broadcast", TP)
    log.drain()
    assert log.lost == 5 and log._groups[(0, 1)].count == collective_log.RING + 5
    published = log.summary()
    assert published["groups"]["0,1"]["d"] == -1                # a gap: the digest is not compared, the records are
    assert len(published["texts"]) == 1 and len(published["groups"]["0,1"]["r"]) == collective_log.RECENT
    with pytest.raises(TypeError, match="collective_log must have summary"):
        Watchdog(rank=0, world_size=1, store=MemoryStore(), collective_log=object())


def test_code_generated_by_paddles_translator_is_not_a_user_frame():
    """paddle's to_static writes a converted function to a temp file of a random name per process
    (~/.cache/paddle/to_static_tmp/<pid>/backwardab12cd.py): two ranks running the same static step would differ
    by it. Those frames are left out; a user's own file stays (negative control)."""
    import os

    log = Log()
    generated = os.path.join(os.path.expanduser("~/.cache"), "paddle", "to_static_tmp", "4242", "backwardn4cs.py")
    assert not log._is_user(generated)
    assert log._is_user(os.path.join(os.path.expanduser("~"), "project", "train.py"))


def test_a_group_and_its_reversed_order_are_two_groups_at_the_save_entry():
    """``[1, 0]`` is another communicator than ``[0, 1]``, with counts of its own: equal logs with both save
    (one bit mask for both made a rank disagree with itself); a real difference on the reversed one is still named."""
    logs = [Log(), Log()]
    each(logs, (steps, [(0, 1)] * 5), (steps, [(0, 1)] * 5))
    each(logs, (steps, [(1, 0)] * 2), (steps, [(1, 0)] * 2))
    assert _save_entries(logs) == {}
    each(logs, (steps, [(1, 0)]), (steps, []))                  # negative control: rank 0 one more on [1, 0]
    errors = _save_entries(logs)
    assert sorted(errors) == [0, 1] and all("group [1,0]" in e for e in errors.values())
