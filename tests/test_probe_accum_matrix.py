"""Gradient accumulation and gradient scaling through every entry point: the same user loop, in a 4-rank
simulated world, against that loop in one plain paddle process (losses of every micro-batch, every parameter after
two optimizer steps). SGD makes a gradient off by a factor visible (AdamW's update hides a constant factor).

Two contracts (docs/entry_points.md, docs/training_loops.md):
* paddle's: ``ap.shard_optimizer(opt, None | ShardingStage1/2/3, gradient_accumulation_steps=k)``, a plain paddle
  optimizer over hand-annotated parameters, ``no_sync``: the loop divides its loss (or sums, as one process does),
  the step divides nothing;
* the strategy's: ``strategy.gradient_accumulation_steps = k`` (``gradient_merge.enable / k_steps / avg``) through
  ``ap.parallelize``, ``ap.DataParallel`` + ``ap.Optimizer``, ``ap.to_static``: the step averages the k backward
  passes, the loop leaves the loss alone; with pp > 1 the k are the pipeline's micro-batches (train_batch's mean).

Found wrong here (fixed):
* ``paddle.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` by hand before ``opt.step()`` under the strategy's
  accumulation clipped the undivided sum (the norm k times one process's, the update clipped k times harder), and
  under ``strategy.amp`` float16 the loss-scaled gradients (norm x 65536: the update all but vanished), on a
  pipeline too; on a pipeline a hand clip reduced the data-parallel gradients a second time (the step reduced
  them again: summed twice, clipping or not);
* a wrapper from ``ap.shard_optimizer`` handed on to ``ap.parallelize`` / ``ap.Optimizer`` / ``ap.to_static`` / a
  pipeline kept its own gradient reduction next to the returned optimizer's (summed twice when its hooks came
  last: by set order, so by chance);
* ``ap.shard_optimizer(opt, ..., gradient_accumulation_steps=n)`` handed to ``ap.parallelize`` / ``ap.Optimizer``
  with the strategy's ``gradient_accumulation_steps = k > 1`` divided twice (the loop by n, the step by k), and
  handed to ``ap.to_static`` with ``k != n`` its window was dropped; both raise now, naming the two values.

Checked and equal to one process: DP4, DP2 x TP2, ZeRO 1/2/3 on DP4, ZeRO-2 + TP, ZeRO-3 offload, HSDP, lazy
ZeRO-3; loops dividing or summing, ``clear_grad(set_to_zero=False)``, ``opt.minimize``, ``GradScaler`` (step and
minimize), ``ClipGradByGlobalNorm`` on the accumulated gradient, an LR scheduler per optimizer step, windows longer
and shorter than the declared k; ``no_sync``; ``ap.to_static``'s k micro-batches; pipelines (``train_batch`` with the
strategy's k or paddle's ``pipeline.accumulate_steps``, the called form with the loop's own accumulation, ZeRO-2)."""
import contextlib

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.testing.gpu_scaler import gpu_grad_scaler
from loops2_helpers import MLP

K = 2
RNG = np.random.default_rng(0)
XS = [RNG.standard_normal((8, 6)).astype("float32") for _ in range(9)]
YS = [RNG.standard_normal((8, 4)).astype("float32") for _ in range(9)]
TP_PLAN = {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()}
STAGES = {0: None, 1: ap.ShardingStage1, 2: ap.ShardingStage2, 3: ap.ShardingStage3}


def make(opt="sgd", clip=False, sched=False):
    """model, optimizer and its LR scheduler (or None); a clip small enough to act on every step."""
    paddle.seed(3)
    m = MLP()
    lr = paddle.optimizer.lr.ExponentialDecay(0.05, gamma=0.5) if sched else 0.05
    gc = paddle.nn.ClipGradByGlobalNorm(0.05) if clip else None
    kind = paddle.optimizer.SGD if opt == "sgd" else paddle.optimizer.AdamW
    return m, kind(lr, parameters=m.parameters(), grad_clip=gc), (lr if sched else None)


def full(t):
    return (t.full() if ap.is_dist(t) else t).numpy()


def params(m) -> dict:
    return {n: full(p) for n, p in m.named_parameters()}


