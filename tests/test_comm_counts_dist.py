"""4 real gloo ranks (dp=2, tp=2 under ap.parallelize): collectives per decoder layer on the tensor-parallel
groups equal Megatron's on PaddleFormers' Llama and the project's GPT and LLaMA -- TP: 2 all_reduces forward
and 2 backward, no all_gather; TP+SP: 2 all_gathers + 2 reduce_scatters each way -- with the loss and every
gradient equal to one process; with the shared reduction disabled backward reduces once per consumer. Phi3's
fused projections (block-sharded) add nothing: its counts equal Llama's, outside the layers too."""
import os

import pytest

from autoparallel.testing import paddleformers_models as pf
from dist_scripts import shared_launch

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")
HERE = os.path.dirname(__file__)
JOB = shared_launch.job(__name__, "comm_counts", os.path.join(HERE, "dist_scripts", "comm_counts_worker.py"), 4,
                        timeout=600) if pf.available() else None
MODELS = ["pf-llama", "gpt", "llama", "pf-phi3"]
TP = {"all_reduce": 2}
SP = {"all_gather": 2, "reduce_scatter": 2}


@pytest.fixture(scope="module")
def results():
    _, res = shared_launch.results(JOB)
    return {c["case"]: [r[i] for r in res] for i, c in enumerate(res[0])}


@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_layer_is_two_all_reduces_each_way(results, name):
    for r in results[f"{name} tp"]:
        assert r["per_layer"]["fwd"]["logical"] == TP, r["per_layer"]
        assert r["per_layer"]["bwd"]["logical"] == TP, r["per_layer"]
        assert r["per_layer"]["fwd"]["paddle"] == TP and r["per_layer"]["bwd"]["paddle"] == TP
        assert r["bad"] == []


@pytest.mark.parametrize("name", MODELS)
def test_sequence_parallel_layer_is_two_gathers_and_two_reduce_scatters_each_way(results, name):
    for r in results[f"{name} sp"]:
        assert r["per_layer"]["fwd"]["logical"] == SP, r["per_layer"]
        assert r["per_layer"]["bwd"]["logical"] == SP, r["per_layer"]
        # gloo has no reduce_scatter: paddle sees it as an all_reduce
        assert r["per_layer"]["bwd"]["paddle"] == {"all_gather": 2, "all_reduce": 2}
        assert r["bad"] == []


def test_paddleformers_llama_outside_the_layers(results):
    """Embedding (vocab-parallel: one reduction), LM head input (one gradient reduction / gather) and the
    vocab-parallel cross entropy (3 all_reduces) on a 1-layer model."""
    for r in results["pf-llama tp"]:
        assert r["one_layer"]["fwd"]["logical"] == {"all_reduce": 2 + 1 + 3}
        assert r["one_layer"]["bwd"]["logical"] == {"all_reduce": 2 + 1}
    for r in results["pf-llama sp"]:
        assert r["one_layer"]["fwd"]["logical"] == {"all_gather": 2 + 1, "reduce_scatter": 2 + 1, "all_reduce": 3}
        # + the one bucket of the norm weights' gradients (partial over the sequence shards), launched by the
        # first backward's hooks
        assert r["one_layer"]["bwd"]["logical"] == {"all_gather": 2 + 1, "reduce_scatter": 2 + 1, "all_reduce": 1}


def test_fused_projections_add_nothing_on_real_ranks(results):
    for mode in ("tp", "sp"):
        for phi3, llama in zip(results[f"pf-phi3 {mode}"], results[f"pf-llama {mode}"]):
            assert phi3["one_layer"] == llama["one_layer"], (mode, phi3["one_layer"], llama["one_layer"])
            assert phi3["per_layer"] == llama["per_layer"]


def test_negative_control_per_use_reduction_is_one_per_consumer(results):
    """q, k, v and gate, up each reduce their own partial input gradient: 5 per layer, still correct."""
    for r in results["per-use reduction"]:
        assert r["bwd"] == {"all_reduce": 5}
        assert r["bad"] == []
