"""MoE routing ops through dispatch on sharded inputs equal the plain ops (values and input gradients);
value-dependent sizes come out replicated; a rule keeping the selected axis sharded is caught by the
rule checker (negative control). The rules' every-placement ground-truth check is python -m spmd_rules.validation."""
import io

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.mesh import mesh_from_shape
from spmd_rules import get_spmd_rule, register_spmd_rule, unregister_spmd_rule

R, S = ap.Replicate(), ap.Shard
RNG = np.random.default_rng(0)
LOGITS = RNG.standard_normal((8, 6)).astype("float32")
HIDDEN = RNG.standard_normal((8, 4)).astype("float32")

# (label, fn(logits, hidden) -> tensor): the routing steps of a top-2 MoE layer and its relatives
OPS = [
    ("topk values", lambda l, h: paddle.topk(F.softmax(l, axis=-1), 2, axis=-1)[0]),
    ("topk indices as weights", lambda l, h: paddle.take_along_axis(l, paddle.topk(l, 2)[1], axis=1)),
    ("argsort + take_along_axis", lambda l, h: paddle.take_along_axis(l, paddle.argsort(l, axis=1), axis=1)),
    ("sort", lambda l, h: paddle.sort(l, axis=0, descending=True)),
    ("cumsum", lambda l, h: paddle.cumsum(l, axis=1)),
    ("one_hot of top-1", lambda l, h: F.one_hot(paddle.argmax(l, axis=-1), 6).astype("float32") * l),
    ("put_along_axis", lambda l, h: paddle.put_along_axis(l, paddle.topk(l, 1)[1], paddle.zeros([8, 1]), 1)),
    ("index_add_ into a buffer", lambda l, h: paddle.zeros([8, 4]).index_add_(paddle.to_tensor([7, 0, 7]), 0,
                                                                                h[:3] * 2.0)),
    ("index_select", lambda l, h: paddle.index_select(h, paddle.to_tensor([5, 1]), axis=0)),
    ("gather", lambda l, h: paddle.gather(h, paddle.to_tensor([2, 2, 6]))),
    ("scatter", lambda l, h: paddle.scatter(h, paddle.to_tensor([1, 4]), h[:2] * 3.0)),
    ("index_put", lambda l, h: paddle.index_put(h, (paddle.to_tensor([0, 3]), paddle.to_tensor([1, 2])),
                                                 paddle.to_tensor([5.0, 6.0]))),
    ("nonzero", lambda l, h: paddle.nonzero(l > 0.5)),
    ("where one-arg", lambda l, h: paddle.where(l > 0.5)[1]),
    ("masked_select", lambda l, h: paddle.masked_select(l, l > 0)),
    ("bincount of top-1", lambda l, h: paddle.bincount(paddle.argmax(l, axis=-1), minlength=6)),
    ("unique counts of top-1", lambda l, h: paddle.unique(paddle.argmax(l, axis=-1), return_counts=True)[1]),
    ("two tensor indices", lambda l, h: h[paddle.to_tensor([1, 5]), paddle.to_tensor([0, 3])]),
    ("permute", lambda l, h: l.reshape([2, 4, 6]).permute(2, 0, 1)),
]


def _plain(fn):
    l, h = paddle.to_tensor(LOGITS, stop_gradient=False), paddle.to_tensor(HIDDEN, stop_gradient=False)
    out = fn(l, h)
    grads = _grads(out, [l, h])
    return out.numpy(), grads


def _grads(out, ins):
    if not paddle.is_floating_point(out) if isinstance(out, paddle.Tensor) else out.spec.dtype != "float32":
        return None
    (out * out).sum().backward()
    return [None if t.grad is None else t.grad for t in ins]


@pytest.mark.parametrize("label,fn", OPS, ids=[o[0] for o in OPS])
def test_routing_op_on_sharded_tokens_equals_the_plain_op(label, fn):
    want, want_grads = _plain(fn)
    with ap.simulate(4):
        mesh = mesh_from_shape([2, 2], ["data", "model"])
        l = ap.shard_tensor(paddle.to_tensor(LOGITS), mesh, [S(0), S(1)], stop_gradient=False)
        h = ap.shard_tensor(paddle.to_tensor(HIDDEN), mesh, [S(0), R], stop_gradient=False)
        out = fn(l, h)
        assert isinstance(out, ap.DistTensor)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
        if want_grads is not None:
            (out * out).sum().backward()
            for t, g in zip((l, h), want_grads):
                got = np.zeros(t.shape, "float32") if t.grad is None else t.grad.numpy()
                np.testing.assert_allclose(got, 0 if g is None else g.numpy(), rtol=1e-5, atol=1e-5)


def test_value_dependent_outputs_are_replicated():
    with ap.simulate(4):
        mesh = mesh_from_shape([2, 2], ["data", "model"])
        l = ap.shard_tensor(paddle.to_tensor(LOGITS), mesh, [S(0), S(1)])
        out = paddle.nonzero(l > 0.5)
        assert out.placements == [R, R] and out.shape == [int((LOGITS > 0.5).sum()), 2]


def test_negative_control_a_rule_keeping_the_topk_axis_sharded_is_caught():
    import spmd_rules.validation as check_rules

    good = get_spmd_rule("topk")

    def wrong(x, k, axis=None, largest=True, sorted=True, name=None):
        res = good(x.with_placements(tuple(R for _ in x.placements)), k, axis, largest, sorted)
        keep = [x.with_placements(x.placements)]
        return type(res)(keep, [o.with_placements(x.placements) for o in res.outputs])

    register_spmd_rule("topk_wrong", wrong)
    check_rules.CASES["topk_wrong"] = check_rules.CASES.get("topk", [])
    check_rules._build_cases()
    check_rules.CASES["topk_wrong"] = check_rules.CASES["topk"]
    check_rules.IMPLS["topk_wrong"] = paddle.topk
    try:
        out = io.StringIO()
        check_rules.run(["topk_wrong"], out=out)
        assert "FAIL" in out.getvalue()
        out = io.StringIO()
        check_rules.run(["topk"], out=out)
        assert "FAIL" not in out.getvalue() and " ok " in out.getvalue()
    finally:
        unregister_spmd_rule("topk_wrong")
        check_rules.CASES.pop("topk_wrong", None)
        check_rules.IMPLS.pop("topk_wrong", None)