def loop(m, opt, x=paddle.to_tensor, form="div", k=K, div=float(K), sched=None, steps=2):
    """``steps`` optimizer steps of ``k`` micro-batches, each ``(loss / div).backward()``; ``form``: how the step
    and the clearing are written (div / keep / minimize / scaler / scaler_min)."""
    scaler = gpu_grad_scaler(init_loss_scaling=1024.0) if form.startswith("scaler") else None   # enabled on CPU
    losses = []
    for s in range(steps):
        for i in range(k):
            loss = F.mse_loss(m(x(XS[s * k + i])), paddle.to_tensor(YS[s * k + i]))
            losses.append(float(loss))
            out = _scaled(scaler, loss / div) if scaler else loss / div
            out.backward()
        if form == "scaler":
            scaler.step(opt)
            scaler.update()
        elif form == "scaler_min":
            scaler.minimize(opt, out)
        elif form == "minimize":
            opt.minimize(loss)
        else:
            opt.step()
        opt.clear_grad(set_to_zero=form != "keep")
        if sched is not None:
            sched.step()
    return losses, params(m)


def _scaled(scaler, loss):
    """``scaler.scale(loss)`` as under float16 autocast (paddle turns a dynamic scaler off outside one)."""
    with paddle.amp.auto_cast(dtype="float16"):
        out = scaler.scale(loss)
    assert scaler._enable and float(out) == pytest.approx(float(loss) * 1024.0, rel=1e-6)
    return out


FORMS = {"div": {}, "sum": {}, "keep": {}, "minimize": {}, "scaler": {}, "scaler_min": {},
         "clip": {"clip": True}, "sched": {"sched": True}, "adamw": {"opt": "adamw"}}


def reference(form, div=float(K)):
    m, opt, sched = make(**FORMS[form])
    return loop(m, opt, form=form, div=1.0 if form == "sum" else div, sched=sched)


def same(got, want, rtol=1e-5, atol=2e-6):
    np.testing.assert_allclose(got[0], want[0], rtol=rtol, atol=1e-6)
    assert sorted(got[1]) == sorted(want[1])
    for n, v in want[1].items():
        np.testing.assert_allclose(got[1][n], v, rtol=rtol, atol=atol, err_msg=n)


def _mesh(layout):
    if layout == "dp4":
        return ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"]), [ap.Shard(0)]
    return ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]), [ap.Shard(0), ap.Replicate()]


def _tp_fn(name, layer, mesh):
    if name == "fc1":
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Replicate(), ap.Shard(1)])
        layer.bias = ap.shard_tensor(layer.bias, mesh, [ap.Replicate(), ap.Shard(0)])
    elif name == "fc2":
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Replicate(), ap.Shard(0)])


def shard_optimizer_run(layout, stage, form, k=K, window=K):
    """shard_layer + shard_optimizer(opt, None | ShardingStage, gradient_accumulation_steps=window); the loop divides
    its loss (paddle's contract) unless ``form == "sum"``."""
    with ap.simulate(world_size=4):
        m, opt, sched = make(**FORMS[form])
        mesh, pl = _mesh(layout)
        m = ap.shard_layer(m, mesh, _tp_fn if layout == "dp2tp2" else None)
        stage_fn = STAGES[stage]("dp", mesh) if stage else None
        opt = ap.shard_optimizer(opt, stage_fn, gradient_accumulation_steps=window)
        return loop(m, opt, lambda a: ap.shard_tensor(paddle.to_tensor(a), mesh, pl), form, k,
                    1.0 if form == "sum" else float(k), sched)


def strategy(dp=4, tp=1, stage=0, k=K, offload=False, degree=None, merge=False):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    if stage:
        s.sharding.enable, s.sharding.stage, s.sharding.offload, s.sharding.degree = True, stage, offload, degree
    if merge:                                              # paddle's names for the same field
        s.gradient_merge.enable, s.gradient_merge.k_steps, s.gradient_merge.avg = True, k, True
    else:
        s.gradient_accumulation_steps = k
    return s


