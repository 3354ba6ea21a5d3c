"""``auto_mode="full"`` on models the language-model reading cannot trace prices them as the sum of their stacks
(autoparallel/planner/stacks.py): the step times of every dp x tp against a hand count of the Linears, the
choice (tensor parallelism when it pays, data parallelism when it does not), and a vision-language model
trained under the chosen plan equal to one process."""
import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.planner.auto import resolve_cluster
from autoparallel.planner.cost_model import affine_seconds
from autoparallel.planner.generic import data_parallel_choice
from autoparallel.planner.options import options_for_cluster
from autoparallel.planner.stacks import price, read_stacks
from autoparallel.testing import paddleformers_models as pf


class Attn(paddle.nn.Layer):
    def __init__(self, d):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (paddle.nn.Linear(d, d) for _ in range(4))


class Block(paddle.nn.Layer):
    def __init__(self, d, cross):
        super().__init__()
        self.norm, self.mix = paddle.nn.LayerNorm(d), Attn(d)
        self.cross = Attn(d) if cross else None
        self.w_in, self.w_out = paddle.nn.Linear(d, 4 * d), paddle.nn.Linear(4 * d, d)


class EncDec(paddle.nn.Layer):
    """Two encoder blocks (attention + MLP: 12 d^2 weights, 6 TP all_reduces of d floats a token) and two
    decoder blocks (+ cross attention: 16 d^2, 10 all_reduces); names no family table knows."""

    def __init__(self, d):
        super().__init__()
        self.enc = paddle.nn.LayerList([Block(d, False) for _ in range(2)])
        self.dec = paddle.nn.LayerList([Block(d, True) for _ in range(2)])


def _model(d):
    with paddle.LazyGuard():
        return EncDec(d)


def _hand(cluster, d, batch, seq, dp, tp):
    """(compute, tp all_reduce, dp gradient) seconds from the count in EncDec's docstring."""
    eff = options_for_cluster(cluster).gemm_efficiency
    split, widths, calls = 2 * 12 * d * d + 2 * 16 * d * d, (2 * 6 + 2 * 10) * d, 2 * 6 + 2 * 10
    total = sum(int(np.prod(p.shape)) for p in _model(d).parameters())
    tokens = batch // dp * seq
    compute = 6 * tokens * split / tp / (cluster.device.flops("float32") * eff)
    tp_s = dp_s = 0.0
    if tp > 1:
        lat, per = affine_seconds(cluster, "all_reduce", tp, range(tp))
        tp_s = calls * lat + widths * tokens * 4 * per
    if dp > 1:
        lat, per = affine_seconds(cluster, "all_reduce", dp, range(0, dp * tp, tp))
        dp_s = lat + (split / tp + total - split) * 4 * per
    return compute, tp_s, dp_s


@pytest.mark.parametrize("d", [32, 2048])
def test_prices_equal_the_hand_count(d):
    cluster = resolve_cluster("1x4:A100-80GB", 4, "nccl")
    eff = options_for_cluster(cluster).gemm_efficiency
    model = _model(d)
    for dp, tp in [(4, 1), (2, 2), (1, 4)]:
        got = price(model, cluster, 4, 16, dp, tp, eff)
        np.testing.assert_allclose([got.compute_s, got.tp_comm_s, got.dp_comm_s], _hand(cluster, d, 4, 16, dp, tp),
                                   rtol=1e-9)
    assert [(s.name, s.blocks, s.split_params) for s in read_stacks(model, 2)] == \
        [("enc", 2, 2 * 12 * d * d), ("dec", 2, 2 * 16 * d * d)]


def _choice(d, batch=4):
    s = ap.Strategy()
    s.auto_mode, s.global_batch_size = "full", batch
    cluster = resolve_cluster("1x4:A100-80GB", 4, "nccl")
    chosen, result = data_parallel_choice(_model(d), s, 4, cluster, "an encoder-decoder", seq_len=16)
    return (chosen.data_parallel.degree, chosen.tensor_parallel.degree), result.explanation


