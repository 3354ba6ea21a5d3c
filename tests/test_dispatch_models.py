"""Unmodified PaddleFormers causal LMs through dispatch in the simulated 4-rank world (2x2 ["data",
"model"] mesh): plain data parallel and the seed shard function equal one process (loss and every
gradient). A lean subset of the families (each exercises a different part of paddle's call syntax);
the full model x mode matrix runs with the PaddleFormers test module."""
import pytest

import autoparallel as ap
from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="PaddleFormers not installed (the models extra)")

CASES = [
    ("llama", "tp"),          # torch-style transpose(1, 2), paddle.cat, varargs reshape
    ("qwen2", "dp"),          # fused qkv, paddle.reshape_ (in place)
    ("gemma3", "tp"),         # x.float() on activations and parameters
    ("qwen2_moe", "dp"),      # topk, one_hot().permute, one-arg where, index_add_ into a plain buffer
    ("qwen2_moe", "tp"),
    ("gpt_oss", "tp"),        # batched expert weights, its own routing
]


@pytest.fixture(scope="module")
def references():
    return {}


@pytest.mark.parametrize("name,mode", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_model_equals_one_process(references, name, mode):
    if name not in references:
        references[name] = pf.reference(name)
    with ap.simulate(world_size=4):
        got = pf.sharded(name, mode)
    assert pf.compare(references[name], got) == []


def test_negative_control_skipping_the_gradient_reduction_is_detected(references):
    if "llama" not in references:
        references["llama"] = pf.reference("llama")
    with ap.simulate(world_size=4):
        got = pf.sharded("llama", "dp", reduce_grads=False)
    bad = pf.compare(references["llama"], got)
    assert "loss" not in bad and len(bad) > 5
