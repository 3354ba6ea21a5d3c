"""ZeRO and pipeline checkpoints in one process (the simulated world holds every rank).

A ZeRO checkpoint after one step holds the single-process run's parameters and AdamW states under the same
names, for every stage, degree (HSDP), offload and with tensor parallelism; checkpoints move between ZeRO
layouts and to one process bit for bit and the loaded model gives the reference's next loss; a load reads
only the bytes of the boxes it needs; a pipeline run in one process saves under the model's names.
"""
import dataclasses

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from autoparallel import layer_state
import autoparallel as ap
from autoparallel.checkpoint import (CheckpointMismatchError, load_merged_state_dict, load_state_dict,
                                     save_state_dict, training_state)
from autoparallel.checkpoint.layout import flat_range_boxes
from autoparallel.checkpoint.leaves import ELSEWHERE
from autoparallel.checkpoint.state import paddle_optimizer
from autoparallel.parallel.pipeline.runtime import apply_pp
from autoparallel.parallel.sharding import apply_zero
from autoparallel.parallelize import parallelize
from examples.models import PRESETS, build

RNG = np.random.default_rng(0)
VOCAB = 250                           # 250 x 32 rows do not split evenly: chunks end inside rows
BATCH = (RNG.integers(0, VOCAB, (8, 16)), RNG.integers(0, VOCAB, (8, 16)))


def tiny(seed=0):
    paddle.seed(seed)
    return build(dataclasses.replace(PRESETS["gpt-tiny"], vocab_size=VOCAB))


def loss_of(model):
    x, y = BATCH
    return F.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y))


