"""Lazy, sharded initialisation (autoparallel/lazy_init) in the simulated world: a model built under
paddle.LazyGuard and laid out by ap.parallelize / ap.shard_tensor gets, on every rank, exactly the slice
of the eager single-process initialisation with the same seed; the generator ends where the eager build
left it; no rank allocates a whole-size tensor for a parameter it does not own; a training step after
lazy init equals the eager one. Negative controls: registration order instead of creation order, and a
draw between build and parallelize, both change the values."""
import dataclasses
import warnings

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn
from paddle.nn.initializer.normal import NormalInitializer

import autoparallel as ap
from autoparallel.lazy_init import materialize_params
from autoparallel.lazy_init.params import lazy_parameters
from examples.models import PRESETS, build

SEED = 11
RANDOM_OPS = ("gaussian", "uniform", "truncated_gaussian_random")


def eager_and_next(make):
    """(model built eagerly after paddle.seed, the generator's next draw after the build)."""
    paddle.seed(SEED)
    m = make()
    return m, paddle.rand([4]).numpy()


def lazy(make):
    paddle.seed(SEED)
    with paddle.LazyGuard():
        return make()


def strategy(dp=2, tp=2, zero=None):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    if zero:
        s.sharding.enable, s.sharding.stage = True, zero
    return s


def local_want(ref, p, r):
    return ref[p.spec.local_slices(p.mesh.coords_of(r))]


# ---- the stream: every initializer, layout, chunk size --------------------------------------------------------
INITS = {
    "normal": lambda: nn.initializer.Normal(0.5, 2.0), "uniform": lambda: nn.initializer.Uniform(-3, 1),
    "truncated": lambda: nn.initializer.TruncatedNormal(0.0, 1.0), "xavier_u": nn.initializer.XavierUniform,
    "xavier_n": nn.initializer.XavierNormal, "kaiming_n": nn.initializer.KaimingNormal,
    "kaiming_u": nn.initializer.KaimingUniform, "constant": lambda: nn.initializer.Constant(0.25),
    "assign": lambda: nn.initializer.Assign(np.arange(7 * 9 * 3, dtype="float32").reshape([7, 9, 3])),
}
LAYOUTS = [("1d", [4], ["S(0)"]), ("1d", [4], ["S(1)"]), ("1d", [4], ["S(2)"]), ("2d", [2, 2], ["S(0)", "S(1)"]),
           ("2d", [2, 2], ["S(1)", "S(1)"]), ("2d", [2, 2], ["R", "S(2)"]), ("2d", [2, 2], ["P(sum)", "S(0)"])]


class Three(nn.Layer):
    """Three parameters of odd sizes: [7, 9, 3] with the initializer under test between two normals."""

    def __init__(self, init):
        super().__init__()
        self.a = self.create_parameter([5], default_initializer=nn.initializer.Normal())
        self.w = self.create_parameter([7, 9, 3], default_initializer=init())
        self.b = self.create_parameter([3, 3], default_initializer=nn.initializer.Normal())


@pytest.mark.parametrize("init", sorted(INITS))
@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_stream_equals_eager_every_initializer_and_layout(init, layout):
    _, mesh_shape, placements = LAYOUTS[layout]
    ref, after = eager_and_next(lambda: Three(INITS[init]))
    m = lazy(lambda: Three(INITS[init]))
    with ap.simulate(4):
        mesh = ap.ProcessMesh(np.arange(4).reshape(mesh_shape).tolist(), [f"d{i}" for i in range(len(mesh_shape))])
        m.w = ap.shard_tensor(m.w, mesh, ap.parse_placements(",".join(placements)))
        ap.shard_layer(m, mesh)
        report = ap.materialize(m, chunk_elements=6)           # many small chunks
        for name in ("a", "w", "b"):
            p, want = getattr(m, name), getattr(ref, name).numpy()
            for r, t in p.locals.items():
                got = t.numpy()
                zeros = any(str(pl) == "P(sum)" and p.mesh.coords_of(r)[i] for i, pl in enumerate(p.placements))
                np.testing.assert_array_equal(got, np.zeros_like(got) if zeros else local_want(want, p, r))
    np.testing.assert_array_equal(paddle.rand([4]).numpy(), after)          # the generator ended in step
    w = report.by_name()["w"]
    assert w.how == {"constant": "constant", "assign": "array"}.get(init, "stream")
    assert not report.full_copies()


