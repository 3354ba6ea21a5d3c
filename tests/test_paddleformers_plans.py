"""Bring-your-own-model plumbing without PaddleFormers: tied parameters stay one parameter through
parallelize / shard_layer / apply_tp (gradients of both uses, one optimizer entry, a negative control),
default plans found at any depth, TP styles on leaf layers only, typed errors naming the layer, and keyword
inputs split over the data axis like positional ones."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import autoparallel as ap
from autoparallel.parallel.tensor_parallel import PlanError, apply_tp
from autoparallel.parallel.ties import TiedLayoutError, UnreplacedParameterError, check_replaced, holders
from autoparallel.parallelize import parallelize, resolve_tp_plan

V, H = 32, 16


class Head(nn.Layer):
    """A [vocab, hidden] output head (PaddleFormers' LMHead layout)."""

    def __init__(self):
        super().__init__()
        self.weight = self.create_parameter([V, H])

    def forward(self, x):
        return paddle.matmul(x, self.weight, transpose_y=True)


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(H, 2 * H)
        self.down_proj = nn.Linear(2 * H, H)

    def forward(self, x):
        return x + self.down_proj(F.relu(self.up_proj(x)))


class Inner(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.LayerList([Block(), Block()])


class TiedLM(nn.Layer):
    """Nested names (model.layers.0.up_proj) and a head tied to the embedding, called with keywords."""

    def __init__(self, tie=True):
        super().__init__()
        self.model = Inner()
        self.lm_head = Head()
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.seen = []

    def forward(self, input_ids=None, labels=None):
        self.seen.append({k: getattr(v, "placements", None) for k, v in (("input_ids", input_ids),
                                                                        ("labels", labels))})
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x)
        return F.cross_entropy(self.lm_head(x), labels.unsqueeze(-1)).mean()


PLAN = {"embed_tokens": ap.VocabParallelEmbedding(), "up_proj": ap.ColWiseParallel(),
        "down_proj": ap.RowWiseParallel(), "lm_head": ap.ColWiseParallel()}


def make(tie=True, seed=0):
    paddle.seed(seed)
    return TiedLM(tie)


def data(seed=0, b=4, t=6):
    rng = np.random.default_rng(seed)
    return paddle.to_tensor(rng.integers(0, V, (b, t))), paddle.to_tensor(rng.integers(0, V, (b, t)))


def strategy(dp, tp):
    s = ap.Strategy()
    s.data_parallel.degree = dp
    s.tensor_parallel.degree = tp
    return s


def reference(tie=True):
    m = make(tie)
    ids, labels = data()
    loss = m(input_ids=ids, labels=labels)
    loss.backward()
    return float(loss), {n: p.grad.numpy() for n, p in m.named_parameters()}


def grads(m):
    return {n: p.as_dist().grad.full().numpy() for n, p in m.named_parameters()}


# ---- tied parameters ----------------------------------------------------------------------------------------
def test_parallelize_keeps_the_tie_and_trains_both_uses():
    ref_loss, ref = reference()
    with ap.simulate(world_size=4):
        m = make()
        opt = paddle.optimizer.AdamW(1e-3, parameters=m.parameters())
        m, opt = parallelize(m, opt, strategy=strategy(2, 2), tp_plan=PLAN)
        ids, labels = data()
        loss = m(input_ids=ids, labels=labels)
        loss.backward()
        opt.reduce_gradients()
        got, loss = grads(m), float(loss)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert str(m.lm_head.weight.placements) == "[R, S(0)]"
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    assert set(got) == set(ref)
    for n in ref:
        np.testing.assert_allclose(got[n], ref[n], rtol=1e-4, atol=1e-6, err_msg=n)
    params = opt._inner._parameter_list
    assert len(params) == len({id(p) for p in params}) == len(ref)
    assert {id(p) for p in params} == {id(p) for p in m.parameters()}


def test_negative_control_a_split_tie_loses_the_head_gradient():
    """The check above can fail: an untied copy of the head (what a split tie amounts to) gives the
    embedding only its lookup gradient."""
    _, tied = reference(tie=True)
    _, untied = reference(tie=False)
    diff = np.abs(tied["model.embed_tokens.weight"] - untied["model.embed_tokens.weight"]).max()
    assert diff > 1e-3


def test_shard_layer_through_one_holder_repoints_every_holder():
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["model"])
        m = make()

        def shard_fn(name, layer, mesh):
            if name == "lm_head":
                layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(0)])

        ap.shard_layer(m, mesh, shard_fn)
    assert m.model.embed_tokens.weight is m.lm_head.weight
    assert m.lm_head.weight.placements == [ap.Shard(0)]
    assert len(list(m.parameters())) == 1 + 2 * 4


def test_apply_tp_merges_two_equal_layouts_of_one_tie():
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["model"])
        m = make()
        apply_tp(m, mesh, {"embed_tokens": ap.VocabParallelEmbedding(), "lm_head": ap.ColWiseParallel()}, "model")
    assert m.model.embed_tokens.weight is m.lm_head.weight and m.lm_head.weight.placements == [ap.Shard(0)]


def test_a_tie_with_two_layouts_is_refused_naming_both_holders():
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["model"])
        m = make()

        def shard_fn(name, layer, mesh):
            if name in ("model.embed_tokens", "lm_head"):
                layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(0 if name == "lm_head" else 1)])

        with pytest.raises(TiedLayoutError, match=r"model\.embed_tokens\.weight.*lm_head\.weight.*one layout"):
            ap.shard_layer(m, mesh, shard_fn)


def test_an_unreplaced_parameter_is_named():
    m = make()
    with pytest.raises(UnreplacedParameterError, match=r"parameter model\.embed_tokens\.weight of TiedLM is still the original"):
        check_replaced(m, holders(m))


