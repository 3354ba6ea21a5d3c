"""The vision-language families of PaddleFormers 1.2, unedited, in the simulated 4-rank world, with image and text
inputs built by hand (packed patches of images of different sizes, ``image_grid_thw``, image tokens between vision
start / end tokens; a data-parallel split then cuts an image's patches across ranks; padded samples): the
seed shard function with the vision towers' names (fused qkv, fc1/fc2, proj, linear_fc1/2) on a 2x2 ["data",
"model"] mesh with every input split over "data" equals one process (loss and every gradient, vision tower
included); ``ap.parallelize`` (dp=2, tp=2) through an AdamW step and a second forward; ``auto_mode="full"``; every
vision-language family of the installed package runs here or is a named skip whose reason is checked."""
import numpy as np
import paddle
import pytest

from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

import autoparallel as ap  # noqa: E402

RTOL, ATOL, LR = 1e-4, 1e-5, 1e-3
GRIDS = [(1, 4, 4), (1, 2, 4), (1, 4, 2), (1, 2, 2)]      # images of different sizes: 4, 2, 2, 1 image tokens
SPEECH = ("qwen3_omni_moe", "whisper")
_REF = {}


def batch(name):
    """Images of different sizes, and padding at the end of samples 1 and 3 (attention_mask, labels -100)."""
    b = pf.vl_batch(name, grids=GRIDS)
    mask = np.ones_like(b["input_ids"])
    mask[1, -3:] = mask[3, -1:] = 0
    b["labels"] = np.where(mask == 1, b["labels"], -100)
    return {**b, "attention_mask": mask}


def _grads(model):
    return {n: pf._grad_np(p) for n, p in model.named_parameters()}


def _inputs(arrays, mesh=None):
    """Plain tensors, or (with a mesh) every input split over "data" on its dim 0 -- the patches and grids too."""
    out = {k: paddle.to_tensor(v) for k, v in arrays.items()}
    if mesh is not None:
        out = {k: ap.shard_tensor(v, mesh, [ap.Shard(0), ap.Replicate()]) for k, v in out.items()}
    return out


def reference(name):
    """One process: (loss, gradients, loss after one AdamW step, parameters after it)."""
    if name not in _REF:
        model = pf.vl_build(name)
        opt = paddle.optimizer.AdamW(LR, parameters=model.parameters())
        data = batch(name)
        loss = pf.loss_of(model(**_inputs(data)))
        loss.backward()
        grads = _grads(model)
        opt.step()
        opt.clear_grad()
        loss2 = float(pf.loss_of(model(**_inputs(data))))
        _REF[name] = float(loss), grads, loss2, {n: p.numpy() for n, p in model.named_parameters()}
    return _REF[name]


def seed_sharded(name, reduce_grads=True):
    """(loss, gradients, {parameter: placements}) under shard_layer with ``vl_shard_fn`` on the 2x2 mesh."""
    with ap.simulate(world_size=4):
        mesh = pf.mesh_2x2()
        model = ap.shard_layer(pf.vl_build(name), mesh, pf.vl_shard_fn)
        loss = pf.loss_of(model(**_inputs(batch(name), mesh)))
        loss.backward()
        if reduce_grads:
            ap.reduce_gradients(model.parameters())
        return float(loss), _grads(model), {n: str(p.placements) for n, p in model.named_parameters()}


def _vision_sharded(place) -> list:
    return [n for n, p in place.items() if "visual" in n and "S(" in p]


@pytest.mark.parametrize("name", sorted(pf.VL_MODELS))
def test_seed_shard_fn_dp_x_tp_equals_one_process(name):
    ref = reference(name)
    loss, grads, place = seed_sharded(name)
    assert _vision_sharded(place), f"{name}: no vision-tower weight was sharded by vl_shard_fn"
    assert set(grads) == set(ref[1])
    assert pf.compare(ref[:2], (loss, grads), RTOL, ATOL) == []


@pytest.mark.parametrize("name", ["qwen3_vl", "paddleocr_vl"])
def test_plain_grid_next_to_split_inputs(name):
    """``image_grid_thw`` passed as a plain tensor (the same on every rank), the rest split over "data": sizes
    computed from it (``[h * w for h, w in zip(hs, ws)]``) reach distributed ops as plain tensors, read as
    numbers as paddle reads them."""
    data = batch(name)
    ref = reference(name)
    with ap.simulate(world_size=4):
        mesh = pf.mesh_2x2()
        model = ap.shard_layer(pf.vl_build(name), mesh, pf.vl_shard_fn)
        inputs = _inputs(data, mesh)
        inputs["image_grid_thw"] = paddle.to_tensor(data["image_grid_thw"])
        loss = pf.loss_of(model(**inputs))
        loss.backward()
        ap.reduce_gradients(model.parameters())
        got = float(loss), _grads(model)
    assert pf.compare(ref[:2], got, RTOL, ATOL) == []


def test_negative_control_unreduced_gradients_differ():
    ref = reference("qwen2_5_vl")
    got = seed_sharded("qwen2_5_vl", reduce_grads=False)
    bad = pf.compare(ref[:2], got[:2], RTOL, ATOL)
    assert "loss" not in bad and any("visual" in n for n in bad)


def _after_step_close(name, ref_params, got_params, ref_grads):
    """Parameters after one AdamW step: tight where the gradient is not noise; where it is (|g| < 1e-6, e.g. a
    key bias, whose exact gradient is 0), AdamW's g / (|g| + eps) may take either sign: within 2 lr."""
    for n, p in ref_params.items():
        noise = np.abs(ref_grads[n]) < 1e-6
        diff = np.abs(got_params[n] - p)
        assert np.all(diff[noise] <= 2 * LR + ATOL), n
        np.testing.assert_allclose(got_params[n][~noise], p[~noise], rtol=RTOL, atol=ATOL, err_msg=f"{name} {n}")


