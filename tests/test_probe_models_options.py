"""PaddleFormers models under the options a user combines, in the simulated world, against one process:
sequence parallel with ZeRO-3, gradient accumulation, tied embeddings, explicit attention masks, -100 labels
and position ids in one run; recompute with ZeRO-2 on a mixture of experts; emulated AMP (bfloat16 under
sequence parallel, float16 loss scaling); ``generate()`` and a KV-cache forward under a TP mesh;
``save_pretrained`` under a TP mesh. Zero-initialised parameters get random values (``fill_zeros``)."""
import numpy as np
import pytest

from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

import paddle  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel.parallel.amp import apply_amp  # noqa: E402

LR = 0.5
SCALE = 65536.0          # strategy.amp's default initial loss scale


def strategy(dp=2, tp=2, sp=False, stage=None, recompute=False, acc=1, amp=None):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree, s.sequence_parallel.enable = dp, tp, sp
    if stage:
        s.sharding.enable, s.sharding.stage = True, stage
    s.recompute.enable = recompute
    s.gradient_accumulation_steps = acc
    if amp:
        s.amp.enable, s.amp.dtype, s.amp.level = True, amp[0], amp[1]       # float16: scale 2^16
    return s


def inputs():
    """input_ids, labels with -100 (a whole sample and the first positions), a padding mask, position ids."""
    ids, labels = pf.batch(0)
    labels[:, :3] = -100
    labels[2, :] = -100
    mask = np.ones(ids.shape, "int64")
    mask[0, :3] = 0
    pos = np.tile(np.arange(ids.shape[1])[None] + 2, (ids.shape[0], 1)).astype("int64")
    return {k: paddle.to_tensor(v) for k, v in
            dict(input_ids=ids, labels=labels, attention_mask=mask, position_ids=pos).items()}


def full(p):
    return p.full().numpy() if hasattr(p, "full") else p.numpy()


def plain_inputs():
    ids, labels = pf.batch(0)
    return {"input_ids": paddle.to_tensor(ids), "labels": paddle.to_tensor(labels)}


def one_process_step(name, micro=1, amp=None, feed=inputs, **cfg):
    """Loss and parameters after ``micro`` backward passes and one SGD step (the gradient averaged)."""
    model = pf.build(name, 0, fill_zeros=True, **cfg)
    if amp:
        apply_amp(model, *amp)
    opt = paddle.optimizer.SGD(LR / micro, parameters=model.parameters())
    for _ in range(micro):
        loss = pf.loss_of(model(**feed()))
        (loss * SCALE if amp and amp[0] == "float16" else loss).backward()
    if amp and amp[0] == "float16":
        for p in model.parameters():
            p.grad.set_value(p.grad / SCALE)
    opt.step()
    return float(loss), {n: p.numpy() for n, p in model.named_parameters()}


def parallel_step(name, s, micro=1, feed=inputs, **cfg):
    with ap.simulate(world_size=4):
        model = pf.build(name, 0, fill_zeros=True, **cfg)
        opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=s)
        for _ in range(micro):
            loss = pf.loss_of(model(**feed()))
            (opt.scale(loss) if hasattr(opt, "scale") else loss).backward()
        opt.step()
        if s.sharding.enable and s.sharding.stage == 3:
            opt.gather(opt.params)
        return float(loss), {n: full(p) for n, p in model.named_parameters()}


def worst(ref, got):
    """max over parameters of max |got - ref|, and the names beyond atol 1e-5 / rtol 1e-4."""
    same = [n for n in ref[1] if n in got[1] and got[1][n].shape == ref[1][n].shape]
    bad = [n for n in ref[1] if n not in same or not np.allclose(got[1][n], ref[1][n], 1e-4, 1e-5)]
    return max(float(np.abs(got[1][n] - ref[1][n]).max()) for n in same), bad


@pytest.mark.parametrize("name,options,cfg", [
    ("llama", dict(sp=True, stage=3, acc=2), {"tie_word_embeddings": True, "attention_bias": True}),
    ("qwen3_moe", dict(sp=True, stage=2, recompute=True), {"num_key_value_heads": 1}),
], ids=["llama-sp-zero3-acc2-tied-bias", "qwen3_moe-sp-zero2-recompute-mqa"])
def test_combined_options_equal_one_process(name, options, cfg):
    micro = options.get("acc", 1)
    ref = one_process_step(name, micro, **cfg)
    got = parallel_step(name, strategy(**options), micro, **cfg)
    assert np.isclose(got[0], ref[0], 1e-5), (got[0], ref[0])
    assert worst(ref, got)[1] == []
    base = one_process_step(name, micro)                     # negative control: the config option matters
    assert worst(base, ref)[1]


