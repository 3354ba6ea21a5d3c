"""Checkpoint saves and resumes whose ranks' states differ (2 real gloo ranks, one shared launch;
dist_scripts/ckpt_probe_worker.py), and the agreement rule in process: ranks that share a mesh must reduce
the same Partial entries in the same order, or every rank raises before any reduction (gloo pairs collectives
by order: a swap with equal shapes used to save each entry with the other's terms)."""
import os

import numpy as np
import pytest

from autoparallel.checkpoint.save_agree import first_difference
from ckpt_peers import fake_peer
from dist_scripts import shared_launch

WORKER = os.path.join(os.path.dirname(__file__), "dist_scripts", "ckpt_probe_worker.py")
JOB = shared_launch.job(__name__, "ckpt_probe", WORKER, 2, args=lambda out: [os.path.join(out, "root")], timeout=200)


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


def test_agreeing_ranks_save_the_reduced_values(ranks):
    for r in ranks:
        assert r["agree"] == "ok"
        assert r["agree_values"] == {"a": [3.0] * 4, "b": [30.0] * 4, "loader": {"epoch": 2}}   # 1 + 2, 10 + 20


@pytest.mark.parametrize("case", ["swapped", "partial_missing"])
def test_partial_entries_that_differ_fail_on_every_rank_at_once(ranks, case):
    for r in ranks:
        assert r[case].startswith("CheckpointSaveError") and "the ranks' states differ, nothing was written" in \
            r[case] and "rank 0 reduces 'a' [4] float32 on ranks [0, 1] where rank 1 reduces 'b'" in r[case], r[case]
        assert r[case + "_s"] < 10, "refused before any gloo timeout"


def test_a_sharded_entry_one_rank_lacks_is_not_committed(ranks):
    assert "the ranks' shards do not make a complete checkpoint" in ranks[0]["sharded_missing"]
    assert ranks[1]["sharded_missing"].startswith("CheckpointSaveError: ") and "rank 0 could not commit" in \
        ranks[1]["sharded_missing"]
    for r in ranks:
        assert r["entries"] == ["agree"], "a refused save leaves nothing behind"


def test_a_bad_argument_on_one_rank_is_raised_on_every_rank_at_once(ranks):
    assert ranks[1]["bad_value_on_rank_1"].startswith("TypeError: state entry 'note': a object is neither")
    assert ranks[0]["bad_value_on_rank_1"].startswith("TypeError: (rank 1) state entry 'note': a object is")
    assert all(r["bad_value_on_rank_1_s"] < 10 for r in ranks)


def test_a_rank_failing_after_the_exchange_fails_the_save_everywhere(ranks):
    assert ranks[1]["fails_after_exchange_on_rank_1"] == "RuntimeError: injected failure while collecting on rank 1"
    assert ranks[0]["fails_after_exchange_on_rank_1"].startswith("CheckpointSaveError") and \
        "writing failed on rank 1: RuntimeError: injected failure" in ranks[0]["fails_after_exchange_on_rank_1"]
    assert all(r["fails_after_exchange_on_rank_1_s"] < 10 for r in ranks)


def test_a_value_that_differs_between_ranks_is_not_committed(ranks):
    assert ranks[0]["value_differs"].startswith("CheckpointSaveError") and \
        "ranks disagree on the value 'loader/index': 0 and 64 (rank 1)" in ranks[0]["value_differs"]
    assert "rank 0 could not commit" in ranks[1]["value_differs"]


def test_a_resume_failing_on_one_rank_fails_on_every_rank(ranks):
    r0, r1 = ranks[0]["resume_one_rank_fails"], ranks[1]["resume_one_rank_fails"]
    assert r1.startswith("CheckpointMismatchError") and "missing from the checkpoint: ['extra']" in r1, r1
    assert r0.startswith("CheckpointMismatchError: (rank 1) checkpoint") and "['extra']" in r0, r0


def test_ranks_resuming_from_different_checkpoints_fail_before_loading(ranks):
    for r in ranks:
        got = r["resume_different_roots"]
        assert got.startswith("CheckpointError") and "would resume from different checkpoints" in got, got
        assert "own0/step-00000001" in got and "own1/step-00000002" in got, got


def _e(name, pids=(0, 1)):
    return [name, [4], "float32", list(pids)]


