"""auto_mode="full" on models the planner cannot read as a stack of transformer blocks fed token ids (a CNN
from paddle.vision, a ViT-like model over image patches, a BERT-style encoder fed ids and token types): it
plans data parallelism over every rank -- or, for a batch that does not split that far, dp x tp with the
model's default plan -- says why, and trains like one process; otherwise the batch is a ValueError naming it."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap


class PatchNet(paddle.nn.Layer):
    """A LayerList of blocks but images in (no token embedding): the token-id trace cannot run it."""

    def __init__(self):
        super().__init__()
        self.patch = paddle.nn.Conv2D(3, 8, 4, stride=4)
        self.cls = self.create_parameter([1, 1, 8], default_initializer=paddle.nn.initializer.Normal(std=0.5))
        self.blocks = paddle.nn.LayerList([paddle.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
                                           for _ in range(2)])
        self.head = paddle.nn.Linear(8, 5)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose([0, 2, 1])
        x = paddle.concat([self.cls.expand([x.shape[0], -1, -1]), x], axis=1)
        for b in self.blocks:
            x = b(x)
        return self.head(x[:, 0])


class Bert(paddle.nn.Layer):
    """Word + token-type + position embeddings, paddle's TransformerEncoder with a padding mask, tanh pooler."""

    def __init__(self, vocab=20, d=16):
        super().__init__()
        self.word_embeddings = paddle.nn.Embedding(vocab, d, padding_idx=0)
        self.token_type_embeddings = paddle.nn.Embedding(2, d)
        self.position_embeddings = paddle.nn.Embedding(8, d)
        layer = paddle.nn.TransformerEncoderLayer(d, 4, 32, dropout=0.0, activation="gelu")
        self.encoder = paddle.nn.TransformerEncoder(layer, 2)
        self.pooler = paddle.nn.Linear(d, d)
        self.cls = paddle.nn.Linear(d, 5)

    def forward(self, ids, token_types):
        pos = paddle.arange(ids.shape[1]).unsqueeze(0)
        x = self.word_embeddings(ids) + self.token_type_embeddings(token_types) + self.position_embeddings(pos)
        mask = paddle.unsqueeze((ids == 0).astype(x.dtype) * -1e4, axis=[1, 2])
        return self.cls(paddle.tanh(self.pooler(self.encoder(x, src_mask=mask)[:, 0])))


def test_full_mode_bert_batch_smaller_than_the_world_takes_the_default_tensor_parallel_plan(capsys):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 20, (2, 6))
    ids[:, -2:] = 0
    ids, types = paddle.to_tensor(ids), paddle.to_tensor(rng.integers(0, 2, (2, 6)))
    y = paddle.to_tensor(rng.integers(0, 5, (2,)))
    paddle.seed(0)
    ref = Bert()
    loss = F.cross_entropy(ref(ids, types), y)
    loss.backward()
    s = ap.Strategy()
    s.auto_mode, s.global_batch_size = "full", 2
    with ap.simulate(world_size=4):
        paddle.seed(0)
        model = Bert()
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=s, seq_len=6)
        got = F.cross_entropy(model(ids, types), y)
        got.backward()
        got = float(got)
        opt.reduce_gradients()
        grads = {n: p.as_dist().grad.full().numpy() for n, p in model.named_parameters()}
        chosen = ap.chosen_strategy(model)
    assert (chosen.data_parallel.degree, chosen.tensor_parallel.degree) == (2, 2)
    assert "does not split 4 ways" in capsys.readouterr().out
    assert got == pytest.approx(float(loss), rel=1e-5)
    sharded = [n for n, p in model.named_parameters() if any(not pl.is_replicated() for pl in p.placements)]
    assert any("q_proj" in n for n in sharded)                  # the plan did split the attention
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(grads[n], p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)


def _data(batch, size):
    rng = np.random.default_rng(0)
    return (paddle.to_tensor(rng.standard_normal((batch, 3, size, size)).astype("float32")),
            paddle.to_tensor(rng.integers(0, 5, (batch,)).astype("int64")))


def _one_step(model, x, y):
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    opt.step()
    return float(loss), grads, {n: p.numpy() for n, p in model.named_parameters()}


def _full(build, x, y, batch, seq_len=None):
    s = ap.Strategy()
    s.auto_mode, s.global_batch_size = "full", batch
    with ap.simulate(world_size=4):
        paddle.seed(0)
        model = build()
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=s, seq_len=seq_len)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        params = {n: p.full().numpy() for n, p in model.named_parameters()}
        return ap.chosen_strategy(model), ap.chosen_plan(model), float(loss), params


@pytest.mark.parametrize("build,size,seq_len", [(lambda: paddle.vision.models.LeNet(num_classes=5), 28, None),
                                                 (PatchNet, 8, 5)], ids=["LeNet", "patch-transformer"])
def test_full_mode_on_a_model_without_token_blocks_is_data_parallel_like_one_process(build, size, seq_len, capsys):
    x, y = _data(8, size)
    if size == 28:
        x = x[:, :1]
    paddle.seed(0)
    ref_loss, _, ref_params = _one_step(build(), x, y)
    chosen, plan, loss, params = _full(build, x, y, 8, seq_len)
    out = capsys.readouterr().out
    assert (chosen.data_parallel.degree, chosen.tensor_parallel.degree, chosen.pipeline_parallel.degree) == (4, 1, 1)
    assert "not read as a stack of blocks" in out and "dp=4" in plan.explanation
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for n, p in ref_params.items():
        np.testing.assert_allclose(params[n], p, rtol=1e-4, atol=1e-6, err_msg=n)


def test_full_mode_batch_that_does_not_split_over_the_ranks_is_refused():
    s = ap.Strategy()
    s.auto_mode, s.global_batch_size = "full", 6
    with ap.simulate(world_size=4):
        model = paddle.vision.models.LeNet(num_classes=5)
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
        with pytest.raises(ValueError, match="global_batch_size divisible by 4; got 6"):
            ap.parallelize(model, opt, strategy=s)


class Tagger(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed = paddle.nn.Embedding(10, 6, sparse=True)
        self.head = paddle.nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.embed(x))


def test_full_mode_names_a_layer_no_plan_can_distribute():
    s = ap.Strategy()
    s.auto_mode, s.global_batch_size = "full", 8
    with ap.simulate(world_size=4):
        model = Tagger()
        opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
        with pytest.raises(NotImplementedError, match="Tagger.embed is an Embedding with sparse=True"):
            ap.parallelize(model, opt, strategy=s)
        assert ap.mesh_of(model) is None and not any(ap.is_dist(p) for p in model.parameters())
