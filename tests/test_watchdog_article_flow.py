"""The watchdog on the article's path (``ap.init_parallel_env`` + ``ap.shard_layer``, no ``parallelize``), on 2
real gloo ranks: a gather made on rank 0 alone is named as a CollectiveMismatchError on both ranks, which exit with
code 75, well before gloo's 30 s TIMEOUT (the bare error both ranks raised before)."""
import os
import time

from autoparallel.testing.launch import run_job

WORKER = os.path.join(os.path.dirname(__file__), "dist_scripts", "gather_on_one_rank_worker.py")


def test_a_gather_on_one_rank_is_named_on_both_ranks():
    start = time.monotonic()
    job = run_job(WORKER, 2, timeout=120)
    wall = time.monotonic() - start
    assert job.stopped is None and job.codes[0] != 0, job.failure()
    tails = job.tails
    assert "CollectiveMismatchError: the ranks of group [0,1] did not make the same collective" in tails, tails[-3000:]
    assert "rank 0: all_gather@gather_on_one_rank_worker.py:15" in tails, tails[-3000:]
    assert "rank 1: all_reduce@gather_on_one_rank_worker.py:17" in tails, tails[-3000:]
    assert "Exiting with code 75" in tails
    assert wall < 30, wall                          # named before gloo's own timeout would have fired
