"""Export on 2 real gloo ranks (one shared-launch job, dist_scripts/export_worker.py): a tensor-parallel model's
``paddle.save`` / ``paddle.jit.save`` raise on both ranks instead of saving shards (or waiting in a gather);
``ap.full_state_dict`` / ``ap.full_model`` on both ranks then rank 0 saving give the one-process model; a data-
parallel model saved by rank 0 alone exports the one-process model; top_p sampling gives the same tokens on both
ranks as one process; a pipeline's evaluation of a last batch of 7 samples gives one process's loss."""
import os

import pytest

from autoparallel.testing import paddleformers_models as pf
from dist_scripts import shared_launch

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

HERE = os.path.join(os.path.dirname(__file__), "dist_scripts")
JOB = shared_launch.job(__name__, "export", os.path.join(HERE, "export_worker.py"), 2, args=lambda out: [out],
                        timeout=180)


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


def test_tensor_parallel_saves_refuse_shards_and_full_forms_export_one_process(ranks):
    for r in ranks:
        assert r["tp"]["save"] == r["tp"]["jit_save"] == "ShardedExportError"
        assert max(r["tp"]["diffs"]) < 1e-5, r["tp"]


def test_data_parallel_model_saved_by_rank0_alone_loads_as_one_process(ranks):
    for r in ranks:
        assert max(r["dp"]["diffs"]) < 1e-5, r["dp"]


def test_sampling_gives_every_rank_the_one_process_tokens(ranks):
    for r in ranks:
        assert r["generate"] == {"equal_one_process": True, "equal_ranks": True}


def test_pipeline_eval_of_a_partial_batch_equals_one_process(ranks):
    for r in ranks:
        assert r["pipeline"]["loss_diff"] < 1e-5, r["pipeline"]