def strategy_run(form, entry="parallelize", div=1.0, lazy=False, **kw):
    """The strategy's accumulation: the step averages, so the loop leaves its loss alone (``divide=False``)."""
    with ap.simulate(world_size=4):
        if lazy:
            with paddle.LazyGuard():
                m, opt, sched = make(**FORMS[form])
        else:
            m, opt, sched = make(**FORMS[form])
        s = strategy(merge=entry == "gradient_merge", **kw)
        plan = TP_PLAN if s.tensor_parallel.degree > 1 else None
        if entry == "DataParallel":
            m = ap.DataParallel(m, strategy=s, tp_plan=plan)
            opt = ap.Optimizer(opt)
        else:
            m, opt = ap.parallelize(m, opt, strategy=s, tp_plan=plan)
        return loop(m, opt, form=form, k=s.gradient_accumulation_steps, div=div, sched=sched)


# ---- paddle's contract: the loop divides (or sums), the step divides nothing ------------------------------------
SHARD_CASES = [(lay, st, f) for lay, st in [("dp4", 0), ("dp4", 1), ("dp4", 2), ("dp4", 3), ("dp2tp2", 0),
                                            ("dp2tp2", 1), ("dp2tp2", 2)] for f in ("div", "sum")]
SHARD_CASES += [(lay, st, f) for lay, st in [("dp4", 0), ("dp4", 2), ("dp4", 3), ("dp2tp2", 1)]
                for f in ("keep", "minimize", "scaler", "clip", "sched", "adamw")]


@pytest.mark.parametrize("layout,stage,form", SHARD_CASES)
def test_shard_optimizer_accumulation_equals_one_process(layout, stage, form):
    same(shard_optimizer_run(layout, stage, form), reference(form))


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("window", [1, 3])
def test_shard_optimizer_window_other_than_the_loop_changes_no_value(stage, window):
    """The window is when the reductions run; a loop accumulating over another count still equals one process."""
    same(shard_optimizer_run("dp4", stage, "div", window=window), reference("div"))


@pytest.mark.parametrize("layout", ["dp4", "dp2tp2"])
@pytest.mark.parametrize("form", ["div", "sum", "clip"])
def test_plain_paddle_optimizer_over_hand_annotated_parameters(layout, form):
    with ap.simulate(world_size=4):
        m, opt, _ = make(**FORMS[form])
        mesh, pl = _mesh(layout)
        if layout == "dp4":
            for lin in (m.fc1, m.fc2):
                lin.weight = ap.shard_tensor(lin.weight, mesh, [ap.Replicate()])
                lin.bias = ap.shard_tensor(lin.bias, mesh, [ap.Replicate()])
        else:
            _tp_fn("fc1", m.fc1, mesh)
            _tp_fn("fc2", m.fc2, mesh)
            m.fc2.bias = ap.shard_tensor(m.fc2.bias, mesh, [ap.Replicate(), ap.Replicate()])
        got = loop(m, opt, lambda a: ap.shard_tensor(paddle.to_tensor(a), mesh, pl), form, K,
                   1.0 if form == "sum" else float(K))
    same(got, reference(form))


# ---- the strategy's contract: the step averages the k backward passes ------------------------------------------
LAYOUTS = {"dp4": {}, "dp2tp2": {"dp": 2, "tp": 2}, "zero1": {"stage": 1}, "zero2": {"stage": 2},
           "zero3": {"stage": 3}, "zero2+tp": {"dp": 2, "tp": 2, "stage": 2},
           "zero3 offload": {"stage": 3, "offload": True}, "hsdp zero2": {"stage": 2, "degree": 2}}
STRATEGY_CASES = [("parallelize", lay, f) for lay in LAYOUTS for f in ("div", "clip")]
STRATEGY_CASES += [("parallelize", lay, f) for lay in ("dp2tp2", "zero2", "zero3")
                   for f in ("keep", "minimize", "scaler", "scaler_min", "sched", "adamw")]
STRATEGY_CASES += [(e, lay, "clip") for e in ("DataParallel", "gradient_merge") for lay in ("dp2tp2", "zero3")]


@pytest.mark.parametrize("entry,layout,form", STRATEGY_CASES)
def test_strategy_accumulation_averages_in_the_step(entry, layout, form):
    same(strategy_run(form, entry, **LAYOUTS[layout]), reference(form))


