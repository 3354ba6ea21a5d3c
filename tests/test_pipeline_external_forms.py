"""``loss_fn(model(x), y)`` on a pipeline-parallel model (external_loss.py) for what users write besides an LM's
cross-entropy, in the simulated world, each against one process (every step's loss at rtol 1e-5, every rank's shard
of every parameter after two steps at rtol 1e-4 / atol 2e-5):

* a model without embed()/head() on feature vectors (an MLP split at its block list; the split's dry run takes
  float rows, dry_input.py): regression (``mse_loss``, ``l1_loss``, ``smooth_l1_loss``) and classification losses
  (``label_smoothing``, ``soft_label``, ``binary_cross_entropy_with_logits``, ``kl_div`` of ``log_softmax``,
  ``nll_loss``), a per-sample weighted loss, a mask from the labels, ``paddle.where``, ``astype``, ``reshape``, a
  slice of the classes; PP2 and PP2 x DP2;
* a model returning two heads (a tuple, a dict) with a loss combining both;
* metrics beside the loss (``argmax`` accuracy, ``shape``, ``detach()``, ``paddle.no_grad()``), before and after
  backward;
* two calls with different losses accumulated before ``opt.step()``;
* PaddleFormers Qwen2 and Qwen3-MoE under PP2 and PP2 x DP2 with the shifted LM loss;
* a CNN (float image dry run) with ``F.cross_entropy(model(x), y)`` in one expression after routing was undone, and
  a CNN the dry sample cannot feed (refused by name).

Every run uses SGD: AdamW divides by the root of the second moment, so an element whose gradient is near zero moves
by a good part of a step on float sums in another order (test_pipeline_external_loss.make_opt)."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import autoparallel as ap
from autoparallel.parallel.pipeline.call_forms import Withheld
from autoparallel.testing import paddleformers_models as pf

from test_pipeline_external_loss import compare as compare_lm, mismatches, shifted, strategy

D, C, B, IN = 16, 5, 8, 8


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return x + F.tanh(self.fc(x))


class MLP(nn.Layer):
    """Feature vectors in, ``C`` outputs; ``two``: also a one-output head, returned as a tuple or a dict."""

    def __init__(self, two=None):
        super().__init__()
        paddle.seed(0)
        self.inp, self.head = nn.Linear(IN, D), nn.Linear(D, C)
        self.blocks = nn.LayerList([Block() for _ in range(4)])
        self.two = two
        if two:
            self.head2 = nn.Linear(D, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        if self.two == "tuple":
            return self.head(h), self.head2(h)
        if self.two == "dict":
            return {"cls": self.head(h), "reg": self.head2(h)}
        return self.head(h)


def batches(kind, n=2, seed=0):
    """(x, y, w) per step: features, labels of ``kind`` (class ids, regression targets, soft or binary labels),
    per-sample weights."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.standard_normal((B, IN)).astype("float32")
        y = {"reg": lambda: rng.standard_normal((B, C)).astype("float32"),
             "soft": lambda: rng.dirichlet(np.ones(C), B).astype("float32"),
             "bin": lambda: (rng.random((B, C)) > 0.5).astype("float32"),
             "cls": lambda: rng.integers(0, C, (B,)).astype("int64")}[kind]()
        out.append((x, y, rng.random((B,)).astype("float32") + 0.1))
    return out


def run(model, opt, data, loss_fn, accum=1):
    losses = []
    for i, (x, y, w) in enumerate(data):
        loss = loss_fn(model(paddle.to_tensor(x)), paddle.to_tensor(y), paddle.to_tensor(w))
        loss.backward()
        losses.append(float(loss))
        if (i + 1) % accum == 0:
            opt.step()
            opt.clear_grad()
    return losses


def sgd(params):
    return paddle.optimizer.SGD(0.1, parameters=params)


