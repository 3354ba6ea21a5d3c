"""``generate`` and hand-cached inference of PaddleFormers models laid out by ``ap.parallelize`` (a tensor-parallel
plan, DP 2 with ZeRO-3, ``auto_mode="full"`` with a plan), against the same model in one process: token ids
exactly, scores and logits to 1e-5.

Simulated: greedy search of 1 prompt and of 3 left-padded prompts (odd: not divisible by the data-parallel degree)
with and without the cache, sampling (``top_k`` + temperature, ``top_p``, ``num_return_sequences``), beam search
(3 beams, 2 sequences, ``length_penalty`` without the cache), ``repetition_penalty``, an ``eos_token_id`` reached
mid-way with ``min_new_tokens`` and ``pad_token_id``, a list of eos ids; Llama, Qwen2, Qwen3 and Qwen3-MoE.
``model.eval()`` of a model built with ``attention_dropout=0.3`` and parallelized in training mode: logits of a
forward, of the same forward under ``paddle.no_grad`` / ``paddle.set_grad_enabled(False)``, and of a prefix forward
followed by single-token forwards handed ``past_key_values`` by hand. (paddle 3.3.1 has no
``paddle.inference_mode``.) ``no_repeat_ngram_size`` against numpy's semantics (paddle's own view-setitem bug).

Real ranks (one 2-rank job of the shared launch, ``dist_scripts/generate6_worker.py``): TP 2 and ZeRO-3 DP 2,
every rank's tokens. Sampling on ranks seeded differently (``paddle.seed(100 + rank)``), or not seeded at all, gave
each rank its own tokens and fed them to the next tensor-parallel forward (silently wrong on every rank); the draw
of the first rank of the mesh is now broadcast (``autoparallel/draw_agree.py``), so every rank holds the tokens one
process draws under rank 0's seed."""
import os

import numpy as np
import pytest

from autoparallel.testing import paddleformers_models as pf
from dist_scripts import shared_launch

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

import paddle  # noqa: E402

import autoparallel as ap  # noqa: E402
from dist_scripts.generate6_worker import BEAMS, GREEDY, TOP_K, TOP_P, TP_PLAN, cached_logits, generate  # noqa: E402

HERE = os.path.join(os.path.dirname(__file__), "dist_scripts")
JOB = shared_launch.job(__name__, "generate6", os.path.join(HERE, "generate6_worker.py"), 2, timeout=240)

FORMS = {
    "greedy-b1": dict(GREEDY, lengths=[5]),
    "greedy-b3-nocache": dict(GREEDY, use_cache=False),
    "greedy-b3": GREEDY,
    "top_k-temperature": TOP_K,
    "top_p-b1": dict(TOP_P, lengths=[4]),
    "sampling-2-sequences": dict(decode_strategy="sampling", top_k=10, num_return_sequences=2),
    "beams-3-return-2": BEAMS,
    "beams-nocache-length-penalty": dict(decode_strategy="beam_search", num_beams=2, use_cache=False,
                                         length_penalty=0.5),
    "repetition-penalty": dict(GREEDY, repetition_penalty=1.5),
    "eos-min-new-tokens": dict(GREEDY, eos_token_id=None, min_new_tokens=2, pad_token_id=0),
    "eos-list": dict(GREEDY, eos_token_id=None, pad_token_id=0),
}
FEW = ("greedy-b3", "top_k-temperature", "beams-3-return-2")


def run(model, form):
    kw = dict(FORMS[form])
    if form == "eos-min-new-tokens":                    # the first prompt's third greedy token: it stops there
        kw["eos_token_id"] = _eos()
    if form == "eos-list":                              # the first prompt stops at its 2nd token, the third at its 3rd
        kw["eos_token_id"] = _eos_list()
    if "use_cache" in kw:
        kw.pop("use_cache")
        return _uncached(model, **kw)
    return generate(model, seed=7, **kw)


def _uncached(model, **kw):
    from dist_scripts.generate6_worker import full, prompts

    ids, mask = prompts(kw.pop("lengths", [6, 3, 5]))
    paddle.seed(7)
    out = model.generate(input_ids=paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask), max_new_tokens=4,
                         use_cache=False, **kw)
    return [full(out[0]).tolist(), full(out[1]).tolist()]


_REF: dict = {}


def _reference(name, **config):
    key = (name, tuple(sorted(config.items())))
    if key not in _REF:
        m = pf.build(name, 0, **config)
        m.eval()
        _REF[key] = m
    return _REF[key]