# ---- plans --------------------------------------------------------------------------------------------------
def test_plan_patterns_match_dotted_suffixes_at_any_depth():
    plan = resolve_tp_plan(make(), 2, PLAN)
    assert sorted(plan) == ["lm_head", "model.embed_tokens", "model.layers.0.down_proj", "model.layers.0.up_proj",
                            "model.layers.1.down_proj", "model.layers.1.up_proj"]
    assert isinstance(plan["model.layers.1.down_proj"], ap.RowWiseParallel)


def test_colwise_on_a_vocab_hidden_head_shards_the_vocab():
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["model"])
        m = make(tie=False)
        apply_tp(m, mesh, {"lm_head": ap.ColWiseParallel(), "up_proj": ap.ColWiseParallel()}, "model")
    assert m.lm_head.weight.placements == [ap.Shard(0)] and m.lm_head.weight.global_shape == [V, H]
    assert m.model.layers[0].up_proj.weight.placements == [ap.Shard(1)]


@pytest.mark.parametrize("pattern,style,match", [
    ("layers.0", ap.ColWiseParallel(), r"leaf layers .*'model\.layers\.0' is a Block holding sublayers "
                                       r"\['up_proj', 'down_proj'\]"),
    ("model", ap.RowWiseParallel(), r"'model' is a Inner"),
    ("layers.1.up_proj", ap.VocabParallelEmbedding(), r"'model\.layers\.1\.up_proj' is a Linear \(weight \[in, out\]\); "
                                                      r"use ColWiseParallel"),
    ("blocks.*.fc", ap.ColWiseParallel(), r"pattern 'blocks\.\*\.fc' matches no layer of TiedLM; its "
                                          r"leaf layers: model\.embed_tokens, model\.layers\.\*\.up_proj"),
])
def test_bad_plan_entries_name_the_layer(pattern, style, match):
    with ap.simulate(world_size=2), pytest.raises(PlanError, match=match):
        parallelize(make(), strategy=strategy(1, 2), tp_plan={pattern: style})


def test_style_on_a_layer_without_a_2d_weight_is_refused():
    class Normed(nn.Layer):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(H)

    with pytest.raises(PlanError, match=r"ColWiseParallel shards a 2-D weight, but 'norm' \(LayerNorm\) has none"):
        resolve_tp_plan(Normed(), 2, {"norm": ap.ColWiseParallel()})


def test_plain_model_gets_the_no_family_error_listing_its_layers():
    class Plain(nn.Layer):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Linear(4, 4)

    with pytest.raises(PlanError, match=r"no layer of Plain matches a default tensor-parallel plan.*"
                                        r"LLaMA-style names like embed_tokens, self_attn\.q_proj.*got layers encoder"):
        resolve_tp_plan(Plain(), 2)


# ---- keyword inputs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["parallelize", "DataParallel"])
def test_keyword_inputs_are_split_over_the_data_axis(entry):
    ref_loss, ref = reference()
    with ap.simulate(world_size=2):
        m = make()
        if entry == "parallelize":
            m, _ = parallelize(m, strategy=strategy(2, 1))
        else:
            m = ap.DataParallel(m, strategy=strategy(2, 1))
        ids, labels = data()
        loss = m(input_ids=ids, labels=labels)
        loss.backward()
        from autoparallel.parallel.grads import reduce_gradients

        reduce_gradients(m.parameters())
        got, loss = grads(m), float(loss)
    assert m.seen[-1] == {"input_ids": [ap.Shard(0), ap.Replicate()], "labels": [ap.Shard(0), ap.Replicate()]}
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    for n in ref:
        np.testing.assert_allclose(got[n], ref[n], rtol=1e-4, atol=1e-6, err_msg=n)


class Encoder(nn.Layer):
    """ERNIE 1-3 / paddle.nn.TransformerEncoderLayer names: self_attn.{q,k,v,out}_proj, linear1, linear2."""

    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(V, H)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(H, 4, 2 * H, dropout=0.0), 2)
        self.cls = nn.Linear(H, V)

    def forward(self, input_ids=None, labels=None):
        logits = self.cls(self.encoder(self.word_embeddings(input_ids)))
        return F.cross_entropy(logits, labels.unsqueeze(-1)).mean()


def test_ernie_style_encoder_gets_the_default_plan():
    plan = resolve_tp_plan(Encoder(), 2)
    kinds = {n: type(st).__name__ for n, st in plan.items()}
    assert kinds == {"word_embeddings": "VocabParallelEmbedding",
                     **{f"encoder.layers.{i}.{k}": v for i in range(2) for k, v in (
                         ("self_attn.q_proj", "ColWiseParallel"), ("self_attn.k_proj", "ColWiseParallel"),
                         ("self_attn.v_proj", "ColWiseParallel"), ("self_attn.out_proj", "RowWiseParallel"),
                         ("linear1", "ColWiseParallel"), ("linear2", "RowWiseParallel"))}}


def test_ernie_style_encoder_equals_one_process():
    paddle.seed(0)
    ref_model = Encoder()
    ids, labels = data()
    ref_loss = ref_model(input_ids=ids, labels=labels)
    ref_loss.backward()
    ref = {n: p.grad.numpy() for n, p in ref_model.named_parameters()}
    with ap.simulate(world_size=2):
        paddle.seed(0)
        m, _ = parallelize(Encoder(), strategy=strategy(1, 2))
        loss = m(input_ids=ids, labels=labels)
        loss.backward()
        from autoparallel.parallel.grads import reduce_gradients

        reduce_gradients(m.parameters())
        got, loss = grads(m), float(loss)
    assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    for n in ref:
        np.testing.assert_allclose(got[n], ref[n], rtol=1e-4, atol=1e-6, err_msg=n)
