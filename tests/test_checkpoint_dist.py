"""Checkpoints on 4 real gloo ranks: every rank writes its own shards (at different speeds), rank 0 commits
after the file rendezvous, the job loads back under other layouts; here the same checkpoint is loaded in
one process and in a simulated 2-rank layout, compared with the full tensors. The checks run at the start
of the "kill" watchdog job (dist_scripts/watchdog_jobs.py), under its running watchdog."""
import os

import numpy as np
import pytest

import autoparallel as ap
from autoparallel.checkpoint import load_merged_state_dict, load_state_dict, verify_checkpoint
from dist_scripts import watchdog_jobs
from dist_scripts.ckpt_common import SHAPES, TP2, build_state, check_state, full_tensors


@pytest.fixture(scope="module")
def job():
    j = watchdog_jobs.job("kill")
    results = []
    for r in range(4):
        found = [e["result"] for e in j["events"][r] if e["kind"] == "checkpoint"]
        assert found, f"rank {r} did not finish the checkpoint checks:\n{j['logs'][r][-2000:]}"
        results.append(found[0])
    return j["ckpt_root"], results


def test_every_rank_loads_its_shards_in_the_job(job):
    _, results = job
    for r, res in enumerate(results):
        assert "error" not in res, res.get("error")
        assert res["dp4_bad"] == [] and res["tp2_bad"] == [] and res["dp4_step"] == 10
        assert res["dp4_held"] == [r] * len(SHAPES)
        assert res["tp2_held"] == ([r] if r < 2 else [])         # ranks 2 and 3 hold nothing under TP2


def test_the_committed_checkpoint_has_one_file_per_writing_rank(job):
    root, results = job
    path = results[0]["path"]
    assert all(res["path"] == path for res in results)
    # rank 3 wrote last (0.4 s per rank), yet every rank returned only after the commit
    assert results[1]["files_after_save"] == [".autoparallel-checkpoint"] + [f"data-r0000{r}.bin" for r in range(4)] \
        + ["metadata.json"]
    assert sorted(os.listdir(root)) == [".autoparallel-run", "latest", "step-00000010"]
    verify_checkpoint(path)


def test_the_real_checkpoint_loads_in_one_process_and_in_another_layout(job):
    root, _ = job
    full = full_tensors()
    merged = load_merged_state_dict(root)
    for name in SHAPES:
        np.testing.assert_array_equal(merged["model"][name], full[name])
    assert merged["loader"] == {"epoch": 2, "index": 640}
    with ap.simulate(world_size=2):
        target = build_state(ap.ProcessMesh([0, 1], ["tp"]), TP2)
        info = load_state_dict(target, root)
        assert check_state(target, full) == []
    assert info.extra == {"loader": {"epoch": 1, "index": 320}}


def test_monitor_timings_are_gathered_from_every_rank(job):
    _, results = job
    for res in results:
        gathered = res["gathered"]
        assert sorted(gathered) == ["0", "1", "2", "3"]
        steps = [gathered[str(r)]["step"] for r in range(4)]
        assert steps == pytest.approx([0.05 * (r + 1) for r in range(4)])   # each rank's own clock
        assert res["imbalanced"] is True
