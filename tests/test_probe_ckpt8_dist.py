"""Loading through paddle's own calls on 2 real gloo ranks (one shared launch; dist_scripts/ckpt8_worker.py):
``model.set_state_dict`` with one entry failing only when written loads nothing on any rank (it raised after the
plain and the earlier distributed entries were written); ``paddle.distributed.load_merged_state_dict`` of a nested
state has paddle's flat form; a save failing in rank 1's write keeps the earlier checkpoint (docs/checkpoints.md)."""
import os

import pytest

from dist_scripts import shared_launch

WORKER = os.path.join(os.path.dirname(__file__), "dist_scripts", "ckpt8_worker.py")
JOB = shared_launch.job(__name__, "ckpt8", WORKER, 2, args=lambda out: [os.path.join(out, "root")], timeout=200)


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


@pytest.mark.parametrize("case,err,msg", [
    ("shard_float64", "TypeError", "0.weight is float64; the distributed parameter is float32"),
    ("global_float64", "TypeError", "1.bias is float64; the distributed parameter is float32"),
    ("dist_wrong_shape", "ValueError", "1.weight is a distributed value of global shape [8, 6]"),
    ("dist_float16", "TypeError", "1.weight is float16; the distributed parameter is float32")])
def test_set_state_dict_failing_at_the_write_loads_nothing_on_any_rank(ranks, case, err, msg):
    for r in ranks:
        assert r[case].startswith(err + ": ") and msg in r[case] and "nothing was loaded" in r[case], r[case]
        assert r[case + "_changed"] == [], f"rank {r['rank']}: {r[case + '_changed']} written before the error"


def test_a_shard_shaped_value_still_sets_each_ranks_shard(ranks):
    for r in ranks:
        assert r["shard_float32"] == "ok" and r["shard_float32_value"] is True


def test_load_merged_state_dict_is_flat_with_tensors(ranks):
    for r in ranks:
        assert r["merged_call"] == "ok" and r["merged_prefix_call"] == "ok", r
        assert r["merged"] == {"model.fc.weight": ["Tensor", [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]],
                               "opt.m": ["Tensor", [1.0, 1.0, 1.0]]}
        assert r["merged_prefix"] == ["fc.weight"]


def test_a_save_failing_in_rank_1s_write_keeps_the_earlier_checkpoint(ranks):
    for r in ranks:
        assert r["failed_save"].startswith(("CheckpointSaveError", "OSError")) and \
            "No space left on device (injected on rank 1)" in r["failed_save"], r["failed_save"]
        assert r["failed_save_load"] == "ok" and r["failed_save_kept"] == [[1.0, 1.0]] * 4
        assert not [e for e in r["failed_save_entries"] if ".tmp-" in e], r["failed_save_entries"]