def test_the_agreement_rule_compares_only_the_meshes_two_ranks_share():
    assert first_difference([[_e("a"), _e("b")], [_e("a"), _e("b")]]) is None
    # two pipeline stages: each pair reduces its own entries, which the other stage never joins
    stages = [[_e("s0", (0, 1))], [_e("s0", (0, 1))], [_e("s1", (2, 3))], [_e("s1", (2, 3))]]
    assert first_difference(stages) is None
    assert "rank 0 reduces 'a'" in first_difference([[_e("a"), _e("b")], [_e("b"), _e("a")]])
    assert "rank 1 reduces nothing" in first_difference([[_e("a")], []])
    three = [_e("s0", (0, 1, 2))]
    assert first_difference([three, three, three, []]) is None               # rank 3 is not on that mesh
    assert first_difference([three, three, [], []]) == (
        "rank 0 reduces 's0' [4] float32 on ranks [0, 1, 2] where rank 2 reduces nothing (reduction 0 of the "
        "Partial entries on their shared meshes)")


@pytest.mark.parametrize("garbage", ["size", "bytes"])
def test_a_peer_in_another_collective_is_a_typed_error_not_an_allocation(monkeypatch, garbage):
    import paddle

    from autoparallel.checkpoint.errors import CheckpointSaveError
    from autoparallel.checkpoint.save_agree import agree

    def answer(t, call):
        if call == 1:
            return paddle.to_tensor([2 ** 62 if garbage == "size" else int(t.numpy()[0])], dtype="int64")
        return paddle.to_tensor(np.full(t.shape, 0xFF, dtype=np.uint8))
    fake_peer(monkeypatch, answer)
    with pytest.raises(CheckpointSaveError, match="the ranks did not start the save together"):
        agree({}, "0123456789ab", "/ckpt")


def test_negative_control_an_agreeing_peer_gets_rank_0s_token(monkeypatch):
    from autoparallel.checkpoint.save_agree import agree

    fake_peer(monkeypatch, lambda t, call: t)
    assert agree({}, "0123456789ab", "/ckpt") == "0123456789ab"


def test_a_rank_whose_collective_fails_says_what_the_live_ranks_are_doing(tmp_path, capfd):
    """One rank saving while the other trains on: gloo's timeout ends the save's exchange; the watchdog's line
    names what the other rank, alive, was doing (calls out of step, not a lost rank)."""
    import time

    from autoparallel.watchdog import FileStore, Watchdog

    def wd(rank):
        return Watchdog(rank=rank, world_size=2, store=FileStore(str(tmp_path)), timeout=1.0,
                        exit_fn=lambda code: None, on_failure=lambda msg: None, install_handlers=False).start()
    w0, w1 = wd(0), wd(1)
    try:
        w1.set_current_op("all_reduce", step=3)
        time.sleep(4 * w0.interval)                       # rank 0 has heard rank 1's heartbeat
        with pytest.raises(RuntimeError, match="TIMEOUT"):
            with w0.op("checkpoint start (all_gather)"):
                raise RuntimeError("[gloo] TIMEOUT self_rank = 0 pair_rank = 1")
    finally:
        w1.stop()
        w0.stop()
    err = capfd.readouterr().err
    assert "rank 0: 'checkpoint start (all_gather)'" in err and "(last heard: rank 1 in 'all_reduce' (step 3))" \
        in err, err


def test_zero2_state_dict_through_paddle_checkpoint_loads_into_zero3_and_one_process(ranks):
    """dist_scripts/zero_sd_checks.py: ZeRO-2's opt.state_dict() (Shard(0) over dp; fc1's [5, 8] gathered since its
    chunks end inside rows) saved by paddle.distributed.save_state_dict loads in place into ZeRO-3 (the two steps
    after it equal ZeRO-2's own) and into one process's state dict."""
    for r in ranks:
        assert r["zero_sd_layouts"]["linear_0.w_0_moment1_0"] == ["S(0)"], r["zero_sd_layouts"]
        assert r["zero_sd_into_zero3"] == 0.0 and r["zero_sd_into_one"] == 0.0, r
        np.testing.assert_allclose(r["zero_sd_zero3_losses"], r["zero_sd_want_losses"], rtol=1e-6)