def test_amp_bfloat16_under_sequence_parallel_equals_one_process():
    """Emulated bfloat16 autocast (O1) with sequence parallel: the rounding of a column-parallel layer's
    gathered input keeps the gather's partial-gradient mark, so the gradients upstream are reduced once.
    Rounding partial sums differs from rounding the sum by bf16 noise only (< 1e-3 after the step); the bug
    this guards against doubled those gradients (0.68). The loss shows AMP was applied."""
    amp = ("bfloat16", "O1")
    ref = one_process_step("llama", amp=amp)
    got = parallel_step("llama", strategy(sp=True, amp=amp))
    assert np.isclose(got[0], ref[0], rtol=1e-6)
    assert abs(got[0] - one_process_step("llama")[0]) > 1e-4
    assert worst(ref, got)[0] < 2e-3


def test_amp_float16_loss_scaling_under_sequence_parallel_and_zero3():
    """At the default scale the gradient reaching the embedding overflows at one position, a padding token
    (id 0), which the embedding drops on one process. The vocab-parallel lookup used to multiply by its mask
    (inf * 0 = NaN on the rank not owning id 0), so every step was skipped; it selects now."""
    amp = ("float16", "O2")
    ids, _ = pf.batch(0)
    assert (ids == pf.build("llama").model.embed_tokens._padding_idx).any()
    ref = one_process_step("llama", amp=amp, feed=plain_inputs)
    got = parallel_step("llama", strategy(sp=True, stage=3, amp=amp), feed=plain_inputs)
    assert np.isfinite(list(ref[1].values())[0]).all()
    assert worst(ref, got)[0] < 5e-4


def test_amp_float16_step_without_scaled_loss_raises():
    """``loss.backward()`` instead of ``opt.scale(loss).backward()``: the step would divide true gradients by
    the loss scale (every update 65536x too small); it raises naming the call to write instead."""
    with ap.simulate(world_size=4):
        model = pf.build("llama", 0)
        opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=strategy(dp=4, tp=1, amp=("float16", "O1")))
        pf.loss_of(model(**inputs())).backward()
        with pytest.raises(RuntimeError, match=r"opt\.scale\(loss\)\.backward\(\)"):
            opt.step()
        opt.clear_grad()
        opt.scale(pf.loss_of(model(**inputs()))).backward()
        assert opt.step()


def _greedy(model):
    ids, _ = pf.batch(0, b=2, t=5)
    out = model.generate(input_ids=paddle.to_tensor(ids), max_new_tokens=4, decode_strategy="greedy_search")
    out = out[0] if isinstance(out, (tuple, list)) else out
    return full(out)


def _cached_logits(model):
    """Logits of a prefix forward that fills the KV cache, then of one more token reading it."""
    ids, _ = pf.batch(0, b=2, t=6)
    out = model(input_ids=paddle.to_tensor(ids[:, :5]), use_cache=True, return_dict=True)
    nxt = model(input_ids=paddle.to_tensor(ids[:, 5:]), past_key_values=out.past_key_values, use_cache=True,
                return_dict=True)
    return np.concatenate([full(out.logits), full(nxt.logits)], 1)


@pytest.mark.parametrize("name,run,dp,tp", [("llama", _greedy, 1, 2), ("qwen3_moe", _cached_logits, 1, 2),
                                            ("qwen3_moe", _cached_logits, 4, 1)],
                         ids=["generate-tp2-sp", "kv-cache-tp2-sp", "kv-cache-dp4-empty-shards"])
