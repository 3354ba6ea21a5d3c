"""PaddleFormers' own PEFT (``LoRAModel``) on a tiny Llama, then ``ap.parallelize``: losses, the LoRA parameters
after 3 AdamW steps and the frozen base (bit for bit) equal one process under DP x TP (default plan and a plan
naming the projections), ZeRO and an optimizer given only the trainable parameters; column-parallel projections
split ``lora_B`` like their weight and row-parallel ones ``lora_A``, with no all_gather in a step; ``merge()`` /
``unmerge()`` after training equal one process's; ``save_pretrained`` loads into one process with equal outputs."""
import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.comm.counter import count_collectives
from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")
TARGETS = [".*q_proj.*", ".*v_proj.*", ".*o_proj.*"]
COL = ap.ColWiseParallel()
PLAN = {"q_proj": COL, "k_proj": COL, "v_proj": COL, "o_proj": ap.RowWiseParallel(), "gate_proj": COL,
        "up_proj": COL, "down_proj": ap.RowWiseParallel()}


def lora_model(**cfg):
    from paddleformers.peft import LoRAConfig, LoRAModel

    model = pf.build("llama", 0)
    paddle.seed(1)
    return LoRAModel(model, LoRAConfig(**{"target_modules": TARGETS, "r": 4, "lora_alpha": 8, **cfg}))


def params(m):
    return {n: (p.full() if ap.is_dist(p) else p).numpy() for n, p in m.named_parameters()}


def loss_on(m, seed):
    ids, labels = pf.batch(seed)
    return pf.loss_of(m(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))


def train(dp=None, tp=1, stage=0, plan=None, trainable_only=False, cfg=None):
    m = lora_model(**(cfg or {}))
    start = params(m)
    ps = [p for p in m.parameters() if not p.stop_gradient] if trainable_only else m.parameters()
    opt = paddle.optimizer.AdamW(1e-3, parameters=ps)
    if dp is not None:
        s = ap.Strategy()
        s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
        s.sharding.enable, s.sharding.stage = bool(stage), stage or 1
        m, opt = ap.parallelize(m, opt, strategy=s, tp_plan=plan)
    losses, gathers = [], 0
    for _ in range(3):
        with count_collectives() as calls:
            loss = loss_on(m, 0)
            loss.backward()
            opt.step()
            opt.clear_grad()
        gathers += sum(v for (kind, _), v in calls.per_group().items() if kind == "all_gather")
        losses.append(float(loss))
    return losses, start, params(m), m, gathers