def compare(loss_fn, kind, dp, two=None, accum=1):
    data = batches(kind, 2 * accum)
    ref = MLP(two)
    ref_losses = run(ref, sgd(ref.parameters()), data, loss_fn, accum)
    ref_params = {n: p.numpy() for n, p in ref.named_parameters()}
    with ap.simulate(world_size=2 * dp):
        m = MLP(two)
        pipe, opt = ap.parallelize(m, sgd(m.parameters()), strategy=strategy(dp))
        losses = run(pipe, opt, data, loss_fn, accum)
        bad = mismatches(pipe, ref_params)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert bad == []


# ---- the losses: the user's code, the same in one process and on the pipeline ----------------------------------
def weighted(o, y, w):
    return (F.cross_entropy(o, y, reduction="none").reshape([-1]) * w).sum() / w.sum()


def masked(o, y, w):
    keep = (y != 0).astype("float32")
    return (F.cross_entropy(o, y, reduction="none").reshape([-1]) * keep).sum() / keep.sum()


FORMS = {
    "mse": (lambda o, y, w: F.mse_loss(o, y), "reg"),
    "l1": (lambda o, y, w: F.l1_loss(o, y), "reg"),
    "smooth_l1": (lambda o, y, w: F.smooth_l1_loss(o, y), "reg"),
    "label_smoothing": (lambda o, y, w: F.cross_entropy(o, y, label_smoothing=0.1), "cls"),
    "soft_label": (lambda o, y, w: F.cross_entropy(o, y, soft_label=True).mean(), "soft"),
    "bce_with_logits": (lambda o, y, w: F.binary_cross_entropy_with_logits(o, y), "bin"),
    "kl_div": (lambda o, y, w: F.kl_div(F.log_softmax(o, -1), y, reduction="batchmean"), "soft"),
    "nll": (lambda o, y, w: F.nll_loss(F.log_softmax(o, -1), y), "cls"),
    "weighted": (weighted, "cls"),
    "mask_from_y": (masked, "cls"),
    "where": (lambda o, y, w: paddle.where(y.unsqueeze(-1) > 1, o, o * 0.5).pow(2).mean(), "cls"),
    "astype": (lambda o, y, w: F.cross_entropy(o.astype("float32"), y), "cls"),
    "reshape": (lambda o, y, w: F.cross_entropy(o.reshape([-1, C]), y), "cls"),
    "slice": (lambda o, y, w: F.cross_entropy(o[..., :3], paddle.clip(y, 0, 2)), "cls"),
}


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("name", list(FORMS))
def test_mlp_losses_equal_one_process(name, dp):
    compare(*FORMS[name], dp)


def test_mlp_is_split_from_a_float_dry_run():
    """The split of a model on feature vectors: the blocks over the stages, the input layer on the first stage and
    the head on the last (before: paddle's matmul error on the int64 token ids of the dry run, at parallelize)."""
    from autoparallel.parallel.pipeline.dry_input import dry_input
    from autoparallel.parallel.pipeline.stage import describe_model

    x = dry_input(MLP())
    assert list(x.shape) == [1, IN] and x.dtype == paddle.float32
    pieces = describe_model(MLP())
    assert pieces.layers_name == "blocks"
    assert set(pieces.embed_layers) == {"inp.weight", "inp.bias"}
    assert set(pieces.head_layers) == {"head.weight", "head.bias"}


@pytest.mark.parametrize("conv,expected", [
    (lambda: nn.Conv2D(3, 8, 3), [1, 3, 32, 32]),
    (lambda: nn.Conv2D(3, 8, 3, data_format="NHWC"), [1, 32, 32, 3]),
    (lambda: nn.Conv1D(5, 8, 3, data_format="NLC"), [1, 32, 5]),
    (lambda: nn.Conv3D(2, 4, 3, groups=2), [1, 2, 32, 32, 32]),
])
def test_a_cnn_dry_sample_follows_the_first_convolution(conv, expected):
    """A CNN's dry sample has the first convolution's input channels, in its data format, SIDE positions per axis."""
    from autoparallel.parallel.pipeline.dry_input import dry_input

    class CNN(nn.Layer):
        def __init__(self):
            super().__init__()
            self.conv = conv()

        def forward(self, x):
            return self.conv(x)

    model = CNN()
    x = dry_input(model)
    assert list(x.shape) == expected and x.dtype == paddle.float32
    assert model(x).shape[0] == 1                                   # the sample runs through the layer