def test_strategy_accumulation_over_lazy_parameters_zero3():
    same(strategy_run("div", lazy=True, stage=3), reference("div"))


def test_negative_control_a_loop_that_also_divides_differs():
    """The strategy's step divides: a loop dividing as well gets 1/k^2, which the comparison must see."""
    got = strategy_run("div", div=float(K), stage=2)
    with pytest.raises(AssertionError):
        same(got, reference("div"))
    same(got, reference("div", div=float(K * K)))       # what it is: one process dividing by k twice


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("loop_k", [1, 3])
def test_strategy_window_other_than_the_loop(stage, loop_k):
    """A step after another count of backward passes still divides by the strategy's k (one process: loss / k)."""
    with ap.simulate(world_size=4):
        m, opt, _ = make()
        m, opt = ap.parallelize(m, opt, strategy=strategy(stage=stage))
        got = _uneven_loop(m, opt, loop_k, 1.0)
    m, opt, _ = make()
    same(got, _uneven_loop(m, opt, loop_k, float(K)))


def _uneven_loop(m, opt, loop_k, div):
    losses = []
    for s in range(3):
        for i in range(loop_k):
            loss = F.mse_loss(m(paddle.to_tensor(XS[s * loop_k + i])), paddle.to_tensor(YS[s * loop_k + i]))
            (loss / div).backward()
            losses.append(float(loss))
        opt.step()
        opt.clear_grad()
    return losses, params(m)


@pytest.mark.parametrize("run", ["parallelize", "parallelize zero3", "shard_optimizer zero2"])
def test_no_sync_accumulation(run):
    with ap.simulate(world_size=4):
        m, opt, _ = make()
        if run.startswith("parallelize"):
            m, opt = ap.parallelize(m, opt, strategy=strategy(stage=3 if "zero3" in run else 0))
            x, div = paddle.to_tensor, 1.0
        else:
            mesh, pl = _mesh("dp4")
            m = ap.shard_layer(m, mesh)
            opt = ap.shard_optimizer(opt, ap.ShardingStage2("dp", mesh), gradient_accumulation_steps=K)
            x, div = (lambda a: ap.shard_tensor(paddle.to_tensor(a), mesh, pl)), float(K)
        losses = []
        for s in range(2):
            for i in range(K):
                with m.no_sync() if i < K - 1 else contextlib.nullcontext():
                    loss = F.mse_loss(m(x(XS[s * K + i])), paddle.to_tensor(YS[s * K + i]))
                    (loss / div).backward()
                losses.append(float(loss))
            opt.step()
            opt.clear_grad()
        got = losses, params(m)
    same(got, reference("div"))


@pytest.mark.parametrize("layout", ["dp4", "dp2tp2", "zero2", "zero3", "clip"])
def test_to_static_train_step_averages_its_micro_batches(layout):
    kw = {"clip": {}, **LAYOUTS}.get(layout, {})
    form = "clip" if layout == "clip" else "div"
    with ap.simulate(world_size=4):
        m, opt, _ = make(**FORMS[form])
        s = strategy(**kw)
        spec = [([8 * K, 6], "float32"), ([8 * K, 4], "float32")]
        dm = ap.to_static(m, None, F.mse_loss, opt, strategy=s, input_spec=spec,
                          tp_plan=TP_PLAN if s.tensor_parallel.degree > 1 else None)
        losses = [dm.train_step([(paddle.to_tensor(XS[j]), paddle.to_tensor(YS[j])) for j in (2 * s_, 2 * s_ + 1)])
                  for s_ in range(2)]
        got = losses, params(m)
    want = reference(form)
    same(got, ([float(np.mean(want[0][i:i + K])) for i in range(0, 2 * K, K)], want[1]))


# ---- pipelines: the strategy's k are micro-batches of one train_batch -----------------------------------------
def _gpt():
    from examples.models import GPT, GPTConfig

    paddle.seed(0)
    return GPT(GPTConfig(vocab_size=32, hidden=16, layers=2, heads=2, max_positions=8))


def _lm(i):
    r = np.random.default_rng(i)
    return paddle.to_tensor(r.integers(0, 32, (8, 8))), paddle.to_tensor(r.integers(0, 32, (8, 8)))


