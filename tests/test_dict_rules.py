"""Dict-returning spmd rules (the article's ``rule(inputs, outputs, attrs, mesh) -> {"inputs", "outputs"}``)
adapted onto the registry: consulted by dispatch, their placements applied (values equal the full-tensor
computation), misuse named by rule and field; short placement lists padded with Replicate."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
import autoparallel as dist
from spmd_rules import registry


@pytest.fixture(autouse=True)
def restore_rules():
    saved = dict(registry._RULES)
    yield
    registry._RULES.clear()
    registry._RULES.update(saved)


def mesh2d():
    return ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])


@ap.custom_op("toy_attention")
def toy_attention(q, k, v):
    return F.softmax(paddle.matmul(q, k, transpose_y=True), axis=-1) @ v


def qkv(seed=0):
    rng = np.random.default_rng(seed)
    return [paddle.to_tensor(rng.standard_normal((4, 6, 8)).astype("float32")) for _ in range(3)]


def test_article_flash_attention_rule_is_registered_and_consulted():
    calls = []

    @ap.register_spmd_rule("flash_attention")
    def spmd_flash_attn(inputs, outputs, attrs, mesh):
        calls.append((len(inputs), [list(o.shape) for o in outputs], sorted(attrs), mesh.shape))
        q, k, v = inputs
        out = outputs[0]
        q_out_placements = [dist.Shard(1)] if q.placements[0].is_shard(1) else [dist.Replicate()]
        return {"inputs": {"q": q_out_placements, "k": q_out_placements, "v": q_out_placements},
                "outputs": {"out": q_out_placements}}

    rule = ap.get_spmd_rule("flash_attention")
    m = mesh2d()
    spec = ap.DistSpec(m, [ap.Shard(1), ap.Replicate()], (2, 16, 4, 8), "float32")
    res = rule(spec, spec, spec, causal=True)
    assert calls == [(3, [[2, 16, 4, 8]], ["causal"], [2, 2])]        # output shapes from the built-in rule
    assert [str(s.placements) for s in res.inputs] == ["(S(1), R)"] * 3
    assert str(res.outputs[0].placements) == "(S(1), R)" and res.outputs[1] is None   # no softmax returned
    rep = ap.DistSpec(m, [ap.Shard(0), ap.Replicate()], (2, 16, 4, 8), "float32")
    assert str(rule(rep, rep, rep).inputs[0].placements) == "(R, R)"    # the rule's other branch


def test_dict_rule_drives_dispatch_and_equals_the_full_computation():
    seen = []

    @ap.register_spmd_rule("toy_attention")
    def rule(inputs, outputs, attrs, mesh):
        seen.append([str(x.placements) for x in inputs])
        batch = [ap.Shard(0)]                                   # short: padded with Replicate on "model"
        return {"inputs": {"q": batch, "k": batch, "v": batch}, "outputs": {"out": batch}}

    q, k, v = qkv()
    want = toy_attention(q, k, v).numpy()
    with ap.simulate(world_size=4):
        m = mesh2d()
        d = [ap.shard_tensor(t, m, [ap.Replicate(), ap.Shard(1)]) for t in (q, k, v)]
        out = toy_attention(*d)
        assert seen and seen[0] == ["(R, S(1))"] * 3               # consulted with the call's layouts
        assert [str(p) for p in out.placements] == ["S(0)", "R"]   # the rule's output layout
        np.testing.assert_allclose(out.full().numpy(), want, rtol=1e-5, atol=1e-6)


def test_negative_control_a_wrong_rule_gives_a_wrong_result():
    @ap.register_spmd_rule("toy_attention")
    def rule(inputs, outputs, attrs, mesh):                     # sharding the key's sequence dim is wrong
        return {"inputs": {"q": [ap.Replicate()], "k": [ap.Shard(1)], "v": [ap.Shard(1)]},
                "outputs": {"out": [ap.Partial()]}}

    q, k, v = qkv()
    want = toy_attention(q, k, v).numpy()
    with ap.simulate(world_size=4):
        out = toy_attention(*[ap.shard_tensor(t, mesh2d(), [ap.Replicate()]) for t in (q, k, v)])
        assert not np.allclose(out.full().numpy(), want, atol=1e-3)


BAD = [
    (lambda i, o, a, m: [("q", [ap.Shard(0)])], TypeError, r"'toy_attention' must return a dict"),
    (lambda i, o, a, m: {"inputs": {}}, ValueError, r"'toy_attention'.*missing \['outputs'\]"),
    (lambda i, o, a, m: {"inputs": {"q": [ap.Replicate()]}, "outputs": {"out": [ap.Replicate()]}},
     ValueError, r"'toy_attention': field 'inputs' has 1 entries \['q'\], expected 3"),
    (lambda i, o, a, m: {"inputs": {"q": [ap.Replicate()] * 3, "k": [ap.Replicate()], "v": [ap.Replicate()]},
                         "outputs": {"out": [ap.Replicate()]}},
     ValueError, r"'toy_attention': field inputs\['q'\] has 3 placements.*the mesh has 2 dims"),
    (lambda i, o, a, m: {"inputs": {"q": [ap.Replicate()], "k": [ap.Replicate()], "v": [ap.Replicate()]},
                         "outputs": {"out": ap.Shard(0)}},
     TypeError, r"'toy_attention': field outputs\['out'\] must be a list of placements"),
    (lambda i, o, a, m: {"inputs": {"q": [ap.Shard(5)], "k": [ap.Replicate()], "v": [ap.Replicate()]},
                         "outputs": {"out": [ap.Replicate()]}},
     ValueError, r"'toy_attention': field inputs\['q'\] shards dim 5 of a tensor of rank 3"),
    (lambda i, o, a, m: {"inputs": {"q": ["X"], "k": [ap.Replicate()], "v": [ap.Replicate()]},
                         "outputs": {"out": [ap.Replicate()]}},
     TypeError, r"'toy_attention': field inputs\['q'\] holds an invalid placement"),
]


@pytest.mark.parametrize("body,error,match", BAD)
def test_malformed_dict_rule_is_named_with_its_field(body, error, match):
    def rule(inputs, outputs, attrs, mesh):
        return body(inputs, outputs, attrs, mesh)

    ap.register_spmd_rule("toy_attention", rule)
    spec = ap.DistSpec(mesh2d(), [ap.Replicate(), ap.Replicate()], (4, 6, 8), "float32")
    with pytest.raises(error, match=match):
        ap.get_spmd_rule("toy_attention")(spec, spec, spec)


def test_short_placement_lists_are_padded_with_replicate():
    x = paddle.arange(32, dtype="float32").reshape([4, 8])
    with ap.simulate(world_size=4):
        m = mesh2d()
        short, full = ap.shard_tensor(x, m, [ap.Shard(1)]), ap.shard_tensor(x, m, [ap.Shard(1), ap.Replicate()])
        assert short.placements == full.placements
        for r in range(4):
            np.testing.assert_array_equal(short.locals[r].numpy(), full.locals[r].numpy())
        assert [str(p) for p in ap.reshard(short, m, [ap.Shard(0)]).placements] == ["S(0)", "R"]
        assert ap.DistSpec(m, [ap.Shard(0)], (4, 8), "float32").placements == (ap.Shard(0), ap.Replicate())
        with pytest.raises(ValueError, match="expected 2 placements"):
            ap.shard_tensor(x, m, [ap.Shard(0), ap.Replicate(), ap.Replicate()])
        with pytest.raises(ValueError, match="expected 2 placements"):    # the string notation names every dim
            ap.DistSpec(m, "S(0)", (4, 8), "float32")