def test_tensor_parallel_when_it_pays_data_parallel_when_it_does_not():
    """d=2048: 400 MB of gradients per step against 64 kB of activations per all_reduce: tp=4 wins. d=32: the
    gradients are 200 kB and 32 all_reduces cost more latency than one: dp=4 (the negative control)."""
    cluster = resolve_cluster("1x4:A100-80GB", 4, "nccl")
    for d, want in [(2048, (1, 4)), (32, (4, 1))]:
        times = {(dp, tp): sum(_hand(cluster, d, 4, 16, dp, tp)) for dp, tp in [(4, 1), (2, 2), (1, 4)]}
        assert min(times, key=times.get) == want
        got, text = _choice(d)
        assert got == want, text
        assert "priced as the sum of its stacks" in text and "enc: 2 blocks" in text and "dec: 2 blocks" in text


def test_the_plan_head_names_the_sequence_length_it_priced():
    """The plan's head line carries the seq_len the stacks were priced at (not 0), the number of dp x tp
    layouts priced, and says so when no length was given (then nothing is priced: data parallel)."""
    s = ap.Strategy()
    s.auto_mode, s.global_batch_size = "full", 4
    cluster = resolve_cluster("1x4:A100-80GB", 4, "nccl")
    _, priced = data_parallel_choice(_model(32), s, 4, cluster, "an encoder-decoder", seq_len=16)
    assert ", seq 16; 3 configurations priced" in str(priced)
    _, unpriced = data_parallel_choice(_model(32), s, 4, cluster, "an encoder-decoder")
    assert "sequence length not given; 1 configurations priced" in str(unpriced)
    assert "seq 0" not in str(unpriced)


# ---- a vision-language model under the chosen plan equals one process --------------------------------------
def _data():
    b = pf.vl_batch("qwen3_vl", b=2, grids=[(1, 4, 4), (1, 2, 4)])
    return {k: paddle.to_tensor(v) for k, v in b.items()}


def _step(model, opt):
    loss = pf.loss_of(model(**_data()))
    loss.backward()
    if hasattr(opt, "reduce_gradients"):
        opt.reduce_gradients()
    grads = {n: pf._grad_np(p) for n, p in model.named_parameters()}
    opt.step()
    opt.clear_grad()
    return float(loss), grads, float(pf.loss_of(model(**_data())))


@pytest.mark.skipif(not pf.available(), reason="paddleformers is not installed")
def test_vl_full_mode_chosen_tensor_parallel_plan_equals_one_process():
    """Global batch 2 on 4 ranks: the priced choice is dp=2 x tp=2, which splits the vision tower's blocks (the
    fused qkv / proj attention, the linear_fc1 / linear_fc2 MLP) and the text decoder."""
    pf.install_vl_stubs()
    model = pf.vl_build("qwen3_vl")
    ref = _step(model, paddle.optimizer.AdamW(1e-3, parameters=model.parameters()))
    s = ap.Strategy()
    s.auto_mode, s.global_batch_size = "full", 2
    with ap.simulate(world_size=4):
        model = pf.vl_build("qwen3_vl")
        model, opt = ap.parallelize(model, paddle.optimizer.AdamW(1e-3, parameters=model.parameters()),
                                    strategy=s, seq_len=12)
        chosen = ap.chosen_strategy(model)
        place = {n: str(p.placements) for n, p in model.named_parameters()}
        got = _step(model, opt)
    assert (chosen.data_parallel.degree, chosen.tensor_parallel.degree) == (2, 2)
    priced = [line for line in ap.chosen_plan(model).explanation.splitlines() if line.startswith("  dp=")]
    assert priced[0].startswith("  dp=2 x tp=2") and len(priced) == 2     # cheapest first; dp=4 needs batch 4
    assert place["model.visual.blocks.1.mlp.linear_fc1.weight"] == "[R, S(1)]"
    assert place["model.visual.blocks.1.attn.proj.weight"] == "[R, S(0)]"
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for n, g in ref[1].items():
        np.testing.assert_allclose(got[1][n], g, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(g).max()), err_msg=n)
    np.testing.assert_allclose(got[2], ref[2], rtol=1e-4)