@pytest.mark.parametrize("init", ["normal", "xavier_u", "truncated"])
def test_zero_ranges_and_odd_chunks(init):
    """Flat ranges of the local shard (ZeRO-3 chunks) at odd offsets; chunk limit 3 (rounded to 2)."""
    ref, after = eager_and_next(lambda: Three(INITS[init]))
    m = lazy(lambda: Three(INITS[init]))
    with ap.simulate(4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], ["data", "model"])
        m.w = ap.shard_tensor(m.w, mesh, [ap.Replicate(), ap.Shard(1)])
        ap.shard_layer(m, mesh)
        local = 7 * 5 * 3                                        # rank 0/2 hold columns 0..4 of 9
        ranges = {id(m.w): {0: (0, 53), 2: (53, local), 1: (7, 8), 3: (0, 0)}}
        params = lazy_parameters(m)
        _, chunks = materialize_params(params, ranges, chunk_elements=3)
        want = ref.w.numpy()
        for r, (a, b) in ranges[id(m.w)].items():
            np.testing.assert_array_equal(chunks[id(m.w)][r].numpy(), local_want(want, m.w, r).reshape(-1)[a:b])
        assert not m.w.locals[0]._is_initialized()               # only the range exists
    np.testing.assert_array_equal(paddle.rand([4]).numpy(), after)


class Typed(nn.Layer):
    def __init__(self, dtype, init):
        super().__init__()
        self.w = self.create_parameter([7, 9], dtype=dtype, default_initializer=INITS[init]())
        self.b = self.create_parameter([5], dtype=dtype, default_initializer=nn.initializer.Normal())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
@pytest.mark.parametrize("init", ["normal", "xavier_u", "constant"])
def test_other_dtypes_and_relayout(dtype, init):
    """fp16 / bf16 parameters (drawn in fp32 and cast, or drawn directly, as paddle decides) and a lazy
    parameter laid out twice (the second layout wins, nothing is allocated in between)."""
    ref, after = eager_and_next(lambda: Typed(dtype, init))
    m = lazy(lambda: Typed(dtype, init))
    with ap.simulate(2):
        mesh = ap.ProcessMesh([0, 1], ["x"])
        first = ap.shard_tensor(m.w, mesh, [ap.Shard(0)])
        m.w = ap.shard_tensor(first, mesh, [ap.Shard(1)])
        assert not any(t._is_initialized() for t in first.locals.values())
        ap.materialize(ap.shard_layer(m, mesh), chunk_elements=4)
        for name in ("w", "b"):
            p = getattr(m, name)
            assert p.dtype == getattr(ref, name).dtype
            for r, t in p.locals.items():
                np.testing.assert_array_equal(t.numpy(), local_want(getattr(ref, name).numpy(), p, r))
    np.testing.assert_array_equal(paddle.rand([4]).numpy(), after)


class Padded(nn.Layer):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6, padding_idx=-3)                  # row 7 starts at zero in eager
        self.head = nn.Linear(6, 10)


@pytest.mark.parametrize("zero", [None, 3])
def test_embedding_padding_row_is_zero_like_eager(zero):
    ref, after = eager_and_next(Padded)
    assert not ref.emb.weight.numpy()[7].any() and ref.emb.weight.numpy()[6].any()
    m = lazy(Padded)
    opt = paddle.optimizer.SGD(0.1, parameters=m.parameters())
    with ap.simulate(4):
        m, opt = ap.parallelize(m, opt, strategy(tp=1, dp=4, zero=zero), tp_plan={})
        for n, p in m.named_parameters():
            want = dict(ref.named_parameters())[n].numpy().reshape(-1)
            for r, t in p.locals.items():
                if zero:
                    k, layout = opt.groups.index(r), opt._layout([p], r)
                    a = layout.starts[0][k]
                    np.testing.assert_array_equal(opt.master[r][id(p)].numpy(), want[a:a + layout.sizes[0][k]])
                else:
                    np.testing.assert_array_equal(t.numpy().reshape(-1), want)
    np.testing.assert_array_equal(paddle.rand([4]).numpy(), after)


# ---- GPT under ap.parallelize ----------------------------------------------------------------------------
def gpt(tied=False):
    return build(dataclasses.replace(PRESETS["gpt-tiny-tied" if tied else "gpt-tiny"], vocab_size=128))


MODELS = {"gpt": gpt, "gpt-tied": lambda: gpt(tied=True), "llama": lambda: build("llama-tiny")}


def is_constant(name: str) -> bool:
    """Biases and norm weights of the example models start as constants (no draw)."""
    return name.endswith(".bias") or "norm" in name or ".ln" in name or name.startswith("ln_")