def _parallelized_run(name, strategy, **kwargs):
    model = pf.vl_build(name)
    opt = paddle.optimizer.AdamW(LR, parameters=model.parameters())
    model, opt = ap.parallelize(model, opt, strategy=strategy, **kwargs)
    data = batch(name)
    loss = pf.loss_of(model(**_inputs(data)))
    loss.backward()
    opt.reduce_gradients()
    grads = _grads(model)
    opt.step()
    opt.clear_grad()
    loss2 = float(pf.loss_of(model(**_inputs(data))))
    params = {n: (p.full().numpy() if hasattr(p, "full") else p.numpy()) for n, p in model.named_parameters()}
    return model, (float(loss), grads, loss2, params)


@pytest.mark.parametrize("name", ["qwen2_5_vl", "glm4v_moe"])
def test_parallelize_dp_tp_adamw_step_equals_one_process(name):
    from autoparallel.testing.paddleformers_runs import strategy

    ref = reference(name)
    with ap.simulate(world_size=4):
        _, got = _parallelized_run(name, strategy(dp=2, tp=2))
    assert pf.compare(ref[:2], got[:2], RTOL, ATOL) == []
    assert np.isclose(got[2], ref[2], rtol=RTOL, atol=ATOL) and got[2] < got[0]
    _after_step_close(name, ref[3], got[3], ref[1])


def test_full_mode_equals_one_process(name="glm_ocr"):
    """The planner reads a vision-language model as no stack of blocks (its text-only trace skips the vision
    tower) and says so; it chooses data parallelism over the 4 ranks, which trains like one process."""
    s = ap.Strategy()
    s.auto_mode = "full"
    s.global_batch_size = 4
    ref = reference(name)
    with ap.simulate(world_size=4):
        model, got = _parallelized_run(name, s, seq_len=12)
        chosen = ap.chosen_strategy(model)
    assert chosen.data_parallel.degree * chosen.tensor_parallel.degree == 4
    assert pf.compare(ref[:2], got[:2], RTOL, ATOL) == []
    assert np.isclose(got[2], ref[2], rtol=RTOL, atol=ATOL)
    _after_step_close(name, ref[3], got[3], ref[1])


def _conditional_generation_families() -> set:
    """Family dirs of the installed PaddleFormers whose modeling defines a *ForConditionalGeneration class."""
    import pathlib
    import re

    import paddleformers.transformers as t

    root = pathlib.Path(t.__file__).parent
    out = set()
    for mod in list(root.glob("*/modeling*.py")) + list(root.glob("*/model/modeling*.py")):
        fam = mod.parent.parent if mod.parent.name == "model" else mod.parent
        if re.search(r"^class \w+ForConditionalGeneration\w*\(", mod.read_text(), re.M):
            out.add(fam.name)
    out.discard("auto")                  # the Auto* dispatchers, not a family
    return out


def test_every_vision_language_family_runs_or_is_a_named_skip():
    vl = set(pf.NOT_TEXT) - set(SPEECH)
    assert vl <= set(pf.VL_MODELS) | set(pf.VL_SKIPPED)
    assert not set(pf.VL_MODELS) & set(pf.VL_SKIPPED)
    found = _conditional_generation_families()
    assert {"qwen2_5_vl", "ernie4_5_moe_vl", "paddleocr_vl"} <= found          # the scan finds what it should
    assert found - set(pf.VL_MODELS) - set(pf.VL_SKIPPED) - set(pf.SKIPPED) == set()   # qwen3_5*: paddlefleet


def test_processor_only_skips_have_no_modeling():
    import importlib.util

    for name, why in pf.VL_SKIPPED.items():
        if "no modeling" in why:
            assert importlib.util.find_spec(f"paddleformers.transformers.{name}") is not None
            assert importlib.util.find_spec(f"paddleformers.transformers.{name}.modeling") is None


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="the skip is about a CPU build of paddle")
def test_ernie_vl_skip_names_a_kernel_missing_on_cpu():
    from paddle.incubate.nn.functional import moe_gate_dispatch

    with pytest.raises(RuntimeError, match="moe_gate_dispatch.*not registered"):
        moe_gate_dispatch(paddle.randn([4, 8]), paddle.randn([4, 2]), None, 2, 4, True, False)


def test_images_and_videos_qwen2_5_vl(name="qwen2_5_vl"):
    """A 2-frame video per sample next to its image (``pixel_values_videos``, ``video_grid_thw``, 8 video tokens):
    the seed shard function on the 2x2 mesh equals one process."""
    data = pf.vl_batch(name, grids=GRIDS, t=24)
    for i in range(4):
        data["input_ids"][i, 10], data["input_ids"][i, 19] = pf.VL_START, pf.VL_END
        data["input_ids"][i, 11:19] = pf.VL_VIDEO
    data["pixel_values_videos"] = np.random.default_rng(5).standard_normal((4 * 32, 24)).astype("float32")
    data["video_grid_thw"] = np.array([(2, 4, 4)] * 4, "int64")
    model = pf.vl_build(name)
    loss = pf.loss_of(model(**_inputs(data)))
    loss.backward()
    ref = float(loss), _grads(model)
    with ap.simulate(world_size=4):
        mesh = pf.mesh_2x2()
        model = ap.shard_layer(pf.vl_build(name), mesh, pf.vl_shard_fn)
        loss = pf.loss_of(model(**_inputs(data, mesh)))
        loss.backward()
        ap.reduce_gradients(model.parameters())
        got = float(loss), _grads(model)
    assert pf.compare(ref, got, RTOL, ATOL) == []