def _gpt_opt(m, clip):
    return paddle.optimizer.SGD(0.5, parameters=m.parameters(),
                                grad_clip=paddle.nn.ClipGradByGlobalNorm(0.05) if clip else None)


def _gpt_reference(calls, clip=False):
    m = _gpt()
    opt = _gpt_opt(m, clip)
    losses = []
    for s in range(2):
        for c in range(calls):
            x, y = _lm(s * calls + c)
            loss = F.cross_entropy(m(x), y).mean()
            (loss / calls).backward()
            losses.append(float(loss))
        opt.step()
        opt.clear_grad()
    return losses, params(m)


@pytest.mark.parametrize("form", ["strategy k", "pipeline.accumulate_steps", "called, loop accumulates", "zero2 clip"])
def test_pipeline_micro_batches_and_accumulation(form):
    calls = 2 if form.startswith("called") else 1
    clip = "clip" in form
    with ap.simulate(world_size=4):
        m = _gpt()
        opt = _gpt_opt(m, clip)
        s = ap.Strategy()
        s.data_parallel.degree, s.pipeline_parallel.degree = 2, 2
        if form == "pipeline.accumulate_steps":
            s.pipeline.accumulate_steps = K
        else:
            s.gradient_accumulation_steps = K
        if "zero2" in form:
            s.sharding.enable, s.sharding.stage = True, 2
        pipe, opt = ap.parallelize(m, opt, strategy=s)
        losses = []
        for st in range(2):
            for c in range(calls):
                x, y = _lm(st * calls + c)
                if calls > 1:
                    loss = pipe(x, labels=y)
                    loss = loss[0] if isinstance(loss, (tuple, list)) else getattr(loss, "loss", loss)
                    (loss / calls).backward()
                    losses.append(float(loss))
                else:
                    losses.append(float(pipe.train_batch(x, y)))
            opt.step()
            opt.clear_grad()
        got = losses, params(pipe)
    same(got, _gpt_reference(calls, clip), rtol=1e-4, atol=2e-5)


# ---- found: a clip by hand under the strategy's accumulation / loss scale ----------------------------------------
def _hand_clip_loop(m, opt, div, how, scale=None, scaler=None):
    """``scale``: strategy.amp's ``opt.scale``; ``scaler``: a GradScaler, unscaled (``unscale_``) before the clip."""
    losses, norms = [], []
    bound = 0.05 if how == "norm" else 0.02
    for s in range(2):
        for i in range(K):
            loss = F.mse_loss(m(paddle.to_tensor(XS[s * K + i])), paddle.to_tensor(YS[s * K + i]))
            out = scale(loss / div) if scale else _scaled(scaler, loss / div) if scaler else loss / div
            out.backward()
            losses.append(float(loss))
        if scaler is not None:
            scaler.unscale_(opt)
        if how == "norm":
            norms.append(float(paddle.nn.utils.clip_grad_norm_(m.parameters(), bound)))
        else:
            paddle.nn.utils.clip_grad_value_(m.parameters(), bound)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.clear_grad()
    return losses, params(m), norms


@pytest.mark.parametrize("how", ["norm", "value"])
@pytest.mark.parametrize("layout,amp", [("dp4", None), ("dp2tp2", None), ("dp4", "float16"), ("dp4", "GradScaler")])
def test_clip_by_hand_sees_the_gradient_the_step_uses(how, layout, amp):
    scaler = (lambda: gpu_grad_scaler(init_loss_scaling=1024.0)) if amp == "GradScaler" else lambda: None
    with ap.simulate(world_size=4):
        m, opt, _ = make()
        s = strategy(**LAYOUTS[layout])
        if amp == "float16":
            s.amp.enable, s.amp.dtype = True, amp
        m, opt = ap.parallelize(m, opt, strategy=s, tp_plan=TP_PLAN if layout == "dp2tp2" else None)
        got = _hand_clip_loop(m, opt, 1.0, how, opt.scale if amp == "float16" else None, scaler())
    m, opt, _ = make()
    want = _hand_clip_loop(m, opt, float(K), how, scaler=scaler())
    tol = 2e-3 if amp == "float16" else 1e-5                 # float16 rounding of the emulated AMP
    same(got[:2], want[:2], rtol=tol, atol=tol / 10)
    np.testing.assert_allclose(got[2], want[2], rtol=tol)  # the returned norm is one process's too