def test_inference_under_a_mesh_equals_one_process(name, run, dp, tp):
    """dp4 with a batch of 2 leaves two ranks without samples: the MoE layer's ``view([-1, hidden])`` of an
    empty shard runs as a reshape (paddle's view kernel refuses 0-element results)."""
    model = pf.build(name, 0)
    model.eval()
    ref = run(model)
    with ap.simulate(world_size=dp * tp):
        model = pf.build(name, 0)
        model.eval()
        model, _ = ap.parallelize(model, None, strategy=strategy(dp=dp, tp=tp, sp=tp > 1))
        got = run(model)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def _saved(path):
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_save_pretrained_under_tp_mesh_writes_the_one_process_checkpoint(name, tmp_path):
    """PaddleFormers' ``save_pretrained`` goes through paddle's ``Layer.sharded_state_dict``, which sizes a
    tensor by its ``.shape``: the shard's, for a tensor-parallel weight. It now sees full values: the files
    equal the one-process save tensor for tensor (and a column-split weight is saved whole)."""
    pf.build(name, 0).save_pretrained(str(tmp_path / "one"))
    with ap.simulate(world_size=2):
        model, _ = ap.parallelize(pf.build(name, 0), None, strategy=strategy(dp=1, tp=2))
        assert any(list(p.shape) != p.global_shape for p in model.parameters())     # .shape: a local shard
        model.save_pretrained(str(tmp_path / "tp"))
    one, tp = _saved(tmp_path / "one"), _saved(tmp_path / "tp")
    assert one and sorted(one) == sorted(tp)
    for k, v in one.items():
        assert tp[k].shape == v.shape and np.array_equal(tp[k], v), k
    loaded = type(pf.build(name, 0)).from_pretrained(str(tmp_path / "tp"))      # and it loads back
    ref = pf.build(name, 0)
    for (n, p), q in zip(ref.named_parameters(), loaded.parameters()):
        assert list(q.shape) == list(p.shape), n


def test_view_of_an_empty_shard():
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["data"])
        x = paddle.arange(16, dtype="float32").reshape([2, 1, 8])
        got = ap.shard_tensor(x, mesh, [ap.Shard(0)]).view([-1, 8])
        assert got.placements == [ap.Shard(0)]
        np.testing.assert_array_equal(got.full().numpy(), x.numpy().reshape(2, 8))


def test_dtype_predicates_on_distributed_tensors():
    """``is_floating_point`` / ``is_complex`` / ``is_integer`` (PaddleFormers reads them on parameters while
    saving) answer from the dtype, as on one process, in both call forms."""
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        for dtype in ("float32", "bfloat16", "int64", "bool"):
            plain = paddle.ones([4, 2]).astype(dtype)
            t = ap.shard_tensor(plain, mesh, [ap.Shard(0)])
            for f in ("is_floating_point", "is_complex", "is_integer"):
                want = getattr(paddle, f)(plain)
                assert getattr(t, f)() == want and getattr(paddle, f)(t) == want, (dtype, f)


def test_to_static_dense_equals_one_process_and_moe_names_the_eager_path():
    """``ap.to_static`` (the captured, completed graph) on a dense PaddleFormers model with sequence parallel
    equals one process; on a mixture of experts the routing's value-dependent shapes cannot be captured, and
    the typed error says which entry point runs it."""
    from autoparallel.graph.completion.errors import MissingRuleError

    def loss_fn(out, labels):               # the captured model returns its output as a tuple, logits first
        logits = out.logits if hasattr(out, "logits") else out[0]
        return paddle.nn.functional.cross_entropy(logits.reshape([-1, pf.VOCAB]), labels.reshape([-1]))

    ids, labels = (paddle.to_tensor(a) for a in pf.batch(0))
    model = pf.build("llama", 0)
    opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
    loss = loss_fn(model(input_ids=ids), labels)
    loss.backward()
    opt.step()
    ref = float(loss), {n: p.numpy() for n, p in model.named_parameters()}
    spec = [([4, 8], "int64"), ([4, 8], "int64")]
    with ap.simulate(world_size=4):
        model = pf.build("llama", 0)
        opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
        dm = ap.to_static(model, None, loss_fn, opt, strategy=strategy(sp=True), input_spec=spec)
        dm.train()
        got = float(dm(ids, labels)), {n: full(p) for n, p in model.named_parameters()}
        moe = pf.build("qwen3_moe", 0)
        with pytest.raises(MissingRuleError, match="run it eagerly with ap.parallelize"):
            ap.to_static(moe, None, loss_fn, paddle.optimizer.SGD(LR, parameters=moe.parameters()),
                         strategy=strategy(), input_spec=spec)
    assert np.isclose(got[0], ref[0], 1e-5) and worst(ref, got)[1] == []