class DrawLog:
    """Records the size of every random draw (wraps paddle's ops, independent of the materialiser)."""

    def __init__(self, monkeypatch):
        self.sizes = []
        for op in RANDOM_OPS:
            real = getattr(paddle._C_ops, op)
            monkeypatch.setattr(paddle._C_ops, op, self._wrap(real))

    def _wrap(self, real):
        def op(shape, *args):
            self.sizes.append(int(np.prod(shape)))
            return real(shape, *args)
        return op

    def per_parameter(self, ref):
        """Split the draws over the randomly initialised parameters of ``ref`` in creation order."""
        out, sizes = {}, list(self.sizes)
        for n, p in ref.named_parameters():
            if is_constant(n):
                continue
            got, numel = [], int(np.prod(p.shape))
            while sum(got) < numel:
                got.append(sizes.pop(0))
            assert sum(got) == numel, f"{n}: draws {got} do not add up to {numel}"
            out[n] = got
        assert not sizes, f"draws left over: {sizes}"
        return out


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("zero", [None, 3])
def test_tp2_dp2_shards_equal_eager_slices(kind, zero, monkeypatch):
    ref, after = eager_and_next(MODELS[kind])
    refv = {n: p.numpy() for n, p in ref.named_parameters()}
    m = lazy(MODELS[kind])
    opt = paddle.optimizer.AdamW(1e-3, parameters=m.parameters())        # built over the lazy parameters
    log = DrawLog(monkeypatch)
    with ap.simulate(4):
        m, opt = ap.parallelize(m, opt, strategy(zero=zero))
        monkeypatch.undo()
        np.testing.assert_array_equal(paddle.rand([4]).numpy(), after)
        for n, p in m.named_parameters():
            for r, t in p.locals.items():
                want = local_want(refv[n], p, r)
                if zero:                  # stage 3: never allocated; the master chunk is the rank's part
                    assert not t._is_initialized(), f"{n} rank {r}: local data allocated under ZeRO-3"
                    k, layout = opt.groups.index(r), opt._layout([p], r)
                    a = layout.starts[0][k]
                    got, want = opt.master[r][id(p)].numpy(), want.reshape(-1)[a:a + layout.sizes[0][k]]
                else:
                    got = t.numpy()
                np.testing.assert_array_equal(got, want, err_msg=f"{n} rank {r}")
                assert got.size < refv[n].size or not zero and p.placements == [ap.Replicate()] * 2
    # the probe: no draw was whole-size for a parameter split over the ranks
    draws = log.per_parameter(ref)
    for n, sizes in draws.items():
        p = dict(m.named_parameters())[n]
        split = zero or any(isinstance(pl, ap.Shard) for pl in p.placements)
        if split:
            assert max(sizes) < refv[n].size, f"{n}: drew {max(sizes)} of {refv[n].size} at once"
    assert not ap.init_report(m).full_copies()
    if kind == "gpt-tied":
        assert "lm_head.weight" not in refv and m.wte.weight.placements[1] == ap.Shard(0)


def batch():
    rng = np.random.default_rng(0)
    return paddle.to_tensor(rng.integers(0, 128, (4, 16))), paddle.to_tensor(rng.integers(0, 128, (4, 16)))


def one_step(model_fn, zero):
    m = model_fn()
    opt = paddle.optimizer.AdamW(1e-2, parameters=m.parameters())
    with ap.simulate(4):
        m, opt = ap.parallelize(m, opt, strategy(zero=zero))
        x, y = batch()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        if zero == 3:
            opt.gather(opt.params)
        return float(loss), {n: p.full().numpy() for n, p in m.named_parameters()}


@pytest.mark.parametrize("zero", [None, 2, 3])
def test_training_step_after_lazy_init_equals_eager(zero):
    def eager():
        paddle.seed(SEED)
        return gpt()

    loss_e, params_e = one_step(eager, zero)
    loss_l, params_l = one_step(lambda: lazy(gpt), zero)
    assert loss_l == loss_e
    for n, v in params_e.items():
        np.testing.assert_array_equal(params_l[n], v, err_msg=n)


# ---- order, per-parameter initialize(), fallbacks, negative controls --------------------------------------------
class Late(nn.Layer):
    """Registers its own parameter first but creates it after its sublayer (creation != registration)."""

    def __init__(self):
        super().__init__()
        fc = nn.Linear(6, 4)
        self.scale = self.create_parameter([4, 6], default_initializer=nn.initializer.Normal())
        self.fc = fc


def test_creation_order_beats_registration_order():
    ref, _ = eager_and_next(Late)
    assert [n for n, _ in Late().named_parameters()][0] == "scale"
    m = lazy(Late)
    ap.materialize(m)
    for n, p in ref.named_parameters():
        np.testing.assert_array_equal(dict(m.named_parameters())[n].numpy(), p.numpy())
    neg = lazy(Late)                                  # negative control: registration order differs
    materialize_params(list(neg.parameters()))
    assert not np.array_equal(neg.scale.numpy(), ref.scale.numpy())