def _eos():
    return int(np.asarray(generate(_reference("llama"), **GREEDY)[0])[0, 2])


def _eos_list():
    g = np.asarray(generate(_reference("llama"), **GREEDY)[0])
    return [int(g[0, 1]), int(g[2, 2])]


def _layout(name, layout, **config):
    """``name`` built and parallelized in training mode (inside ``ap.simulate``), then ``eval()``."""
    m = pf.build(name, 0, **config)
    opt = paddle.optimizer.AdamW(1e-3, parameters=m.parameters())
    s = ap.Strategy()
    plan = None
    if layout == "tp2":
        s.tensor_parallel.degree, plan, opt = 2, TP_PLAN if name == "llama" else None, None   # else its own plan
    elif layout == "zero3":
        s.data_parallel.degree, s.sharding.enable, s.sharding.stage = 2, True, 3
    elif layout == "dp2tp2":
        s.data_parallel.degree, s.tensor_parallel.degree, opt = 2, 2, None
    else:                                               # the planner chooses, with the plan given
        s.auto_mode, s.global_batch_size, plan = "full", 4, TP_PLAN
    m, _ = ap.parallelize(m, opt, strategy=s, tp_plan=plan)
    m.eval()
    return m


def _assert_same(got, want, what):
    assert np.asarray(got[0]).shape == np.asarray(want[0]).shape, what
    np.testing.assert_array_equal(got[0], want[0], err_msg=what)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5, err_msg=what)


CASES = [("llama", lay, f) for lay in ("tp2", "zero3", "auto") for f in FORMS] + \
        [(n, lay, f) for n in ("qwen2", "qwen3", "qwen3_moe") for lay in ("tp2", "zero3") for f in FEW]


@pytest.mark.parametrize("name,layout", sorted({(n, lay) for n, lay, _ in CASES}))
def test_generate_forms_equal_one_process(name, layout):
    forms = [f for n, lay, f in CASES if (n, lay) == (name, layout)]
    want = {f: run(_reference(name), f) for f in forms}
    world = 4 if layout == "auto" else 2
    with ap.simulate(world_size=world):
        model = _layout(name, layout)
        if layout == "auto":                            # the plan was taken: some weight is split
            assert any(p._ap_spec.shape != p.shape for p in model.parameters() if hasattr(p, "_ap_spec"))
        for f in forms:
            _assert_same(run(model, f), want[f], f"{name} {layout} {f}")


def test_the_forms_are_distinct():
    """Controls: sampling is not greedy, the seed matters, the eos row was cut (padded after its eos)."""
    ref = _reference("llama")
    greedy, sampled = run(ref, "greedy-b3"), run(ref, "top_k-temperature")
    assert greedy[0] != sampled[0]
    assert generate(ref, seed=8, **TOP_K)[0] != sampled[0]
    eos = np.asarray(run(ref, "eos-min-new-tokens")[0])
    assert eos[0, 2] == _eos() and (eos[0, 3:] == 0).all() and (eos[1:] != 0).any()
    listed = np.asarray(run(ref, "eos-list")[0])
    assert (listed[0, 2:] == 0).all() and listed[2, 3] == 0 and (listed[1] != 0).all()
    assert np.asarray(run(ref, "beams-3-return-2")[0]).shape == (2, 4)


def test_eos_token_id_list_with_a_minimum_length_is_refused_as_in_one_process():
    """PaddleFormers 1.2's minimum-length processor refuses a list of eos ids in one process already (a list without
    a minimum is the ``eos-list`` form above); the laid-out model raises the same ``ValueError``."""
    kw = dict(GREEDY, eos_token_id=[7, 9], min_new_tokens=2)
    with pytest.raises(ValueError, match="eos_token_id"):
        generate(_reference("llama"), **kw)
    with ap.simulate(world_size=2):
        model = _layout("llama", "tp2")
        with pytest.raises(ValueError, match="eos_token_id"):
            generate(model, **kw)


def _forwards(model):
    from dist_scripts.generate6_worker import full, prompts

    ids = paddle.to_tensor(prompts(t=8)[0])
    plain = full(model(input_ids=ids, return_dict=True).logits)
    with paddle.no_grad():
        no_grad = model(input_ids=ids, return_dict=True).logits
    with paddle.set_grad_enabled(False):
        disabled = model(input_ids=ids, return_dict=True).logits
    assert no_grad.stop_gradient and disabled.stop_gradient
    return {"forward": plain, "no_grad": full(no_grad), "set_grad_enabled": full(disabled),
            "cached": np.asarray(cached_logits(model))}