def test_clip_by_hand_of_the_paddle_contract_divides_nothing_more():
    """shard_optimizer leaves the division to the loop: the hand clip takes the gradient as it is."""
    with ap.simulate(world_size=4):
        m, opt, _ = make()
        mesh, pl = _mesh("dp4")
        m = ap.shard_layer(m, mesh)
        opt = ap.shard_optimizer(opt, None, gradient_accumulation_steps=K)
        x = lambda a: ap.shard_tensor(paddle.to_tensor(a), mesh, pl)          # noqa: E731
        losses, norms = [], []
        for s in range(2):
            for i in range(K):
                loss = F.mse_loss(m(x(XS[s * K + i])), paddle.to_tensor(YS[s * K + i]))
                (loss / K).backward()
                losses.append(float(loss))
            norms.append(float(paddle.nn.utils.clip_grad_norm_(m.parameters(), 0.05)))
            opt.step()
            opt.clear_grad()
        got = losses, params(m), norms
    m, opt, _ = make()
    want = _hand_clip_loop(m, opt, float(K), "norm")
    same(got[:2], want[:2])
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5)


# ---- found: shard_optimizer's window handed to an entry point with the strategy's own ----------------------------
def _shard_optimizer_over_plain(window):
    m, opt, _ = make()
    return m, ap.shard_optimizer(opt, None, gradient_accumulation_steps=window)


@pytest.mark.parametrize("entry", ["parallelize", "DataParallel"])
def test_shard_optimizer_window_with_the_strategy_accumulation_refused(entry):
    with ap.simulate(world_size=4):
        m, opt = _shard_optimizer_over_plain(K)
        with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2\).*the strategy has "
                                             r"gradient_accumulation_steps=2; expected"):
            if entry == "DataParallel":
                ap.DataParallel(m, strategy=strategy())
                ap.Optimizer(opt)
            else:
                ap.parallelize(m, opt, strategy=strategy())


def test_shard_optimizer_window_with_a_strategy_that_does_not_divide_equals_one_process():
    """The strategy's k = 1: the loop divides (paddle's contract), nothing is divided twice."""
    with ap.simulate(world_size=4):
        m, opt = _shard_optimizer_over_plain(K)
        m, opt = ap.parallelize(m, opt, strategy=strategy(k=1))
        got = loop(m, opt)
    same(got, reference("div"))


def test_to_static_refuses_a_shard_optimizer_window_it_would_drop():
    spec = [([8, 6], "float32"), ([8, 4], "float32")]
    with ap.simulate(world_size=4):
        m, opt = _shard_optimizer_over_plain(K)
        with pytest.raises(ValueError, match=r"ap.to_static: .*gradient_accumulation_steps=2\).*expected "
                                             r"strategy.gradient_accumulation_steps=2"):
            ap.to_static(m, None, F.mse_loss, opt, strategy=strategy(k=1), input_spec=spec)
    with ap.simulate(world_size=4):                 # the same window in the strategy: train_step averages it
        m, opt = _shard_optimizer_over_plain(K)
        spec = [([8 * K, 6], "float32"), ([8 * K, 4], "float32")]
        dm = ap.to_static(m, None, F.mse_loss, opt, strategy=strategy(), input_spec=spec)
        losses = [dm.train_step([(paddle.to_tensor(XS[j]), paddle.to_tensor(YS[j])) for j in (2 * s, 2 * s + 1)])
                  for s in range(2)]
        got = losses, params(m)
    want = reference("div")
    same(got, ([float(np.mean(want[0][i:i + K])) for i in range(0, 2 * K, K)], want[1]))