# ---- several outputs -------------------------------------------------------------------------------------------
def two_tuple(o, y, w):
    return F.cross_entropy(o[0], y) + 0.5 * F.mse_loss(o[1].squeeze(-1), w)


def two_dict(o, y, w):
    return F.cross_entropy(o["cls"], y) + 0.5 * F.mse_loss(o["reg"].squeeze(-1), w)


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("two,loss_fn", [("tuple", two_tuple), ("dict", two_dict)], ids=["tuple", "dict"])
def test_two_heads_equal_one_process(two, loss_fn, dp):
    compare(loss_fn, "cls", dp, two=two)


def test_a_per_batch_output_is_withheld():
    """A model output that is not per sample (a summed auxiliary value): withheld, its use raises by name; the
    per-sample head still trains."""
    class Aux(MLP):
        def forward(self, x):
            out = super().forward(x)
            return out, (out ** 2).mean()

    x, y, _ = batches("cls", 1)[0]
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(Aux(), None, strategy=strategy())
        logits, aux = pipe(paddle.to_tensor(x))
        assert isinstance(aux, Withheld)
        with pytest.raises(NotImplementedError, match="output field 1 .* is not a per-sample tensor"):
            float(aux)
        F.cross_entropy(logits, paddle.to_tensor(y)).backward()
        assert all(p.grad is not None for p in pipe.parameters())


# ---- metrics, accumulation ---------------------------------------------------------------------------------------
def accuracy(o, y):
    return float((o.argmax(-1) == y).astype("float32").mean())


def test_metrics_beside_the_loss_equal_one_process():
    """``acc`` from ``argmax``, on the logits, their ``detach()`` and under ``paddle.no_grad()``, before and after
    backward; ``logits.shape`` the global one (PP2 x DP2)."""
    x, y, _ = batches("cls", 1, seed=3)[0]
    xt, yt = paddle.to_tensor(x), paddle.to_tensor(y)
    ref = MLP()
    want = accuracy(ref(xt), yt)
    with ap.simulate(world_size=4):
        pipe, _ = ap.parallelize(MLP(), None, strategy=strategy(2))
        logits = pipe(xt)
        assert list(logits.shape) == [B, C]
        got = [accuracy(logits, yt), accuracy(logits.detach(), yt)]
        with paddle.no_grad():
            got.append(accuracy(logits, yt))
        F.cross_entropy(logits, yt).backward()
        got.append(accuracy(logits, yt))
    assert got == [want] * 4


def test_two_calls_with_different_losses_accumulate_like_one_process():
    calls = []

    def alternate(o, y, w):
        calls.append(1)
        return F.cross_entropy(o, y) if len(calls) % 2 else F.cross_entropy(o, y, label_smoothing=0.1) * 0.5

    compare(alternate, "cls", 2, accum=2)


# ---- PaddleFormers ---------------------------------------------------------------------------------------------
PF_BATCHES = [pf.batch(i, b=8, t=8) for i in range(2)]


@pytest.mark.skipif(not pf.available(), reason="PaddleFormers is not installed")
@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_paddleformers_shifted_loss_equals_one_process(family, dp):
    def build():
        return pf.build(family, num_hidden_layers=2, tie_word_embeddings=False)

    ref_losses, losses, bad, _ = compare_lm(build, PF_BATCHES, shifted, strategy(dp), opt="sgd")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert bad == []