@pytest.mark.parametrize("name,layout", [("llama", "tp2"), ("llama", "zero3"), ("llama", "dp2tp2"),
                                         ("qwen3_moe", "tp2")])
def test_eval_turns_configured_dropout_off_in_every_forward_form(name, layout):
    want = _forwards(_reference(name, attention_dropout=0.3))
    with ap.simulate(world_size=4 if layout == "dp2tp2" else 2):
        model = _layout(name, layout, attention_dropout=0.3)
        got = _forwards(model)
        model.train()
        paddle.seed(1)
        training = _forwards(model)["forward"]
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=f"{name} {layout} {k}")
    assert np.abs(training - want["forward"]).max() > 1e-2          # control: the dropout is real in training


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


def test_real_tensor_parallel_generation_equals_one_process_on_every_rank(ranks):
    ref = _reference("llama", attention_dropout=0.3)
    want = {"greedy": generate(ref, **GREEDY), "beams": generate(ref, **BEAMS),
            "rank_seeded": generate(ref, seed=100, **TOP_K), "cached": cached_logits(ref)}
    for r in ranks:
        assert r["tp"]["sharded"]
        for k in ("greedy", "beams", "rank_seeded"):
            _assert_same(r["tp"][k], want[k], f"rank {r['rank']} {k}")
        np.testing.assert_allclose(r["tp"]["cached"], want["cached"], rtol=1e-5, atol=1e-5)


def test_real_sampling_is_one_draw_on_every_rank_whatever_their_seeds(ranks):
    """Before: rank 1 (seed 101, or its own unseeded state) kept its own tokens, and the tensor-parallel forwards
    after the first token combined the shards of different sequences."""
    for case in ("tp", "zero3"):
        for k in ("rank_seeded",) + (("unseeded",) if case == "tp" else ("one_prompt",)):
            assert ranks[0][case][k] == ranks[1][case][k], (case, k)
    assert generate(_reference("llama"), seed=101, **TOP_K)[0] != ranks[0]["tp"]["rank_seeded"][0]   # control


def test_real_zero3_moe_generation_equals_one_process_on_every_rank(ranks):
    ref = _reference("qwen3_moe")
    want = {"greedy": generate(ref, **GREEDY), "rank_seeded": generate(ref, seed=100, **TOP_P),
            "one_prompt": generate(ref, seed=100, lengths=[4], **TOP_P), "cached": cached_logits(ref)}
    for r in ranks:
        for k in ("greedy", "rank_seeded", "one_prompt"):
            _assert_same(r["zero3"][k], want[k], f"rank {r['rank']} {k}")
        np.testing.assert_allclose(r["zero3"]["cached"], want["cached"], rtol=1e-5, atol=1e-5)


def test_no_repeat_ngram_bans_as_numpy_does(monkeypatch):
    """``no_repeat_ngram_size`` bans a row's seen tokens with ``scores[i, banned] = min``. paddle's own bug: in one
    process the first step's ``scores`` is a strided view (``logits[:, -1, :]``), and paddle's setitem with a list
    index on such a view writes nothing for some rows (``x[:, -1, :][1, [2, 3]] = v`` leaves the values), so one
    process repeats tokens it was told to ban. The laid-out model bans them; it equals the one process whose
    processor is handed a contiguous copy, and no generated token repeats an earlier token of its row. paddle's
    buggy write is not run here: it corrupts the process's memory (a later test of the same process crashed)."""
    import paddleformers.generation.logits_process as lp

    kw = dict(GREEDY, no_repeat_ngram_size=1)
    plain_call = lp.NoRepeatNGramLogitsProcessor.__call__
    monkeypatch.setattr(lp.NoRepeatNGramLogitsProcessor, "__call__", lambda self, ids, scores: plain_call(
        self, ids, scores.clone() if type(scores) is paddle.Tensor else scores))
    want = generate(_reference("llama"), **kw)
    for layout in ("tp2", "zero3"):
        with ap.simulate(world_size=2):
            got = generate(_layout("llama", layout), **kw)
        _assert_same(got, want, layout)
    from dist_scripts.generate6_worker import prompts

    ids = np.concatenate([prompts()[0], np.asarray(want[0])], 1)
    for row in ids:
        for t in range(6, ids.shape[1]):
            assert row[t] not in row[:t]