# ---- found: a shard_optimizer handed to an entry point kept its own reduction ------------------------------------
@pytest.mark.parametrize("entry", ["parallelize", "Optimizer", "to_static"])
def test_a_shard_optimizer_handed_to_an_entry_point_reduces_nothing_more(entry):
    """The wrapper the caller still holds planned buckets at the first backward next to the entry point's; whichever
    hooked the gradients last reduced them in backward and the other again at the step (summed twice, by set
    order). Now the handed wrapper is retired: one reduction owns the parameters."""
    from autoparallel.parallel.grads import owners_of

    with ap.simulate(world_size=4):
        m, held = _shard_optimizer_over_plain(1)
        if entry == "to_static":
            dm = ap.to_static(m, None, F.mse_loss, held, strategy=strategy(k=1),
                              input_spec=[([8, 6], "float32"), ([8, 4], "float32")])
            step = [dm.train_step((paddle.to_tensor(XS[j]), paddle.to_tensor(YS[j]))) for j in range(2)]
            got = step, params(m)
        else:
            if entry == "Optimizer":
                ap.DataParallel(m, strategy=strategy(k=1))
                opt = ap.Optimizer(held)
            else:
                m, opt = ap.parallelize(m, held, strategy=strategy(k=1))
            got = loop(m, opt, k=1, div=1.0)
        assert len(owners_of(list(m.parameters()))) == 1
    m, opt, _ = make()
    same(got, loop(m, opt, k=1, div=1.0))


def _pipeline_hand_clip(wrap, bound, amp=None, called=False, clear_model=False, steps=2):
    with ap.simulate(world_size=4):
        m = _gpt()
        opt = _gpt_opt(m, False)
        s = ap.Strategy()
        s.data_parallel.degree, s.pipeline_parallel.degree, s.gradient_accumulation_steps = 2, 2, K
        if amp:
            s.amp.enable, s.amp.dtype = True, amp
        pipe, opt = ap.parallelize(m, ap.shard_optimizer(opt) if wrap else opt, strategy=s)
        losses, norms = [], []
        for st in range(steps):
            x, y = _lm(st)
            if called:
                loss = pipe(x, labels=y)
                loss = loss[0] if isinstance(loss, (tuple, list)) else getattr(loss, "loss", loss)
                loss.backward()
                losses.append(float(loss))
            else:
                losses.append(float(pipe.train_batch(x, y)))
            norms.append(float(paddle.nn.utils.clip_grad_norm_(pipe.parameters(), bound)))
            opt.step()
            pipe.clear_gradients() if clear_model else opt.clear_grad()
        return losses, params(pipe), norms


@pytest.mark.parametrize("wrap", [False, True], ids=["paddle optimizer", "shard_optimizer"])
@pytest.mark.parametrize("bound", [1000.0, 0.05], ids=["no clip", "clip"])
def test_clip_by_hand_on_a_pipeline_reduces_once(wrap, bound):
    """A pipeline's optimizer reduces at the step (no backward hooks): the hand clip's reduction and the step's
    both ran, summing the data-parallel gradients twice even when nothing was clipped."""
    _pipeline_clip_matches(_pipeline_hand_clip(wrap, bound), bound, 1e-5)


@pytest.mark.parametrize("called", [False, True], ids=["train_batch", "called"])
def test_clip_by_hand_on_a_float16_pipeline_sees_unscaled_gradients(called):
    """strategy.amp float16 on a pipeline: every backward runs on the pipeline's loss scale, which the clip took
    for the gradient (norm x 65536)."""
    _pipeline_clip_matches(_pipeline_hand_clip(False, 0.05, "float16", called), 0.05, 1e-3)


def test_clip_by_hand_on_a_pipeline_cleared_through_the_model():
    """The step ends the window (not ``opt.clear_grad``): cleared by ``pipe.clear_gradients()`` the next windows
    reduce their gradients again."""
    _pipeline_clip_matches(_pipeline_hand_clip(False, 0.05, clear_model=True, steps=3), 0.05, 1e-5, steps=3)


def _pipeline_clip_matches(got, bound, tol, steps=2):
    m = _gpt()
    opt = _gpt_opt(m, False)
    losses, norms = [], []
    for st in range(steps):
        x, y = _lm(st)
        loss = F.cross_entropy(m(x), y).mean()
        loss.backward()
        losses.append(float(loss))
        norms.append(float(paddle.nn.utils.clip_grad_norm_(m.parameters(), bound)))
        opt.step()
        opt.clear_grad()
    same(got[:2], (losses, params(m)), rtol=max(tol, 1e-4), atol=2e-5)
    np.testing.assert_allclose(got[2], norms, rtol=tol)

