"""``paddle.nn.LSTM`` / ``GRU`` / ``SimpleRNN`` on distributed tensors (spmd_rules/composites_rnn.py): outputs,
final states and every weight's gradient equal one process's (its fused rnn op, or its python path where paddle
takes that one), with the batch split over data-parallel ranks, for each direction, depth, projection,
``time_major``, ``sequence_length`` and given initial states; a text classifier with an LSTM trains like one
process under ``parallelize`` and ``auto_mode="full"``."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap

CASES = [(paddle.nn.LSTM, {}), (paddle.nn.LSTM, {"direction": "bidirect", "num_layers": 2, "proj_size": 3}),
         (paddle.nn.GRU, {"direction": "bidirect", "num_layers": 2}), (paddle.nn.SimpleRNN, {"time_major": True}),
         (paddle.nn.SimpleRNN, {"activation": "relu", "num_layers": 2}), (paddle.nn.GRU, {"num_layers": 3, "time_major": True})]


def _run(layer, x, sl, h0):
    out, st = layer(x, initial_states=h0, sequence_length=sl)
    st = list(st) if isinstance(st, tuple) else [st]
    (out.sum() + sum((s * s).sum() for s in st)).backward()
    return out, st


def _inputs(kw, use_len):
    rng = np.random.default_rng(1)
    shape = [3, 4, 6] if kw.get("time_major") else [4, 3, 6]
    x = paddle.to_tensor(rng.standard_normal(shape).astype("float32"))
    sl = paddle.to_tensor([3, 1, 2, 3]) if use_len else None
    return x, sl


@pytest.mark.parametrize("use_len", [False, True], ids=["full-length", "sequence_length"])
@pytest.mark.parametrize("cls,kw", CASES, ids=lambda v: v.__name__ if isinstance(v, type) else str(v))
def test_rnn_layer_with_a_batch_split_equals_one_process(cls, kw, use_len):
    x, sl = _inputs(kw, use_len)
    paddle.seed(0)
    layer = cls(6, 5, **kw)
    out, st = _run(layer, x, sl, None)
    want = [out.numpy()] + [s.numpy() for s in st]
    want_grads = {n: p.grad.numpy().copy() for n, p in layer.named_parameters()}
    layer.clear_gradients()
    batch = 1 if kw.get("time_major") else 0
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        xd = ap.shard_tensor(x, mesh, [ap.Shard(batch)])
        sld = None if sl is None else ap.shard_tensor(sl, mesh, [ap.Shard(0)])
        out, st = _run(layer, xd, sld, None)
        assert out.placements == [ap.Shard(batch)] and all(s.placements == [ap.Shard(1)] for s in st)
        got = [out.full().numpy()] + [s.full().numpy() for s in st]
        grads = {n: p.grad.numpy() for n, p in layer.named_parameters()}
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for n, g in want_grads.items():
        np.testing.assert_allclose(grads[n], g, rtol=1e-4, atol=1e-6, err_msg=n)


def test_outputs_past_a_sequence_length_are_what_one_process_gives_zero_for_the_fused_op_only():
    """The fused op zeroes outputs past a sequence's length; paddle's python path (LSTM with ``proj_size``)
    does not. Both are mirrored: a negative control that the two behaviours really differ."""
    x, sl = _inputs({}, True)
    for kw, zero in (({}, True), ({"proj_size": 3}, False)):
        paddle.seed(0)
        layer = paddle.nn.LSTM(6, 5, **kw)
        with ap.simulate(world_size=2):
            mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
            out, _ = layer(ap.shard_tensor(x, mesh, [ap.Shard(0)]), sequence_length=sl)
            past = out.full().numpy()[1, 1:]                 # sample 1 has length 1
        assert (np.abs(past).max() == 0) == zero, kw


def test_given_initial_states_and_a_plain_sequence_length_with_a_split_batch():
    x, sl = _inputs({}, True)
    rng = np.random.default_rng(2)
    h0, c0 = (paddle.to_tensor(rng.standard_normal([2, 4, 5]).astype("float32")) for _ in range(2))
    paddle.seed(0)
    layer = paddle.nn.LSTM(6, 5, direction="bidirect")
    out, st = _run(layer, x, sl, (h0, c0))
    want = [out.numpy()] + [s.numpy() for s in st]
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        states = tuple(ap.shard_tensor(s, mesh, [ap.Shard(1)]) for s in (h0, c0))
        out, st = _run(layer, ap.shard_tensor(x, mesh, [ap.Shard(0)]), sl, states)
        got = [out.full().numpy()] + [s.full().numpy() for s in st]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        with pytest.raises(ValueError, match=r"initial_states must be 2 tensor\(s\) \(\(h, c\)\), got 1"):
            layer(ap.shard_tensor(x, mesh, [ap.Shard(0)]), initial_states=h0)


class TextClassifier(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed = paddle.nn.Embedding(30, 8, padding_idx=0)
        self.rnn = paddle.nn.LSTM(8, 6, num_layers=2, direction="bidirect")
        self.head = paddle.nn.Linear(12, 3)

    def forward(self, ids, lengths):
        out, _ = self.rnn(self.embed(ids), sequence_length=lengths)
        return self.head(out.sum(axis=1) / lengths.astype("float32").unsqueeze(-1))


def _batch():
    rng = np.random.default_rng(3)
    lengths = np.array([5, 2, 4, 1, 3, 5, 2, 4])
    ids = rng.integers(1, 30, (8, 5)) * (np.arange(5)[None] < lengths[:, None])
    return paddle.to_tensor(ids), paddle.to_tensor(lengths), paddle.to_tensor(rng.integers(0, 3, (8,)))


def _train(model, opt, ids, lengths, y, steps=3):
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(ids, lengths), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("mode", ["dp", "full"])
def test_text_classifier_with_an_lstm_trains_like_one_process(mode):
    ids, lengths, y = _batch()
    paddle.seed(0)
    ref = TextClassifier()
    want = _train(ref, paddle.optimizer.Adam(0.01, parameters=ref.parameters()), ids, lengths, y)
    s = ap.Strategy()
    if mode == "full":
        s.auto_mode, s.global_batch_size = "full", 8
    else:
        s.data_parallel.degree = 4
    with ap.simulate(world_size=4):
        paddle.seed(0)
        model = TextClassifier()
        opt = paddle.optimizer.Adam(0.01, parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=s, seq_len=5 if mode == "full" else None)
        got = _train(model, opt, ids, lengths, y)
        params = {n: p.full().numpy() for n, p in model.named_parameters()}
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(params[n], p.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)


@pytest.mark.parametrize("build", [lambda: paddle.nn.RNN(paddle.nn.LSTMCell(6, 5)),
                                   lambda: paddle.nn.BiRNN(paddle.nn.GRUCell(6, 5), paddle.nn.GRUCell(6, 5))],
                         ids=["RNN(LSTMCell)", "BiRNN(GRUCell)"])
def test_cell_wrappers_with_a_split_batch_equal_one_process(build):
    """``paddle.nn.RNN`` / ``BiRNN`` over cells run paddle's python loop, whose ops all have rules."""
    x, sl = _inputs({}, True)
    paddle.seed(0)
    layer = build()
    out, _ = layer(x, sequence_length=sl)
    out.sum().backward()
    want, want_grads = out.numpy(), {n: p.grad.numpy().copy() for n, p in layer.named_parameters()}
    layer.clear_gradients()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
        out, _ = layer(ap.shard_tensor(x, mesh, [ap.Shard(0)]), sequence_length=sl)
        out.sum().backward()
        got, grads = out.full().numpy(), {n: p.grad.numpy() for n, p in layer.named_parameters()}
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for n, g in want_grads.items():
        np.testing.assert_allclose(grads[n], g, rtol=1e-4, atol=1e-6, err_msg=n)