@pytest.mark.parametrize("two", ["tuple", "dict"])
def test_several_heads_refused_by_name_on_launched_ranks(two):
    """Launched ranks of other stages cannot learn a structure they never compute: the call is refused on every rank
    before any transfer (the pipeline's ranks set as on launched ranks; nothing runs)."""
    from autoparallel.parallel.pipeline import external_loss

    x, _, _ = batches("cls", 1)[0]
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(MLP(two), None, strategy=strategy())
        pipe.ranks = np.array([[0], [1]])
        with pytest.raises(NotImplementedError) as e:
            pipe(paddle.to_tensor(x))
    assert str(e.value) == external_loss.HEADS_LAUNCHED
    assert str(e.value).startswith("loss_fn(model(x), y) with a model returning several outputs without a logits "
                                   "field, on launched ranks: return the logits alone")


def test_negative_control_one_head_gradient_dropped(monkeypatch):
    """The second head's gradient zeroed before the pipeline's backward: the same comparison fails."""
    from autoparallel.parallel.pipeline import external_loss

    cut, seen = external_loss._micro_inbox, []

    def drop_second(leaves, out0, m):
        seen.append(1)
        grads = cut(leaves, out0, m)
        return grads if len(seen) % 2 else [paddle.zeros_like(g) for g in grads]

    monkeypatch.setattr(external_loss, "_micro_inbox", drop_second)
    with pytest.raises(AssertionError):
        compare(two_tuple, "cls", 1, two="tuple")


# ---- a CNN: the split's dry run takes a float image; paddle routed before the first call ----------------------
class ConvBlock(nn.Layer):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2D(4, 4, 3, padding=1)

    def forward(self, x):
        return x + F.relu(self.conv(x))


class CNN(nn.Layer):
    def __init__(self, flat_side=None):
        super().__init__()
        paddle.seed(0)
        self.stem = nn.Conv2D(3, 4, 3, padding=1)
        self.blocks = nn.LayerList([ConvBlock() for _ in range(4)])
        self.flat_side = flat_side
        self.head = nn.Linear(4 * (flat_side or 1) ** 2, C)

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h.flatten(1) if self.flat_side else h.mean(axis=[2, 3]))


@pytest.mark.parametrize("dp", [1, 2])
def test_cnn_inline_loss_equals_one_process_with_dispatch_routed_at_build(dp):
    """``F.cross_entropy(model(x), y)`` in one expression looks ``F.cross_entropy`` up before the call runs: the
    pipeline routes paddle's functions when it is built (a pipeline without data / tensor parallelism creates no
    distributed tensor before its first call), so the first step is not paddle's own function on a DistTensor."""
    rng = np.random.default_rng(1)
    data = [(rng.standard_normal((B, 3, 8, 8)).astype("float32"), rng.integers(0, C, (B,)).astype("int64"))
            for _ in range(2)]

    def steps(model, opt):
        out = []
        for x, y in data:
            loss = F.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y))
            loss.backward()
            opt.step()
            opt.clear_grad()
            out.append(float(loss))
        return out

    ref = CNN()
    ref_losses = steps(ref, sgd(ref.parameters()))
    ref_params = {n: p.numpy() for n, p in ref.named_parameters()}
    ap.uninstall(force=True)                       # as in a fresh process: nothing routed yet
    with ap.simulate(world_size=2 * dp):
        m = CNN()
        pipe, opt = ap.parallelize(m, sgd(m.parameters()), strategy=strategy(dp))
        losses = steps(pipe, opt)
        bad = mismatches(pipe, ref_params)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert bad == []


def test_a_dry_run_the_sample_cannot_feed_is_refused_by_name():
    """A CNN whose head needs 8 x 8 images: the split's dry sample (32 x 32) cannot run its forward; the refusal
    names the model, the sample, paddle's error and the remedy (embed()/head() methods)."""
    with ap.simulate(world_size=2):
        m = CNN(flat_side=8)
        with pytest.raises(NotImplementedError) as e:
            ap.parallelize(m, sgd(m.parameters()), strategy=strategy(1))
    msg = str(e.value)
    assert msg.startswith("splitting CNN into pipeline stages runs its forward on a made-up sample (float32 zeros "
                          "of shape [1, 3, 32, 32]")
    assert "ValueError: (InvalidArgument) In operator matmul" in msg
    assert "embed(ids) and head(hidden)" in msg
