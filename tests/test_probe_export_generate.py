"""``generate()`` on a parallelized PaddleFormers causal LM, against one process: a batch of prompts with left
padding and an attention mask, ``use_cache=True``, ``max_new_tokens``; greedy search and sampling (``top_k``,
``top_p`` with a temperature) from a fixed seed, under TP 2 and DP 2 x TP 2. Sampling failed on distributed
logits: ``paddle.topk`` took its ``k`` (a tensor) as an operand, and ``paddle.multinomial`` had no rule; the draw is
one draw from the global probabilities (as one process makes it). A plain copy (``ap.full_model``) of a TP model
with tied embeddings generates the same tokens."""
import numpy as np
import pytest

from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

import paddle  # noqa: E402

import autoparallel as ap  # noqa: E402

LENGTHS = [6, 4, 2, 5]


def prompts():
    ids = np.random.default_rng(3).integers(3, 60, (len(LENGTHS), 6)).astype("int64")
    mask = np.ones_like(ids)
    for i, n in enumerate(LENGTHS):          # left padding
        ids[i, :6 - n], mask[i, :6 - n] = 0, 0
    return paddle.to_tensor(ids), paddle.to_tensor(mask)


FORMS = {"greedy": dict(decode_strategy="greedy_search"),
         "top_k": dict(decode_strategy="sampling", top_k=5),
         "top_p": dict(decode_strategy="sampling", top_p=0.8, temperature=0.7)}


def generate(model, form, seed=7):
    ids, mask = prompts()
    paddle.seed(seed)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, use_cache=True, **FORMS[form])
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.full().numpy() if hasattr(out, "full") else out.numpy()


def strategy(dp, tp):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    return s


def test_generate_greedy_and_sampling_under_tp_and_dp_tp_equal_one_process():
    ref = pf.build("llama", 0)
    ref.eval()
    want = {f: generate(ref, f) for f in FORMS}
    assert not np.array_equal(want["top_p"], want["greedy"])          # sampling draws other tokens than greedy
    assert not np.array_equal(generate(ref, "top_p", seed=8), want["top_p"])      # control: the seed matters
    for dp, tp in ((1, 2), (2, 2)):
        with ap.simulate(world_size=dp * tp):
            model = pf.build("llama", 0)
            model.eval()
            model, _ = ap.parallelize(model, None, strategy=strategy(dp, tp))
            for form in FORMS:
                got = generate(model, form)
                assert got.shape == want[form].shape == (len(LENGTHS), 5)
                np.testing.assert_array_equal(got, want[form], err_msg=f"{form} dp{dp} tp{tp}")


def test_plain_copy_of_a_tied_tp_model_generates_the_one_process_tokens():
    ref = pf.build("llama", 0, tie_word_embeddings=True)
    ref.eval()
    with ap.simulate(world_size=2):
        model = pf.build("llama", 0, tie_word_embeddings=True)
        model.eval()
        model, _ = ap.parallelize(model, None, strategy=strategy(1, 2))
        plain = ap.full_model(model)
    assert len(plain.parameters()) == len(ref.parameters())          # the tie is kept (one parameter)
    assert all(type(p) is not ap.DistParameter for p in plain.parameters())
    np.testing.assert_array_equal(generate(plain, "top_k"), generate(ref, "top_k"))