def step(model, opt):
    loss_of(model).backward()
    opt.step()
    opt.clear_grad()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One AdamW step in one process: its merged checkpoint and the next loss."""
    path = str(tmp_path_factory.mktemp("ref") / "ckpt")
    m = tiny()
    opt = paddle.optimizer.AdamW(3e-3, parameters=m.parameters())
    step(m, opt)
    save_state_dict(training_state(m, opt), path)
    return path, load_merged_state_dict(path, flat=True), float(loss_of(m))


def zero_run(stage, dp, tp=1, degree=None, offload=False, train=True, seed=0):
    """(model, ZeRO optimizer) in the simulated world (call inside ap.simulate)."""
    m = tiny(seed)
    opt = paddle.optimizer.AdamW(3e-3, parameters=m.parameters())
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    m, opt = parallelize(m, opt, strategy=s)
    z = apply_zero(m, opt, layer_state.mesh_of(m), stage, degree=degree, offload=offload)
    if train:
        step(m, z)
    return m, z


def test_flat_range_boxes_tile_the_range_in_order():
    rng = np.random.default_rng(1)
    for _ in range(500):
        shape = tuple(int(s) for s in rng.integers(1, 5, rng.integers(0, 4)))
        n = int(np.prod(shape))
        a = int(rng.integers(0, n + 1))
        b = int(rng.integers(a, n + 1))
        flat = np.arange(n).reshape(shape)
        pos = a
        boxes = flat_range_boxes(shape, a, b)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        for off, s, f in boxes:
            got = flat[tuple(slice(o, o + k) for o, k in zip(off, s))].reshape(-1)
            assert f == pos and np.array_equal(got, np.arange(f, f + got.size))
            pos += got.size
        assert pos == b
    with pytest.raises(ValueError, match=r"flat range \[3, 9\) is outside an array of shape \[2, 4\]"):
        flat_range_boxes((2, 4), 3, 9)


@pytest.mark.parametrize("stage,dp,tp,degree,offload", [(1, 4, 1, None, False), (2, 2, 2, None, False),
                                                        (3, 4, 1, None, True), (3, 2, 2, None, False),
                                                        (2, 4, 1, 2, False)])
def test_zero_checkpoint_holds_the_single_process_state(tmp_path, reference, stage, dp, tp, degree, offload):
    _, want, _ = reference
    with ap.simulate(world_size=dp * tp):
        m, z = zero_run(stage, dp, tp, degree, offload)
        save_state_dict(training_state(m, z), str(tmp_path / "z"))
    got = load_merged_state_dict(str(tmp_path / "z"), flat=True)
    assert sorted(got) == sorted(want)
    assert {n.rsplit("/", 1)[-1] for n in got if n.startswith("optimizer/")} == \
        {"moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc"}
    for name, value in want.items():
        # one Adam step moves a parameter by about lr = 3e-3; the k-bias gradients are rounding noise that
        # Adam scales up, so parameters agree to 1e-5 and moments to float32 reduction-order rounding
        atol = 1e-5 if name.startswith("model/") else 1e-7
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=atol, err_msg=name)


def test_checkpoints_move_between_zero_layouts_and_one_process_exactly(tmp_path, reference):
    src, want, next_loss = reference
    chain = [(3, 2, 2, None, False), (2, 4, 1, 2, False), (1, 4, 1, None, True), (3, 4, 1, None, False)]
    for i, (stage, dp, tp, degree, offload) in enumerate(chain):
        out = str(tmp_path / f"c{i}")
        with ap.simulate(world_size=dp * tp):
            m, z = zero_run(stage, dp, tp, degree, offload, train=False, seed=7)     # other initial values
            state = training_state(m, z)
            load_state_dict(state, src)
            save_state_dict(state, out)
            loss = float(loss_of(m))
        got = load_merged_state_dict(out, flat=True)
        assert [n for n in want if not np.array_equal(got[n], want[n])] == [], (stage, dp, tp, degree)
        assert loss == pytest.approx(next_loss, rel=1e-5), (stage, dp, tp, degree)
        src = out
    m = tiny(seed=7)
    opt = paddle.optimizer.AdamW(3e-3, parameters=m.parameters())
    state = training_state(m, opt)
    load_state_dict(state, src)
    assert float(loss_of(m)) == pytest.approx(next_loss, rel=1e-5)
    for name, leaf in ((n, p) for n, p in m.named_parameters()):
        assert np.array_equal(leaf.numpy(), want["model/" + name]), name


def test_training_continues_after_loading_into_zero(tmp_path, reference):
    """Optimizer states loaded into the chunks drive the next step like the reference's own."""
    src, _, _ = reference
    m = tiny()
    opt = paddle.optimizer.AdamW(3e-3, parameters=m.parameters())
    load_state_dict(training_state(m, opt), src)
    step(m, opt)
    want = float(loss_of(m))
    with ap.simulate(world_size=4):
        zm, z = zero_run(3, 2, 2, train=False, seed=7)
        load_state_dict(training_state(zm, z), src)
        step(zm, z)
        got = float(loss_of(zm))
    assert got == pytest.approx(want, rel=1e-5)
    assert got != pytest.approx(float(reference[2]), rel=1e-4)      # the step changed the loss


def test_a_load_reads_only_the_boxes_it_needs(tmp_path):
    with ap.simulate(world_size=4):
        m, z = zero_run(2, 4)
        save_state_dict(training_state(m, z), str(tmp_path / "z"), block_bytes=64)
    full = load_merged_state_dict(str(tmp_path / "z"), flat=True)
    name = "optimizer/blocks.0.mlp.fc1.weight/moment1"
    target = paddle.zeros(full[name].shape, "float32")
    info = load_state_dict({"optimizer": {"blocks.0.mlp.fc1.weight": {"moment1": target}}}, str(tmp_path / "z"),
                           strict=False)
    assert np.array_equal(target.numpy(), full[name])
    total = sum(a.nbytes for a in full.values() if isinstance(a, np.ndarray))
    # four chunks, each read as whole 64-byte checksum blocks
    assert full[name].nbytes <= info.bytes_read <= full[name].nbytes + 4 * 2 * 64 < total / 10


