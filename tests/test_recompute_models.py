"""Recompute on every PaddleFormers family, unedited, in the simulated 4-rank world: full recompute under dp4
and dp2 x tp2 equals one process without recompute (loss and every gradient), every block's forward really
runs twice, and the KV cache the model builds (``use_cache`` on by default) holds each key once after backward;
selective recompute, recompute with sequence parallelism and under ZeRO; the model's own ``config.recompute``;
segments of two blocks and the errors when a segment cannot hold; negative controls."""
import pytest

from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

import paddle  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel.parallel import recompute_state  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
OWN = {"recompute": True, "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
_REF = {}


def reference(name):
    if name not in _REF:
        loss, grads = pf.reference(name, fill_zeros=True)
        _REF[name] = loss, {k: g.copy() for k, g in grads.items()}
    return _REF[name][0], {k: g.copy() for k, g in _REF[name][1].items()}


def strategy(dp=2, tp=2, granularity="full", every=1, sp=False, zero=0):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    if granularity:
        s.recompute.enable, s.recompute.granularity = True, granularity
        s.recompute.checkpoint_every_n_layers = every
    s.sequence_parallel.enable = sp
    if zero:
        s.sharding.enable, s.sharding.stage = True, zero
    return s


def _count_block_calls(model):
    """{block index: forward calls of the block's sublayers}, counted by forward pre-hooks."""
    calls = {}
    for i, block in enumerate(model.model.layers):
        for sub in block.sublayers():
            sub.register_forward_pre_hook(lambda *a, _i=i: calls.__setitem__(_i, calls.get(_i, 0) + 1))
    return calls


def run(name, s, count=False, **overrides):
    """(loss, grads, forward calls per block, calls after backward, output) of one step under parallelize."""
    with ap.simulate(world_size=4):
        model = pf.build(name, fill_zeros=True, **overrides)
        opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=s)
        calls = _count_block_calls(model) if count else {}
        ids, labels = pf.batch(0)
        out = model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels))
        fwd = dict(calls)
        loss = pf.loss_of(out)
        loss.backward()
        opt.reduce_gradients()
        grads = {n: pf._grad_np(p) for n, p in model.named_parameters()}
        return float(loss), grads, fwd, dict(calls), out


def _cache_lengths(out):
    cache = out.get("past_key_values") if isinstance(out, dict) else None
    if cache is None or not hasattr(cache, "layers"):
        return []
    return [layer.keys.shape[-2] for layer in cache.layers if getattr(layer, "keys", None) is not None]


@pytest.mark.parametrize("mesh", [(4, 1), (2, 2)], ids=["dp4", "dp2tp2"])
@pytest.mark.parametrize("name", list(pf.MODELS))
def test_full_recompute_equals_one_process(name, mesh):
    loss, grads, fwd, after, out = run(name, strategy(*mesh), count=True)
    assert pf.compare(reference(name), (loss, grads), RTOL, ATOL) == []
    assert set(fwd) == set(range(pf.LAYERS)) and all(fwd[i] > 0 for i in fwd)
    assert after == {i: 2 * c for i, c in fwd.items()}, f"{name}: the blocks' forwards did not run twice"
    lengths = _cache_lengths(out)
    assert all(n == pf.batch(0)[0].shape[1] for n in lengths), f"{name}: cache key lengths {lengths}"


def test_negative_control_without_recompute_blocks_run_once():
    _, _, fwd, after, _ = run("qwen2", strategy(granularity=None), count=True)
    assert after == fwd and all(c > 0 for c in fwd.values())


def test_negative_control_a_replay_that_sees_the_filled_cache_fails(monkeypatch):
    """Without restoring the cache's entry state, the re-run appends its keys again (16 instead of 8)."""
    def no_entry_restore(self):
        self.before = recompute_state._Snapshot(self.roots)

    monkeypatch.setattr(recompute_state.RegionState, "replay_begin", no_entry_restore)
    try:
        with pytest.raises(Exception, match="cannot be broadcast|shape"):
            run("qwen2", strategy(4, 1))
    finally:
        paddle.set_grad_enabled(True)   # paddle 3.3 leaves grad mode off after a re-run fails in backward


def test_use_cache_off_needs_no_state_and_matches():
    loss, grads, *_ = run("qwen2", strategy(), use_cache=False)
    assert pf.compare(pf.reference("qwen2", fill_zeros=True, use_cache=False), (loss, grads), RTOL, ATOL) == []


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt_oss", "deepseek_v3", "qwen3_next"])
def test_selective_recompute_through_the_attention_registry(name):
    loss, grads, *_ = run(name, strategy(granularity="selective"))
    assert pf.compare(reference(name), (loss, grads), RTOL, ATOL) == []


