"""4 real gloo ranks: PaddleFormers Llama, Qwen2, Phi3 and DeepSeek-V3 (MLA, MoE routing) under ap.parallelize (dp=2, tp=2) train 5 AdamW
steps like one process (losses and final parameters), a split tie is caught, and Llama's forward runs
one all_reduce per row-parallel linear under the seed's shard function."""
import os

import pytest

from autoparallel.testing import paddleformers_models as pf
from dist_scripts import shared_launch

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")
HERE = os.path.dirname(__file__)
JOB = shared_launch.job(__name__, "paddleformers", os.path.join(HERE, "dist_scripts", "paddleformers_worker.py"), 4,
                        timeout=500) if pf.available() else None
LAYERS = 2


@pytest.fixture(scope="module")
def results():
    _, res = shared_launch.results(JOB)
    return {c["case"]: [r[i] for r in res] for i, c in enumerate(res[0])}


@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3", "deepseek_v3"])
def test_five_adamw_steps_equal_one_process(results, name):
    for r in results[f"train {name}"]:
        assert r["names"]
        assert r["loss_rel"] < 1e-4, (r["losses"], r["ref_losses"])
        assert r["bad_params"] == []                               # rtol 1e-4, atol 1e-5
        assert r["losses"][-1] < r["losses"][0]                  # it trained


def test_negative_control_split_tie_drifts(results):
    assert all(r["param_rel"] > 1e-3 for r in results["split tie"])


def test_seed_shard_function_forward_is_one_all_reduce_per_row_parallel_linear(results):
    for r in results["forward seed"]:
        assert r["decoder_calls"] == {"all_reduce": [2 * LAYERS, r["decoder_calls"]["all_reduce"][1]]}
        # the model's own loss adds one all_reduce: its token count over the batch-sharded data axis; and the
        # one-element loss is made readable on every rank alone where it is made (read_value.py): one more
        assert set(r["calls"]) == {"all_reduce"} and r["calls"]["all_reduce"][0] == 2 * LAYERS + 1 + 1, r["calls"]


def test_parallelize_forward_adds_only_the_vocab_embedding_and_loss(results):
    """parallelize shards the embedding and head on the vocab too: + 1 all_reduce for the embedding's
    partial lookup and 3 for the vocab-parallel cross entropy (max, sum of exponentials, target logit); the
    settled one-element loss (read_value.py) is the last one."""
    for r in results["forward parallelize"]:
        assert r["decoder_calls"]["all_reduce"][0] == 2 * LAYERS + 1 and set(r["decoder_calls"]) == {"all_reduce"}
        assert set(r["calls"]) == {"all_reduce"} and r["calls"]["all_reduce"][0] == 2 * LAYERS + 1 + 3 + 1 + 1, r["calls"]