def test_param_initialize_after_shard_layer():
    """paddle's convention: shard_layer, then param.initialize() on each parameter in order."""
    ref, after = eager_and_next(gpt)
    m = lazy(gpt)
    with ap.simulate(2):
        mesh = ap.ProcessMesh([0, 1], ["model"])
        ap.shard_layer(m, mesh, lambda name, sub, mesh: setattr(sub, "weight", ap.shard_tensor(
            sub.weight, mesh, [ap.Shard(1)])) if name.endswith("fc1") else None)
        for p in m.parameters():
            p.initialize()
        for n, p in ref.named_parameters():
            q = dict(m.named_parameters())[n]
            for r, t in q.locals.items():
                np.testing.assert_array_equal(t.numpy(), local_want(p.numpy(), q, r), err_msg=n)
    np.testing.assert_array_equal(paddle.rand([4]).numpy(), after)


def test_draw_between_build_and_parallelize_changes_values():
    """Negative control: the check above can fail."""
    ref, _ = eager_and_next(gpt)
    m = lazy(gpt)
    paddle.rand([1])
    with ap.simulate(4):
        m, _ = ap.parallelize(m, None, strategy())
        got = m.blocks[0].mlp.fc1.weight.full().numpy()
    assert not np.array_equal(got, ref.blocks[0].mlp.fc1.weight.numpy())


class Scaled(nn.initializer.Initializer):
    """An initializer computing on its draw (a scaled arange): it cannot be streamed."""

    def forward(self, var, block=None):
        n = int(np.prod(var.shape))
        out = paddle.arange(n, dtype="float32").reshape(var.shape) * paddle.rand([1])
        out._share_underline_tensor_to(var)


class Custom(nn.Layer):
    def __init__(self):
        super().__init__()
        self.w = self.create_parameter([6, 4], default_initializer=Scaled())
        self.b = self.create_parameter([4], default_initializer=nn.initializer.Normal())
        self.s = self.create_parameter([4, 2], default_initializer=NormalInitializer(0.0, 1.0, seed=7))


def test_unstreamable_initializer_falls_back_whole_with_a_warning():
    ref, after = eager_and_next(Custom)
    m = lazy(Custom)
    with ap.simulate(2):
        mesh = ap.ProcessMesh([0, 1], ["model"])
        m.w = ap.shard_tensor(m.w, mesh, [ap.Shard(0)])
        m.s = ap.shard_tensor(m.s, mesh, [ap.Shard(1)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = ap.materialize(ap.shard_layer(m, mesh))
        assert sum("initialised whole" in str(w.message) for w in caught) == 2
        assert [e.name for e in report.full_copies()] == ["w", "s"]
        assert report.by_name()["w"].how == report.by_name()["s"].how == "full"
        for name in ("w", "b", "s"):
            p = getattr(m, name)
            for r, t in p.locals.items():
                np.testing.assert_array_equal(t.numpy(), local_want(getattr(ref, name).numpy(), p, r))
    np.testing.assert_array_equal(paddle.rand([4]).numpy(), after)


def test_errors():
    m = lazy(gpt)
    with pytest.raises(TypeError, match="paddle.nn.Layer"):
        ap.materialize([1, 2])
    with pytest.raises(ValueError, match="chunk_elements"):
        ap.materialize(m, chunk_elements=1)
    with ap.simulate(2):
        mesh = ap.ProcessMesh([0, 1], ["model"])
        with pytest.raises(NotImplementedError, match="keeps its dtype"):
            ap.shard_tensor(m.wte.weight, mesh, [ap.Shard(0)], dtype="float64")
    s = ap.Strategy()
    s.pipeline_parallel.degree, s.pipeline_parallel.micro_batches = 2, 2
    with ap.simulate(2), pytest.raises(NotImplementedError, match="LazyGuard"):
        ap.parallelize(m, None, s)


def test_cpu_gaussian_continues_its_stream_only_over_even_chunks():
    """Why chunks are even: the CPU gaussian kernel draws pairs and drops the spare at the end of a call."""
    def draws(parts):
        paddle.seed(SEED)
        return np.concatenate([paddle.normal(0.0, 1.0, [n]).numpy() for n in parts])

    whole = draws([9])
    np.testing.assert_array_equal(draws([4, 2, 3]), whole)
    assert not np.array_equal(draws([3, 6]), whole)
