"""``paddle.incubate.nn.functional`` on distributed tensors: the ops with a CPU kernel (``fused_rms_norm``,
``fused_layer_norm``, ``swiglu``, ``fused_dropout_add``) against one process; the GPU-only kernels refused on CPU
with a typed error, their rules pinned by their layout strings, routed on a GPU (the kernel stood in by its
reference), and the rule checker catching a wrong rope rule (negative control)."""
import functools
import os
import platform

import numpy as np
import paddle
import paddle.incubate.nn.functional as IF
import pytest

import autoparallel as ap
from autoparallel import dispatch as D
from autoparallel.mesh import mesh_from_shape
from autoparallel.spec import DistSpec
from spmd_rules import composites_fused, get_spmd_rule, register_spmd_rule
from spmd_rules.validation.samples_fused import _linear, _rope
from spmd_rules.validation.user_rules import check_user_rule

S0, S1, R = ap.Shard(0), ap.Shard(1), ap.Replicate()
RNG = np.random.default_rng(0)
X, W, B, BIAS, RES = (RNG.standard_normal(s).astype("float32") for s in ((4, 3, 8), (8,), (8,), (8,), (4, 3, 8)))


def _tensors(arrays, mesh=None, places=None):
    out = []
    for i, a in enumerate(arrays):
        t = paddle.to_tensor(a)
        if mesh is not None:
            t = ap.shard_tensor(t, mesh, places[i])
        t.stop_gradient = False
        out.append(t)
    return out


def _np(t):
    return (t.full() if hasattr(t, "full") else t).numpy()


@functools.lru_cache(maxsize=None)
def paddle_fused_norm_kernels_run() -> bool:
    """Whether paddle's own CPU fused norm kernels run on this CPU: they use AVX-512 (``RmsNormAvxKernel``) and end
    the process with SIGILL on an x86 CPU without it (an AVX2-only AMD EPYC here). Where they cannot run, the
    forward is compared with the reference formula instead of paddle's kernel (the distributed path is composed of
    primitive ops and never calls that kernel)."""
    if platform.machine() not in ("x86_64", "AMD64") or not os.path.exists("/proc/cpuinfo"):
        return True
    with open("/proc/cpuinfo") as f:
        return " avx512f" in f.read()


def _rms_ref(x, w, b, bias, res):
    h = x + bias + res
    return h * paddle.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6) * w + b, h


def _ln_ref(x, w, b, bias, res):
    h = x + bias + res * 0.5
    c = h - h.mean(-1, keepdim=True)
    return c * paddle.rsqrt((c * c).mean(-1, keepdim=True) + 1e-5) * w + b, h


CALLS = {"rms": (lambda x, w, b, bias, res: IF.fused_rms_norm(x, w, b, 1e-6, 2, bias=bias, residual=res), _rms_ref),
         "ln": (lambda x, w, b, bias, res: IF.fused_layer_norm(x, w, b, 1e-5, residual_alpha=0.5, begin_norm_axis=2,
                                                                bias=bias, residual=res), _ln_ref)}


def _run(fn, mesh=None, places=None):
    ts = _tensors([X, W, B, BIAS, RES], mesh, places)
    outs = fn(*ts)
    (outs[0] * outs[0]).sum().backward()
    return [_np(o) for o in outs] + [_np(t.grad) for t in ts]


@pytest.mark.parametrize("which", ["rms", "ln"])
@pytest.mark.parametrize("layout", ["rows", "normalized-dim", "R", "2x2"])
def test_fused_norms_equal_paddle_forward_and_one_process_gradients(which, layout):
    """Forward: every output equals paddle's own CPU kernel on the whole tensors (out, residual_out and, for layer
    norm, the flattened mean and 1/std). Backward (paddle's CPU build has no fused_rms_norm grad kernel): every
    input gradient equals the same formula on one process."""
    fused, ref = CALLS[which]
    whole = [paddle.to_tensor(a) for a in (X, W, B, BIAS, RES)]
    want = [o.numpy() for o in (fused if paddle_fused_norm_kernels_run() else ref)(*whole)]
    grads = _run(lambda *t: ref(*t))[2:]
    with ap.simulate(world_size=4 if layout == "2x2" else 2):
        if layout == "2x2":
            mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "sp"])
            x = [S0, S1]
            places = [x, [R, R], [R, R], [R, R], x]
        else:
            mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
            x = {"rows": S0, "normalized-dim": ap.Shard(2), "R": R}[layout]
            places = [[x], [R], [R], [R], [x]]
        got = _run(fused, mesh, places)
    if len(want) < len(got) - len(grads):                # the reference gives out and residual_out only
        got = got[:len(want)] + got[len(got) - len(grads):]
    for g, w in zip(got, want + grads):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_fused_norm_forms_and_refusals():
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        x, w = (ap.shard_tensor(paddle.to_tensor(a), mesh, [p]) for a, p in ((X, S0), (W, R)))
        out, res_out = IF.fused_rms_norm(x, w, None, 1e-6, 2)          # no residual: an empty residual_out
        zero = paddle.zeros([8])
        whole = [paddle.to_tensor(a) for a in (X, W)]
        want = (IF.fused_rms_norm(*whole, None, 1e-6, 2) if paddle_fused_norm_kernels_run()
                else _rms_ref(*whole, zero, zero, paddle.zeros_like(whole[0])))[0].numpy()
        np.testing.assert_allclose(_np(out), want, rtol=1e-5, atol=1e-5)
        assert list(res_out.shape) == [0]
        with pytest.raises(NotImplementedError, match="quant_scale=0.5"):
            IF.fused_layer_norm(x, w, w, 1e-5, begin_norm_axis=2, quant_scale=0.5)