def check(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert set(got[2]) == set(want[2])
    for n, v in want[2].items():
        np.testing.assert_allclose(got[2][n], v, rtol=1e-4, atol=2e-5, err_msg=n)
        if "lora" not in n:
            np.testing.assert_array_equal(got[2][n], want[1][n], err_msg=f"frozen {n} moved")
    assert any(not np.array_equal(want[2][n], want[1][n]) for n in want[2] if "lora_B" in n)   # trained


@pytest.fixture(scope="module")
def want():
    return train()


RUNS = {"dp2 x tp2 default plan": dict(dp=2, tp=2), "dp2 x tp2 named plan": dict(dp=2, tp=2, plan=PLAN),
        "dp2 x tp2 zero2, trainable only": dict(dp=2, tp=2, stage=2, trainable_only=True),
        "dp4 zero3": dict(dp=4, stage=3)}


@pytest.mark.parametrize("run", list(RUNS))
def test_lora_model_under_parallelize_equals_one_process(run, want):
    with ap.simulate(world_size=4):
        got = train(**RUNS[run])
        if RUNS[run].get("tp", 1) > 1:
            attn = got[3].model.model.layers[0].self_attn
            assert [str(p) for p in attn.q_proj.lora_B.placements] == ["R", "S(1)"]
            assert [str(p) for p in attn.o_proj.lora_A.placements] == ["R", "S(0)"]
            assert [str(p) for p in attn.o_proj.lora_B.placements] == ["R", "R"]
            if not RUNS[run].get("stage"):      # (ZeRO gathers its updated chunks)
                assert got[4] == 0, "a step gathered (an adapter left replicated next to a split weight)"
    check(got, want)


@pytest.mark.parametrize("dp,tp,stage", [(2, 2, 0), (4, 1, 3)], ids=["dp2 x tp2", "dp4 zero3"])
def test_merge_and_unmerge_after_training_equal_one_process(dp, tp, stage):
    """merge() writes ``W + A @ B * scale`` into the split (or ZeRO-3 released) frozen weight."""
    ref = lora_model()
    opt = paddle.optimizer.AdamW(1e-3, parameters=ref.parameters())
    for _ in range(2):
        loss_on(ref, 0).backward()
        opt.step()
        opt.clear_grad()
    ref.merge()
    merged, merged_loss = params(ref), float(loss_on(ref, 1))
    with ap.simulate(world_size=4):
        m = lora_model()
        opt = paddle.optimizer.AdamW(1e-3, parameters=m.parameters())
        s = ap.Strategy()
        s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
        s.sharding.enable, s.sharding.stage = bool(stage), stage or 1
        m, opt = ap.parallelize(m, opt, strategy=s)
        for _ in range(2):
            loss_on(m, 0).backward()
            opt.step()
            opt.clear_grad()
        unmerged = params(m)
        m.merge()
        got, got_loss = params(m), float(loss_on(m, 1))
        m.unmerge()
        back = params(m)
    assert not np.allclose(merged["model.model.layers.0.self_attn.q_proj.weight"],
                           unmerged["model.model.layers.0.self_attn.q_proj.weight"], atol=1e-6)   # merge changes W
    for n, v in merged.items():
        np.testing.assert_allclose(got[n], v, rtol=1e-4, atol=2e-5, err_msg=n)
        np.testing.assert_allclose(back[n], unmerged[n], rtol=1e-5, atol=1e-6, err_msg=n)
    np.testing.assert_allclose(got_loss, merged_loss, rtol=1e-5)


def test_save_pretrained_from_a_parallelized_model_loads_into_one_process(tmp_path, want):
    from paddleformers.peft import LoRAModel

    with ap.simulate(world_size=4):
        got = train(dp=2, tp=2)
        got[3].save_pretrained(str(tmp_path))
    fresh = LoRAModel.from_pretrained(pf.build("llama", 0), str(tmp_path))
    ref = lora_model()
    paddle.nn.Layer.set_state_dict(ref, {n: paddle.to_tensor(v) for n, v in want[2].items()})
    np.testing.assert_allclose(float(loss_on(fresh, 1)), float(loss_on(ref, 1)), rtol=1e-5)
    untrained = lora_model()
    assert not np.isclose(float(loss_on(fresh, 1)), float(loss_on(untrained, 1)), rtol=1e-6)   # negative control


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_frozen_weights_cost_no_communication_per_step(stage):
    """Data parallel and ZeRO-1/2 move only the adapters' gradients and chunks in a step: the frozen weights
    (40x the adapters here) are neither reduced nor gathered again (ZeRO's post-step gather took them all)."""
    with ap.simulate(world_size=4):
        m = lora_model()
        opt = paddle.optimizer.AdamW(1e-3, parameters=m.parameters())
        s = ap.Strategy()
        s.data_parallel.degree = 4
        s.sharding.enable, s.sharding.stage = bool(stage), stage or 1
        m, opt = ap.parallelize(m, opt, strategy=s)
        for step in range(2):
            with count_collectives() as calls:
                loss_on(m, 0).backward()
                opt.step()
                opt.clear_grad()
        trainable = sum(4 * int(np.prod(p.global_shape)) for p in m.parameters() if not p.stop_gradient)
        frozen = sum(4 * int(np.prod(p.global_shape)) for p in m.parameters() if p.stop_gradient)
    assert frozen > 20 * trainable
    assert calls.bytes_sent(0) < 3 * trainable, (calls.bytes_sent(0), trainable)


def test_checkpoint_of_split_adapters_loads_into_another_layout(tmp_path, want):
    """ap.save_state_dict under dp2 x tp2 (lora_B split), ap.load_state_dict under tp4: the trained values."""
    with ap.simulate(world_size=4):
        got = train(dp=2, tp=2)
        ap.save_state_dict(got[3].state_dict(), str(tmp_path / "ck"))
    with ap.simulate(world_size=4):
        m = lora_model()
        s = ap.Strategy()
        s.tensor_parallel.degree = 4
        m, _ = ap.parallelize(m, paddle.optimizer.AdamW(1e-3, parameters=m.parameters()), strategy=s)
        assert [str(p) for p in m.model.model.layers[0].self_attn.q_proj.lora_B.placements] == ["R", "S(1)"]
        ap.load_state_dict(m.state_dict(), str(tmp_path / "ck"))
        loaded = params(m)
    for n, v in want[2].items():
        np.testing.assert_allclose(loaded[n], v, rtol=1e-4, atol=2e-5, err_msg=n)
