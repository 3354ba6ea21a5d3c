"""A user's own op: a python function made dispatchable with ``ap.custom_op`` and a rule in the article's dict form
(``register_spmd_rule(name)`` on ``(inputs, outputs, attrs, mesh)``) or the registry's form. A correct rule gives
one process's values in every layout; a WRONG rule (Shard(0) claimed for a function that averages over dim 0) is
trusted by the runtime (wrong values, no error: documented), and ``check_user_rule`` reports it."""
import numpy as np
import paddle
import paddle.distributed as dist
import pytest

import autoparallel as ap
from spmd_rules import elementwise_result, register_spmd_rule, unregister_spmd_rule
from spmd_rules.validation.user_rules import check_user_rule

X = np.random.default_rng(0).standard_normal((5, 4)).astype("float32")      # 5 rows: uneven shards


def rownorm(x):
    return x / paddle.sqrt((x * x).sum(-1, keepdim=True))


def centre(x):
    return x - x.mean(0, keepdim=True)


def _rows_rule(inputs, outputs, attrs, mesh):
    """The article's form: keep the rows split, replicate otherwise."""
    x, = inputs
    pl = [dist.Shard(0)] if x.placements[0].is_shard(0) else [dist.Replicate()]
    return {"inputs": {"x": pl}, "outputs": {"out": pl}}


def _whole_rule(inputs, outputs, attrs, mesh):
    return {"inputs": {"x": [dist.Replicate()]}, "outputs": {"out": [dist.Replicate()]}}


@pytest.fixture
def user_ops():
    names = []

    def make(name, rule, fn):
        names.append(name)
        register_spmd_rule(name)(rule)
        return ap.custom_op(name)(fn)

    yield make
    for n in names:
        unregister_spmd_rule(n)


def _run(op, place):
    want = op(paddle.to_tensor(X))                          # plain tensors: the function itself
    with ap.simulate(world_size=2):
        d = ap.shard_tensor(paddle.to_tensor(X), ap.ProcessMesh([0, 1], dim_names=["dp"]), [place])
        d.stop_gradient = False
        out = op(d)
        (out * out).sum().backward()
        return out.full().numpy(), d.grad.full().numpy(), want.numpy(), out.placements


def _grad(fn):
    t = paddle.to_tensor(X)
    t.stop_gradient = False
    o = fn(t)
    (o * o).sum().backward()
    return t.grad.numpy()


def test_correct_user_rules_equal_one_process(user_ops):
    rn = user_ops("user_rownorm", _rows_rule, rownorm)
    ce = user_ops("user_centre_whole", _whole_rule, centre)
    sw = user_ops("user_scaled_tanh", lambda x, name=None: elementwise_result("user_scaled_tanh", [x]),
                  lambda x: 2 * paddle.tanh(x))
    for op, fn in ((rn, rownorm), (ce, centre), (sw, lambda x: 2 * paddle.tanh(x))):
        for place in (dist.Shard(0), dist.Shard(1), dist.Replicate()):
            out, grad, want, _ = _run(op, place)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(grad, _grad(fn), rtol=1e-5, atol=1e-6)
    assert str(_run(rn, dist.Shard(0))[3]) == "[S(0)]"


def test_a_wrong_user_rule_is_trusted_at_run_time_and_caught_by_the_checker(user_ops):
    """The rule claims the rows split for ``x - x.mean(0)``: each rank centres its own rows (wrong, silently);
    ``check_user_rule`` names the layout; the correct rule (rows whole) passes it."""
    ce = user_ops("user_centre", _rows_rule, centre)
    out, _, want, pl = _run(ce, dist.Shard(0))
    assert str(pl) == "[S(0)]" and not np.allclose(out, want, atol=1e-3)
    bad = check_user_rule("user_centre", centre, X)
    assert bad and all("differs from the full op" in f for f in bad) and any("[S(0)]" in f for f in bad), bad
    user_ops("user_centre_ok", _whole_rule, centre)
    assert check_user_rule("user_centre_ok", centre, X) == []
    assert check_user_rule("user_unregistered", centre, X) == ["user_unregistered: no rule registered "
                                                                "(register_spmd_rule('user_unregistered'))"]


def test_the_article_rule_on_paddles_flash_attention_splits_the_sequence(monkeypatch):
    """The article's dict rule registered over paddle's own ``flash_attention`` (layout [batch, seq, heads, dim]):
    its ``Shard(1)`` is the sequence, so each rank attends within its own chunk of keys -- wrong values, no error.
    ``check_user_rule`` reports it; the built-in rule passes the same call."""
    from spmd_rules import registry

    fa = paddle.nn.functional.flash_attention.flash_attention
    q, k, v = (np.random.default_rng(i).standard_normal((2, 6, 2, 4)).astype("float32") for i in range(3))
    assert check_user_rule("flash_attention", fa, q, k, v) == []
    monkeypatch.setitem(registry._RULES, "flash_attention", registry._RULES["flash_attention"])    # restored after

    @register_spmd_rule("flash_attention")
    def spmd_flash_attn(inputs, outputs, attrs, mesh):
        q, k, v = inputs
        pl = [dist.Shard(1)] if q.placements[0].is_shard(1) else [dist.Replicate()]
        return {"inputs": {"q": pl, "k": pl, "v": pl}, "outputs": {"out": pl}}

    want = fa(*[paddle.to_tensor(a) for a in (q, k, v)])[0].numpy()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["sp"])
        out, _ = fa(*[ap.shard_tensor(paddle.to_tensor(a), mesh, [dist.Shard(1)]) for a in (q, k, v)])
        assert str(out.placements) == "[S(1)]" and not np.allclose(out.full().numpy(), want, atol=1e-3)
    bad = check_user_rule("flash_attention", fa, q, k, v)
    assert any("(S(1), S(1), S(1)) -> (S(1), None)" in f and "differs" in f for f in bad), bad