def test_incubate_swiglu_and_fused_dropout_add_equal_one_process():
    """``swiglu`` (one operand split in halves, or two) and ``fused_dropout_add`` in training (paddle 3.3 runs it
    as dropout + add: the global keep-mask, so the single-process draw for the same seed; another seed differs)."""
    x = RNG.standard_normal((6, 8)).astype("float32")
    calls = [(lambda a: IF.swiglu(a), [x]), (lambda a, b: IF.swiglu(a, b), [x, x + 1]),
             (lambda a, b: IF.fused_dropout_add(a, b, p=0.4), [x, x * 2])]

    def run(fn, arrays, place=None, seed=3):
        paddle.seed(seed)
        ts = _tensors(arrays, mesh, [[place]] * len(arrays)) if place else _tensors(arrays)
        o = fn(*ts)
        (o * o).sum().backward()
        return [_np(o)] + [_np(t.grad) for t in ts]

    for fn, arrays in calls:
        mesh = None
        want = run(fn, arrays)
        with ap.simulate(world_size=2):
            mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
            for place in (S0, S1):
                for g, w in zip(run(fn, arrays, place), want):
                    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
            other = run(fn, arrays, S0, seed=4)[0]
        assert np.allclose(other, want[0]) == (fn is not calls[2][0])


GPU_ONLY = {
    "fused_linear": lambda d: IF.fused_linear(d, d),
    "fused_matmul_bias": lambda d: IF.fused_matmul_bias(d, d),
    "fused_bias_act": lambda d: IF.fused_bias_act(d, act_method="gelu"),
    "fused_rotary_position_embedding": lambda d: IF.fused_rotary_position_embedding(d.reshape([1, 4, 2, 2])),
    "fused_feedforward": lambda d: IF.fused_feedforward(d.reshape([1, 4, 4]), d, d),
    "fused_multi_head_attention": lambda d: IF.fused_multi_head_attention(d.reshape([1, 4, 4]), d, d),
}


@pytest.mark.parametrize("op", sorted(GPU_ONLY))
def test_gpu_only_kernels_raise_a_typed_error_on_cpu(op):
    with ap.simulate(world_size=2):
        d = ap.shard_tensor(paddle.ones([4, 4]), ap.ProcessMesh([0, 1], dim_names=["x"]), [S0])
        with pytest.raises(NotImplementedError, match=f"{op} has no CPU kernel in paddle \\(device 'cpu'\\).*use"):
            GPU_ONLY[op](d)


def _spec(shape, place=R, dtype="float32"):
    return DistSpec(mesh_from_shape([2], create_groups=False), (place,), shape, dtype)


def test_gpu_only_rules_by_their_layouts():
    q, q_h = _spec((2, 6, 4, 8), S1), _spec((2, 6, 4, 8), ap.Shard(2))
    table = _spec((1, 6, 1, 8), S1)
    cu = _spec((3,), dtype="int32")
    g = get_spmd_rule
    cases = [
        (g("fused_linear")(_spec((4, 8), S1), _spec((8, 6), S0), _spec((6,))), "(S(1), S(0), P(sum)) -> P(sum)"),
        (g("fused_linear")(_spec((4, 8)), _spec((6, 8), S0), _spec((6,)), transpose_weight=True),
         "(R, S(0), S(0)) -> S(1)"),
        (g("fused_matmul_bias")(_spec((4, 8), S0), _spec((8, 6)), _spec((6,))), "(S(0), R, R) -> S(0)"),
        (g("fused_bias_act")(_spec((4, 8), S1), _spec((8,)), act_method="gelu"), "(S(1), S(0)) -> S(1)"),
        (g("fused_bias_act")(_spec((4, 8), S1), _spec((8,)), act_method="swiglu"), "(R, R) -> R"),
        (g("fused_rotary_position_embedding")(q, q, None, table, table), "(S(1), S(1), S(1), S(1)) -> "
                                                                         "(S(1), S(1), None)"),
        (g("fused_rotary_position_embedding")(q, q), "(R, R) -> (R, R, None)"),      # positions numbered per shard
        (g("fused_rotary_position_embedding")(q_h, q_h), "(S(2), S(2)) -> (S(2), S(2), None)"),
        (g("fused_feedforward")(_spec((2, 6, 8), S1), _spec((8, 16), S1), _spec((16, 8))), "(S(1), R, R) -> S(1)"),
        (g("fused_multi_head_attention")(_spec((2, 6, 8), S1), _spec((3, 2, 4, 8)), _spec((8, 8))),
         "(R, R, R) -> R"),
        (g("flash_attn_unpadded")(_spec((12, 4, 8), S1), _spec((12, 2, 8), S1), _spec((12, 2, 8), S1), cu, cu,
                                  6, 6, 0.3), "(S(1), S(1), S(1), R, R) -> (S(1), None)"),
        (g("flash_attn_unpadded")(_spec((12, 4, 8), S0), _spec((12, 2, 8)), _spec((12, 2, 8)), cu, cu, 6, 6, 0.3),
         "(R, R, R, R, R) -> (R, None)"),
        (g("flashmask_attention")(q_h, q_h, q_h, _spec((2, 4, 6, 1), dtype="int32"), causal=True),
         "(R, R, R, R) -> R"),
        (g("flashmask_attention")(_spec((2, 6, 4, 8), S0), q, q, _spec((2, 1, 6, 1), S0, "int32"), causal=True),
         "(S(0), S(0), S(0), S(0)) -> S(0)"),
    ]
    for res, want in cases:
        assert str(res) == want
    with pytest.raises(ValueError, match="ring_id=0"):
        g("fused_feedforward")(_spec((2, 6, 8)), _spec((8, 16)), _spec((16, 8)), ring_id=0)