@pytest.mark.parametrize("name", ["qwen2", "deepseek_v3"])
def test_recompute_with_sequence_parallel(name):
    loss, grads, *_ = run(name, strategy(sp=True))
    assert pf.compare(reference(name), (loss, grads), RTOL, ATOL) == []


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_recompute_under_zero_equals_zero_without_recompute(zero):
    base = run("qwen2", strategy(granularity=None, zero=zero))[:2]
    got = run("qwen2", strategy(zero=zero))[:2]
    assert pf.compare(base, got, RTOL, ATOL) == []


def test_recompute_under_amp_equals_amp_without_recompute():
    def amp(granularity):
        s = strategy(granularity=granularity)
        s.amp.enable, s.amp.dtype = True, "bfloat16"
        return s

    assert pf.compare(run("qwen2", amp(None))[:2], run("qwen2", amp("full"))[:2], RTOL, ATOL) == []


def test_segments_of_two_blocks():
    loss, grads, fwd, after, _ = run("phi3", strategy(every=2), count=True)
    assert pf.compare(reference("phi3"), (loss, grads), RTOL, ATOL) == []
    assert after == {i: 2 * c for i, c in fwd.items()}


def test_segment_over_blocks_with_different_masks_raises():
    """GPT-OSS with a sliding-window layer then a full one: one segment would run both with the first mask."""
    option = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}
    with pytest.raises(ValueError, match="other ones .*checkpoint_every_n_layers=1"):
        run("gpt_oss", strategy(every=2), **option)
    loss, grads, *_ = run("gpt_oss", strategy(every=1), **option)
    assert pf.compare(pf.reference("gpt_oss", fill_zeros=True, **option), (loss, grads), RTOL, ATOL) == []


@pytest.mark.parametrize("name", ["llama", "qwen2", "deepseek_v3", "glm4_moe"])
def test_the_models_own_recompute(name):
    """``config.recompute=True`` (every family but ernie4_5 and qwen3_next, which do not act on it): in one
    process plain paddle runs it on llama only (the others' reentrant re-run appends to their KV cache again); on
    distributed tensors it equals one process without recompute, and each block's forward runs twice."""
    loss, grads, fwd, after, _ = run(name, strategy(granularity=None), count=True, **OWN)
    assert pf.compare(reference(name), (loss, grads), RTOL, ATOL) == []
    assert after == {i: 2 * c for i, c in fwd.items()}


def test_block_forward_of_varargs_and_keyword_calls_without_hidden_states():
    """``forward(*args, **kwargs)`` blocks take the hidden states positionally; a keyword-only call names what
    is missing."""
    from autoparallel.parallel.recompute_segments import Segment

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = paddle.nn.Linear(4, 4)

        def forward(self, *args, **kwargs):
            return self.fc(args[0])

    blocks = [Block(), Block()]
    x = paddle.randn([2, 4])
    want = blocks[1](blocks[0](x))
    Segment(blocks, ["b0", "b1"], lambda fn, where, roots, a, k: fn(*a, **k)).install()
    h = blocks[0](x)
    assert float((blocks[1](h) - want).abs().max()) == 0.0
    with pytest.raises(TypeError, match="b0: called without its hidden states"):
        blocks[0](hidden_states=x)


def test_python_state_changed_by_a_block_changes_once():
    """A block appending to a list and setting an attribute in forward, and a post-hook setting another: after
    backward they hold what one forward left (the re-run ran, and changed nothing), unlike the re-run's values."""
    model = pf.build("llama")
    block = model.model.layers[0]
    block.log, forward = [], block.forward

    def logging(hidden_states, *a, **k):
        block.log.append(len(block.log))
        block.last_input = hidden_states
        return forward(hidden_states, *a, **k)

    block.forward = logging
    block.register_forward_post_hook(lambda layer, inp, out: setattr(layer, "hooked", len(layer.log)))
    with ap.simulate(world_size=4):
        model, _ = ap.parallelize(model, None, strategy=strategy(4, 1))
        calls = _count_block_calls(model)
        ids, labels = pf.batch(0)
        loss = pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
        seen, fwd = block.last_input, dict(calls)
        loss.backward()
    assert fwd[0] > 0 and calls[0] == 2 * fwd[0]             # the block's forward ran again in backward
    assert block.log == [0] and block.hooked == 1 and block.last_input is seen


def test_in_place_state_change_raises():
    """A block that updates a buffer in place cannot be re-run without updating it twice: a typed error."""
    model = pf.build("llama")
    block = model.model.layers[0]
    block.register_buffer("steps", paddle.zeros([1]))
    forward = block.forward

    def counting(hidden_states, *a, **k):
        block.steps.add_(paddle.ones([1]))
        return forward(hidden_states, *a, **k)

    block.forward = counting
    with ap.simulate(world_size=4):
        model, _ = ap.parallelize(model, None, strategy=strategy(4, 1))
        ids, labels = pf.batch(0)
        with pytest.raises(NotImplementedError, match=r"model\.layers\.0: .*steps in place"):
            model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels))