def test_pipeline_in_one_process_saves_under_the_model_names(tmp_path, reference):
    _, want, _ = reference
    m = tiny()
    opt = paddle.optimizer.AdamW(3e-3, parameters=m.parameters())
    s = ap.Strategy()
    s.pipeline_parallel.degree, s.pipeline_parallel.micro_batches = 2, 2
    pipe = apply_pp(m, s)                          # one process runs both stages
    popt = pipe.wrap_optimizer(opt)
    x, y = BATCH
    pipe.train_batch(paddle.to_tensor(x), paddle.to_tensor(y))
    popt.step()
    popt.clear_grad()
    save_state_dict(training_state(pipe, popt), str(tmp_path / "pp"))
    got = load_merged_state_dict(str(tmp_path / "pp"), flat=True)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_bad_input(tmp_path, reference):
    src, _, _ = reference
    with ap.simulate(world_size=4):
        m, z = zero_run(2, 4, train=False)
        with pytest.raises(ValueError, match="not of the given GPT"):
            training_state(tiny(), z)
    with pytest.raises(TypeError, match="expected a paddle optimizer or an ap wrapper of one, got dict"):
        paddle_optimizer({})
    with pytest.raises(CheckpointMismatchError, match=r"missing from the checkpoint: \['model/nowhere'\]"):
        load_state_dict({"model": {"nowhere": ELSEWHERE}}, src, strict=False)


def test_ranks_disagreeing_on_an_entry_fail_the_save():
    from autoparallel.checkpoint.errors import CheckpointSaveError
    from autoparallel.checkpoint.save import _union

    meta = {"tensors": {"a": {"shape": [2], "dtype": "float32"}}, "values": {}}
    _union(meta, {"tensors": {"b": {"shape": [3], "dtype": "int64", "shards": []}}, "values": {"v": 1}}, "ck")
    assert meta["tensors"]["b"] == {"shape": [3], "dtype": "int64"} and meta["values"] == {"v": 1}
    with pytest.raises(CheckpointSaveError, match="ranks disagree on 'a'"):
        _union(meta, {"tensors": {"a": {"shape": [4], "dtype": "float32"}}}, "ck")


@pytest.mark.parametrize("stage", [2, 3])
def test_low_precision_parameters_keep_their_fp32_master_weights(tmp_path, stage):
    """float16 parameters: paddle's multi_precision keys moments by the master weight; ZeRO's fp32 chunk is
    that master weight. Both name them alike and a checkpoint moves between them bit for bit."""
    def half(seed):
        m = tiny(seed)
        m.to(dtype="float16")
        return m

    m = half(0)
    opt = paddle.optimizer.AdamW(3e-3, parameters=m.parameters(), multi_precision=True)
    state = training_state(m, opt)
    rng = np.random.default_rng(2)          # paddle's CPU AdamW cannot step float16: distinct values by hand
    for name, accs in state["optimizer"].items():
        for acc, t in accs.items():
            if acc == "master_weight":      # within a quarter float16 step of the parameter, as after a step
                p16 = state["model"][name].numpy()
                step = np.spacing(p16).astype("float32") / 4
                t.set_value(p16.astype("float32") + step * rng.choice([-1, 1], p16.shape).astype("float32"))
            else:
                t.set_value(rng.standard_normal(t.shape).astype("float32"))
    save_state_dict(state, str(tmp_path / "ref"))
    want = load_merged_state_dict(str(tmp_path / "ref"), flat=True)
    assert "optimizer/wte.weight/master_weight" in want and "optimizer/wte.weight/moment1" in want
    master, param = want["optimizer/wte.weight/master_weight"], want["model/wte.weight"]
    assert master.dtype == np.float32 and param.dtype == np.float16
    assert not np.array_equal(master, param.astype(np.float32))     # the master carries more than the parameter
    with ap.simulate(world_size=2):
        zm = half(3)
        zopt = paddle.optimizer.AdamW(3e-3, parameters=zm.parameters(), multi_precision=True)
        s = ap.Strategy()
        s.data_parallel.degree = 2
        zm, zopt = parallelize(zm, zopt, strategy=s)
        z = apply_zero(zm, zopt, layer_state.mesh_of(zm), stage)
        zstate = training_state(zm, z)
        load_state_dict(zstate, str(tmp_path / "ref"))
        save_state_dict(zstate, str(tmp_path / "z"))
    got = load_merged_state_dict(str(tmp_path / "z"), flat=True)
    assert sorted(got) == sorted(want)
    assert [n for n in want if not np.array_equal(got[n], want[n])] == []