def test_gpu_path_routes_through_the_rule(monkeypatch):
    """On a GPU the composite routes to the rule: with the kernel stood in by its reference, a column- and a
    row-parallel ``fused_linear`` give the one-process output."""
    path = "paddle.incubate.nn.functional.fused_linear"
    monkeypatch.setattr(composites_fused, "_device", lambda: "gpu:0")
    monkeypatch.setitem(D._ORIG, path, _linear)
    monkeypatch.setitem(D._LOCAL_FN, path, _linear)
    x, w, b = (RNG.standard_normal(s).astype("float32") for s in ((4, 8), (8, 6), (6,)))
    want = _linear(*[paddle.to_tensor(a) for a in (x, w, b)]).numpy()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["mp"])
        for places in ([R, S1, S0], [S1, S0, R]):
            d = [ap.shard_tensor(paddle.to_tensor(a), mesh, [p]) for a, p in zip((x, w, b), places)]
            np.testing.assert_allclose(_np(IF.fused_linear(*d)), want, rtol=1e-5, atol=1e-5)


def test_checker_catches_a_rope_rule_splitting_computed_positions():
    """Negative control: a rope rule that keeps a split sequence when the kernel computes the tables (each shard
    would number its positions from 0) fails the checker; the built-in rule passes the same call."""
    good = get_spmd_rule("fused_rotary_position_embedding")
    q = RNG.standard_normal((2, 4, 2, 6))
    assert check_user_rule("fused_rotary_position_embedding", _rope, q) == []

    def split_seq(q, k=None, v=None, sin=None, cos=None, position_ids=None, use_neox_rotary_style=True,
                  time_major=False, rotary_emb_base=10000.0):
        from spmd_rules.elementwise import elementwise_result
        res = elementwise_result("rope_split", [q])
        return type(res)(res.inputs, res.outputs + (None, None))

    register_spmd_rule("fused_rotary_position_embedding", split_seq)
    try:
        bad = check_user_rule("fused_rotary_position_embedding", _rope, q)
    finally:
        register_spmd_rule("fused_rotary_position_embedding", good.fn, reverse=good.reverse)
    assert any("[S(1)]" in f and "differs" in f for f in bad), bad


def test_other_incubate_functions_are_guarded():
    """The rest of ``paddle.incubate.nn.functional`` (no rule) raises the typed guard error instead of paddle's
    'argument x must be Tensor, but got DistTensor' from the C op."""
    with ap.simulate(world_size=2):
        d = ap.shard_tensor(paddle.ones([4, 8]), ap.ProcessMesh([0, 1], dim_names=["x"]), [S0])
        with pytest.raises(NotImplementedError, match="fused_bias_dropout_residual_layer_norm has no spmd rule.*"
                                                      "register_spmd_rule"):
            IF.fused_bias_dropout_residual_layer_norm(d, d, dropout_rate=0.0)
        with pytest.raises(NotImplementedError, match="fused_rms_norm_ext has no spmd rule"):
            IF.fused_rms_norm_ext(d, paddle.ones([8]))
    with pytest.raises(RuntimeError, match="not registered"):         # plain tensors: paddle's own function
        IF.fused_bias_dropout_residual_layer_norm(paddle.ones([4, 8]), paddle.ones([4, 8]), dropout_rate=0.0)


def test_gpu_only_rules_mirror_paddles_signatures():
    """A call is bound by paddle's signature, then handed to the rule: the parameter names must agree."""
    import inspect

    import spmd_rules.fused as fused
    from autoparallel.compat import owner_of

    checked = 0
    for path in composites_fused.COMPOSITES:
        op = path.rsplit(".", 1)[1]
        if hasattr(fused, op):
            owner, attr = owner_of(path)
            names = [[p.name for p in inspect.signature(f).parameters.values()]
                     for f in (inspect.unwrap(getattr(owner, attr)), getattr(fused, op))]
            assert names[0] == names[1], op
            checked += 1
    assert checked == 9
