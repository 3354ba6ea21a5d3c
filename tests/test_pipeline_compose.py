"""Pipeline parallelism composed with gradient clipping, recompute and AMP, in the simulated world.

* clipping by the global norm over every stage (data / tensor parallel inside them, a tied embedding counted
  once) equals one process with the same ``ClipGradByGlobalNorm``; clipping each stage by its own norm does not;
* recompute inside the stages (full in segments cut at the stage bounds, selective) gives exactly the
  values of the same pipeline without recompute, and the recomputed parts really run twice;
* AMP (float16 with loss scaling, bfloat16; O1 / O2) equals one process under the same emulated autocast,
  ``paddle.amp.auto_cast`` and ``GradScaler``; an overflow on one stage skips the step on every stage."""

import numpy as np
import paddle
import pytest

import pp_common

import autoparallel as ap
from autoparallel.parallel.pipeline.runtime import apply_pp

STEPS, CLIP, RTOL, ATOL = 2, 0.05, 1e-4, 2e-5          # 2 steps: the second runs on the first's AdamW state
_REFS = {}


def optimizer(params, clip=CLIP, sgd=False):
    grad_clip = paddle.nn.ClipGradByGlobalNorm(clip) if clip else None
    if sgd:              # AMP: AdamW would blow the rounding noise of a zero gradient (the key bias) up to lr steps
        return paddle.optimizer.SGD(0.5, parameters=params, grad_clip=grad_clip)
    return paddle.optimizer.AdamW(pp_common.LR, parameters=params, grad_clip=grad_clip)


def reference(kind="gpt", tie=False):
    """One process, whole batch, the same clip: (losses, {name: parameter}, first-step gradient norm)."""
    if (kind, tie) not in _REFS:
        import paddle.nn.functional as F

        model = pp_common.build(kind, tie)
        opt = optimizer(model.parameters())
        losses, norms = [], []
        for x, y in pp_common.batches(STEPS):
            loss = F.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
            loss.backward()
            norms.append(float(sum(float((p.grad ** 2).sum()) for p in model.parameters() if p.grad is not None)) ** .5)
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
        _REFS[(kind, tie)] = losses, {n: p.numpy() for n, p in model.named_parameters()}, norms
    return _REFS[(kind, tie)]


def mismatched(pipe, want, atol=ATOL) -> list:
    from autoparallel.dist_tensor import _local_from_full

    bad = []
    for name, p in pipe.named_parameters():
        full = paddle.to_tensor(want[name])
        locals_ = p.locals if hasattr(p, "_ap_spec") else {0: p}
        for r, t in locals_.items():
            w = _local_from_full(full, p.spec, r).numpy() if hasattr(p, "_ap_spec") else full.numpy()
            if not np.allclose(t.numpy(), w, rtol=RTOL, atol=atol):
                bad.append(f"{name}@rank{r}")
    return bad


def strategy(job):
    s = pp_common.strategy(job)
    if job.get("rc"):
        s.recompute.enable = True
        s.recompute.granularity = job["rc"]
        s.recompute.checkpoint_every_n_layers = job.get("every", 1)
    return s


def train(job, clip=CLIP, between=None):
    """Train ``job`` through apply_pp for STEPS steps: (losses, pipe, optimizer, norms)."""
    from autoparallel.testing.models import tp_plan

    kind = job.get("kind", "gpt")
    model = pp_common.build(kind, job.get("tie", False))
    pipe = apply_pp(model, strategy(job), tp_plan=tp_plan(kind) if job.get("tp", 1) > 1 else None)
    opt = pipe.wrap_optimizer(optimizer(model.parameters(), clip))
    losses, norms = [], []
    for x, y in pp_common.batches(STEPS):
        losses.append(pipe.train_batch(x, y))
        if between is not None:
            between(pipe)
        opt.step()
        norms.append(opt.last_grad_norm)
        opt.clear_grad()
    return losses, pipe, opt, norms


JOBS = [{"schedule": "1F1B"}, {"schedule": "1F1B", "tie": True}, {"schedule": "VPP", "vpp": 2},
        {"schedule": "ZB-H1", "dp": 2}, {"schedule": "1F1B", "tp": 2}, {"schedule": "FThenB", "dp": 2, "tp": 2}]


@pytest.mark.parametrize("job", JOBS, ids=lambda j: "-".join(f"{k}{v}" for k, v in j.items()))
def test_global_norm_clip_across_stages_equals_one_process(job):
    want_losses, want, want_norms = reference(job.get("kind", "gpt"), job.get("tie", False))
    assert min(want_norms) > 2 * CLIP                       # the clip binds on every step
    with ap.simulate(world_size=2 * job.get("dp", 1) * job.get("tp", 1)):
        losses, pipe, _, norms = train(job)
        bad = mismatched(pipe, want)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-4)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=1e-6)
    assert bad == []


def _clip_each_stage(pipe):
    """The wrong thing: every stage clipped by the norm of its own gradients."""
    for s in pipe.held_stages:
        grads = [p.grad for p in pipe.stages[s].parameters() if p.grad is not None]
        norm = float(sum(float((g ** 2).sum()) for g in grads)) ** .5
        for g in grads:
            g.set_value(g * (CLIP / max(norm, CLIP)))


def test_negative_control_clipping_each_stage_by_its_own_norm_differs():
    want_losses, want, _ = reference()
    with ap.simulate(world_size=2):
        losses, pipe, _, _ = train({"schedule": "1F1B"}, clip=None, between=_clip_each_stage)
        bad = mismatched(pipe, want)
    assert len(bad) > 5                 # (AdamW hides most of a gradient's scale: the losses move little)


def test_clips_other_than_the_global_norm_are_refused():
    model = pp_common.build()
    with ap.simulate(world_size=2):
        pipe = apply_pp(model, pp_common.strategy({"schedule": "1F1B"}))
        opt = paddle.optimizer.AdamW(parameters=model.parameters(), grad_clip=paddle.nn.ClipGradByNorm(1.0))
        with pytest.raises(NotImplementedError, match="supports ClipGradByGlobalNorm.*got ClipGradByNorm"):
            pipe.wrap_optimizer(opt)


def test_counted_elsewhere_names_the_tied_copy_of_the_higher_pipeline_rank():
    """On real ranks a tied embedding / LM head is held by the first and last pipeline ranks; only the
    lowest counts it in the norm (the runtime already summed their gradients)."""
    from autoparallel.parallel.pipeline.grad_clip import counted_elsewhere

    model = pp_common.build(tie=True)
    with ap.simulate(world_size=2):
        pipe = apply_pp(model, pp_common.strategy({"schedule": "1F1B"}))
    assert counted_elsewhere(pipe) == set()                  # one process: the tied weight is one object
    last = dict(pipe.stages[1].named_parameters())
    pipe.ranks, pipe.held_stages = np.arange(2).reshape(2, 1, 1), [1]
    for rank, want in ((0, set()), (1, {id(last["wte.weight"])})):
        pipe.pp_rank = rank
        assert counted_elsewhere(pipe) == want


# ---- recompute inside stages ---------------------------------------------------------------------------------
RC_JOBS = [{"schedule": "1F1B", "rc": "full"}, {"schedule": "1F1B", "rc": "full", "every": 2},
           {"schedule": "VPP", "vpp": 2, "rc": "full", "every": 2}, {"schedule": "ZB-H1", "dp": 2, "rc": "full"},
           {"schedule": "1F1B", "tp": 2, "rc": "selective"}, {"schedule": "ZB-H1", "tp": 2, "rc": "full", "kind": "llama"},
           {"schedule": "1F1B", "rc": "full", "tie": True}]


def _count_calls(layer, counts, key):
    layer.register_forward_pre_hook(lambda *_: counts.__setitem__(key, counts.get(key, 0) + 1))


def _run_counting(job, monkeypatch):
    """(losses, {name: every rank's parameter}, forward calls per block's MLP and of the attention core)."""
    from examples.models import common, gpt

    counts = {}

    def core(*args):
        counts["core"] = counts.get("core", 0) + 1
        return common.causal_attention(*args)
    monkeypatch.setattr(gpt, "causal_attention", core)
    kind = job.get("kind", "gpt")
    with ap.simulate(world_size=2 * job.get("dp", 1) * job.get("tp", 1)):
        from autoparallel.testing.models import tp_plan

        model = pp_common.build(kind, job.get("tie", False))
        pipe = apply_pp(model, strategy(job), tp_plan=tp_plan(kind) if job.get("tp", 1) > 1 else None)
        counts.clear()                                     # (the stage-cost trace ran the blocks once)
        for i, block in enumerate(model.blocks if kind == "gpt" else model.layers):
            _count_calls(block.mlp, counts, i)
        opt = pipe.wrap_optimizer(optimizer(model.parameters(), None))
        losses = []
        for x, y in pp_common.batches(STEPS):
            losses.append(pipe.train_batch(x, y))
            opt.step()
            opt.clear_grad()
        params = {f"{n}@{r}": t.numpy() for n, p in pipe.named_parameters()
                  for r, t in (p.locals.items() if hasattr(p, "_ap_spec") else [(0, p)])}
    return losses, params, counts


@pytest.mark.parametrize("job", RC_JOBS, ids=lambda j: "-".join(f"{k}{v}" for k, v in j.items()))
def test_recompute_inside_stages_equals_no_recompute_exactly(job, monkeypatch):
    base = {k: v for k, v in job.items() if k not in ("rc", "every")}
    key = ("no recompute", repr(sorted(base.items())))     # jobs differing in "rc" / "every" share their base
    if key not in _REFS:
        _REFS[key] = _run_counting(base, monkeypatch)
    want_losses, want, plain = _REFS[key]
    losses, got, counts = _run_counting(job, monkeypatch)
    runs = STEPS * 4                                       # micro-batches per step x steps
    assert {k: v for k, v in plain.items() if k != "core"} == {i: runs for i in range(4)}
    if job["rc"] == "full":                                # every block's forward again in backward
        assert {k: v for k, v in counts.items() if k != "core"} == {i: 2 * runs for i in range(4)}
    else:                                                  # the attention core only
        assert {k: v for k, v in counts.items() if k != "core"} == {i: runs for i in range(4)}
        assert counts["core"] == 2 * plain["core"] == 2 * 4 * runs
    assert losses == want_losses
    assert got.keys() == want.keys()
    assert [n for n in got if not np.array_equal(got[n], want[n])] == []
    if not job.get("dp") and not job.get("tp") and job.get("kind", "gpt") == "gpt":    # and one process
        key = ("pp_common", job.get("tie", False))
        if key not in _REFS:
            _REFS[key] = pp_common.reference("gpt", job.get("tie", False), steps=STEPS)
        ref_losses, ref_params = _REFS[key]
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=1e-6)
        bad = [n for n in got if not np.allclose(got[n], ref_params[n.split("@")[0]], rtol=RTOL, atol=ATOL)]
        assert bad == []


def test_recompute_segment_never_spans_two_stages():
    """checkpoint_every_n_layers=4 over 2 stages of 2 blocks: each stage's blocks form their own segment."""
    from autoparallel.parallel.recompute_segments import Segment

    model = pp_common.build()
    with ap.simulate(world_size=2):
        pipe = apply_pp(model, strategy({"schedule": "1F1B", "rc": "full", "every": 4}))
    segs = [b.forward.__self__ for b in model.blocks if getattr(b.forward, "__self__", None).__class__ is Segment]
    assert [s.names for s in segs] == [["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]]
    assert len(pipe.stages) == 2


def test_article_hybrid_with_recompute_and_clip_through_parallelize():
    """dp2 x tp2 x pp2 with sequence parallelism, full recompute and a binding global-norm clip, built by
    ap.parallelize: equal to one process with the same clip."""
    from autoparallel.testing.models import tp_plan

    want_losses, want, _ = reference()
    s = ap.Strategy()
    s.data_parallel.degree = s.tensor_parallel.degree = s.pipeline_parallel.degree = 2
    s.sequence_parallel.enable = s.recompute.enable = True
    with ap.simulate(world_size=8):
        model = pp_common.build("gpt")
        pipe, opt = ap.parallelize(model, optimizer(model.parameters()), strategy=s, tp_plan=tp_plan("gpt"))
        losses = []
        for x, y in pp_common.batches(STEPS):
            losses.append(pipe.train_batch(x, y))
            opt.step()
            opt.clear_grad()
        bad = mismatched(pipe, want)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=1e-6)
    assert bad == []


# ---- AMP inside stages -----------------------------------------------------------------------------------------
SCALE = 1024.0


def amp_reference(dtype, level, steps=STEPS, clip=None):
    """One process: the same emulated autocast, ``paddle.amp.auto_cast`` and (float16) ``GradScaler``
    (computed once per arguments: the callers only read it)."""
    key = ("amp", dtype, level, steps, clip)
    if key not in _REFS:
        _REFS[key] = _amp_reference(dtype, level, steps, clip)
    return _REFS[key]


def _amp_reference(dtype, level, steps, clip):
    import paddle.nn.functional as F

    from autoparallel.parallel.amp import apply_amp
    from autoparallel.testing.gpu_scaler import gpu_grad_scaler

    model = pp_common.build()
    apply_amp(model, dtype, level)
    opt = optimizer(model.parameters(), clip, sgd=True)
    scaler = gpu_grad_scaler(init_loss_scaling=SCALE) if dtype == "float16" else None
    losses = []
    for x, y in pp_common.batches(steps):
        with paddle.amp.auto_cast(dtype=dtype, level=level):
            loss = F.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: p.numpy() for n, p in model.named_parameters()}


def amp_strategy(job):
    s = strategy(job)
    s.amp.enable, s.amp.dtype, s.amp.level = True, job["amp"], job.get("level", "O1")
    if job["amp"] == "float16":
        s.amp.init_loss_scaling = SCALE
    return s


def train_amp(job, steps=STEPS, between=None, clip=None):
    from autoparallel.testing.models import tp_plan

    model = pp_common.build()
    pipe = apply_pp(model, amp_strategy(job), tp_plan=tp_plan("gpt") if job.get("tp", 1) > 1 else None)
    opt = pipe.wrap_optimizer(optimizer(model.parameters(), clip, sgd=True))
    losses, ran = [], []
    for k, (x, y) in enumerate(pp_common.batches(steps)):
        losses.append(pipe.train_batch(x, y))
        if between is not None:
            between(pipe, k)
        ran.append(opt.step())
        opt.clear_grad()
    return losses, pipe, opt, ran


AMP_JOBS = [{"schedule": "1F1B", "amp": "float16"}, {"schedule": "ZB-H1", "dp": 2, "amp": "float16", "level": "O2"},
            {"schedule": "VPP", "vpp": 2, "tp": 2, "amp": "bfloat16"},
            {"schedule": "1F1B", "tp": 2, "amp": "bfloat16", "level": "O2", "rc": "full"},
            {"schedule": "FThenB", "dp": 2, "amp": "float16", "clip": CLIP, "rc": "selective"}]


BF16_TP_ATOL = 3e-4      # bfloat16 keeps 8 bits: tensor-parallel partial sums in another order flip a last bit


def _atol(job):
    return BF16_TP_ATOL if job["amp"] == "bfloat16" and job.get("tp", 1) > 1 else ATOL


@pytest.mark.parametrize("job", AMP_JOBS, ids=lambda j: "-".join(f"{k}{v}" for k, v in j.items()))
def test_amp_inside_stages_equals_one_process_under_auto_cast_and_grad_scaler(job):
    want_losses, want = amp_reference(job["amp"], job.get("level", "O1"), clip=job.get("clip"))
    with ap.simulate(world_size=2 * job.get("dp", 1) * job.get("tp", 1)):
        losses, pipe, opt, ran = train_amp(job, clip=job.get("clip"))
        bad = mismatched(pipe, want, _atol(job))
        if job["amp"] == "bfloat16" and job.get("tp", 1) > 1:  # last-bit flips stay small against what AMP changes
            assert l2_distance(pipe, want) < 0.3 * l2_distance(pipe, _fp32_sgd_reference()[1])
    assert ran == [True] * STEPS
    assert opt.scaler.scale_value == (SCALE if job["amp"] == "float16" else 1.0)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=1e-6)
    assert bad == []


@pytest.mark.parametrize("job", [AMP_JOBS[0], AMP_JOBS[3]], ids=["float16", "bfloat16-tp2-O2"])
def test_negative_control_amp_differs_from_the_float32_run(job):
    """The same pipeline against one process without autocast: the comparison above can tell them apart
    (3 steps: the float16 difference needs them to reach its margin)."""
    want_losses, want = amp_reference(job["amp"], job.get("level", "O1"), steps=3)
    plain_losses, plain = _fp32_sgd_reference(steps=3)
    with ap.simulate(world_size=2 * job.get("tp", 1)):
        _, pipe, _, _ = train_amp(job, steps=3)
        assert len(mismatched(pipe, plain, _atol(job))) > (5 if job.get("tp", 1) == 1 else 0)
        assert l2_distance(pipe, plain) > 3 * l2_distance(pipe, want)


def l2_distance(pipe, want) -> float:
    """sqrt of the summed squared differences of every rank's shard from the reference's slice."""
    from autoparallel.dist_tensor import _local_from_full

    total = 0.0
    for name, p in pipe.named_parameters():
        full = paddle.to_tensor(want[name])
        for r, t in (p.locals.items() if hasattr(p, "_ap_spec") else [(0, p)]):
            w = _local_from_full(full, p.spec, r).numpy() if hasattr(p, "_ap_spec") else full.numpy()
            total += float(((t.numpy() - w) ** 2).sum())
    return total ** 0.5


def _fp32_sgd_reference(steps=STEPS):
    if ("fp32_sgd", steps) not in _REFS:
        _REFS["fp32_sgd", steps] = _fp32_sgd_reference_run(steps)
    return _REFS["fp32_sgd", steps]


def _fp32_sgd_reference_run(steps):
    import paddle.nn.functional as F

    model = pp_common.build()
    opt = optimizer(model.parameters(), None, sgd=True)
    losses = []
    for x, y in pp_common.batches(steps):
        loss = F.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: p.numpy() for n, p in model.named_parameters()}


def _poison_last_stage(step):
    def between(pipe, k):
        if k == step:
            g = dict(pipe.stages[-1].named_parameters())["ln_f.weight"].grad
            g.set_value(paddle.full_like(g, float("inf")))
    return between


def _snapshot(pipe):
    return {n: p.numpy().copy() for n, p in pipe.named_parameters()}


def _train_poisoned(job):
    """Step 0's last-stage gradient poisoned with inf: (ran, scale, params before step 0, after step 0)."""
    seen = {}

    def between(pipe, k):
        seen.setdefault(k, _snapshot(pipe))
        _poison_last_stage(0)(pipe, k)
    with ap.simulate(world_size=2):
        _, pipe, opt, ran = train_amp(job, steps=2, between=between)
    return ran, opt.scaler.scale_value, seen[0], seen[1]


def test_an_overflow_on_one_stage_skips_the_step_on_every_stage(monkeypatch):
    monkeypatch.setattr(pp_common, "strategy", _decr_every_step(pp_common.strategy))
    ran, scale, before, after = _train_poisoned({"schedule": "1F1B", "amp": "float16"})
    assert ran == [False, True] and scale == SCALE / 2
    assert [n for n in before if not np.array_equal(before[n], after[n])] == []      # no stage stepped


def test_negative_control_each_stage_deciding_alone_steps_the_first_stage(monkeypatch):
    from autoparallel.parallel.amp import found_inf
    from autoparallel.parallel.pipeline import amp

    monkeypatch.setattr(pp_common, "strategy", _decr_every_step(pp_common.strategy))
    monkeypatch.setattr(amp, "agreed_found_inf", lambda pipe, params: found_inf(pipe.stages[0].parameters()))
    ran, _, before, after = _train_poisoned({"schedule": "1F1B", "amp": "float16"})
    assert ran[0] is True
    assert not np.array_equal(before["blocks.0.mlp.fc1.weight"], after["blocks.0.mlp.fc1.weight"])


def _decr_every_step(make):
    def strategy_(job):
        s = make(job)
        s.amp.decr_every_n_nan_or_inf = 1
        return s
    return strategy_


def test_amp_through_parallelize_equals_one_process():
    want_losses, want = amp_reference("float16", "O2")
    s = amp_strategy({"schedule": "1F1B", "amp": "float16", "level": "O2"})
    with ap.simulate(world_size=2):
        model = pp_common.build()
        pipe, opt = ap.parallelize(model, optimizer(model.parameters(), None, sgd=True), strategy=s)
        assert type(opt).__name__ == "PipelineAmpOptimizer"
        losses = []
        for x, y in pp_common.batches(STEPS):
            losses.append(pipe.train_batch(x, y))
            assert opt.step()
            opt.clear_grad()
        bad = mismatched(pipe, want)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=1e-6)
    assert bad == []


# ---- models split at their blocks (no embed()/head()) ------------------------------------------------------------
def _generic_run(build, rc, clip, schedule="1F1B"):
    """(losses, {name: parameter}, forward calls of the first block's inner layer) of 2 steps through apply_pp."""
    from test_pipeline_auto_split import data

    model = build()
    s = ap.Strategy()
    s.pipeline_parallel.degree, s.pipeline_parallel.schedule = 2, schedule
    s.recompute.enable = rc
    pipe = apply_pp(model, s)
    opt = pipe.wrap_optimizer(paddle.optimizer.AdamW(1e-2, parameters=model.parameters(),
                                                     grad_clip=paddle.nn.ClipGradByGlobalNorm(clip)))
    blocks = pipe.plan.pieces.layers
    calls = []
    (blocks[0].fc if hasattr(blocks[0], "fc") else blocks[0].mlp).register_forward_pre_hook(lambda *_: calls.append(1))
    losses = []
    for step in range(2):
        losses.append(pipe.train_batch(*data(step)))
        opt.step()
        opt.clear_grad()
    return losses, {n: p.numpy() for n, p in pipe.named_parameters()}, len(calls)


def _generic_reference(build, clip):
    import paddle.nn.functional as F

    from autoparallel.parallel.pipeline import auto_split
    from test_pipeline_auto_split import data

    model = build()
    opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters(), grad_clip=paddle.nn.ClipGradByGlobalNorm(clip))
    losses = []
    for step in range(2):
        x, y = data(step)
        loss = F.cross_entropy(auto_split.model_output(model(paddle.to_tensor(x))), paddle.to_tensor(y))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: p.numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("which, schedule", [("nanogpt", "ZB-H1"), ("llama", "1F1B")])
def test_models_split_at_their_blocks_with_recompute_and_clip(which, schedule):
    from test_pipeline_auto_split import NanoGPT, llama

    build = NanoGPT if which == "nanogpt" else llama
    want_losses, want = _generic_reference(build, 0.05)
    base_losses, base, base_calls = _generic_run(build, False, 0.05, schedule)
    losses, got, calls = _generic_run(build, True, 0.05, schedule)
    assert calls == 2 * base_calls == 2 * 2 * 2               # 2 steps x 2 micro-batches, twice under recompute
    assert losses == base_losses and [n for n in got if not np.array_equal(got[n], base[n])] == []
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=1e-6)
    assert [n for n in got if not np.allclose(got[n], want[n], rtol=RTOL, atol=ATOL)] == []


# ---- a paddle.amp.GradScaler driving the pipeline ---------------------------------------------------------------
def _grad_scaler_run(job, pass_scaler=True, poison=None, steps=STEPS):
    """The article's loop with the pipeline: ``train_batch(x, y, scaler=...)`` under ``auto_cast``, then
    ``scaler.step(opt); scaler.update()``. ``poison``: step whose last-stage gradient gets an inf."""
    from autoparallel.testing.gpu_scaler import gpu_grad_scaler

    with ap.simulate(world_size=2 * job.get("dp", 1)):
        model = pp_common.build()
        pipe = apply_pp(model, strategy(job))
        opt = pipe.wrap_optimizer(optimizer(model.parameters(), None, sgd=True))
        scaler = gpu_grad_scaler(init_loss_scaling=SCALE, decr_every_n_nan_or_inf=1)
        losses, scales, seen = [], [], []
        for k, (x, y) in enumerate(pp_common.batches(steps)):
            seen.append(_snapshot(pipe))
            with paddle.amp.auto_cast():
                losses.append(pipe.train_batch(x, y, scaler=scaler if pass_scaler else None))
            if k == poison:
                _poison_last_stage(k)(pipe, k)
            scaler.step(opt)
            scaler.update()
            opt.clear_grad()
            scales.append(float(scaler._scale))
        seen.append(_snapshot(pipe))
    return losses, scales, seen


def _fp32_scaled_reference(steps=STEPS):
    import paddle.nn.functional as F

    from autoparallel.testing.gpu_scaler import gpu_grad_scaler

    model = pp_common.build()
    opt = optimizer(model.parameters(), None, sgd=True)
    scaler = gpu_grad_scaler(init_loss_scaling=SCALE)
    losses = []
    for x, y in pp_common.batches(steps):
        with paddle.amp.auto_cast():
            loss = F.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: p.numpy() for n, p in model.named_parameters()}


def test_grad_scaler_passed_to_train_batch_equals_one_process():
    want_losses, want = _fp32_scaled_reference()
    losses, scales, seen = _grad_scaler_run({"schedule": "1F1B", "dp": 2})
    assert scales == [SCALE] * STEPS
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=1e-6)
    assert [n for n in want if not np.allclose(seen[-1][n], want[n], rtol=RTOL, atol=ATOL)] == []


def test_grad_scaler_overflow_on_one_stage_skips_every_stage():
    _, scales, seen = _grad_scaler_run({"schedule": "1F1B"}, poison=0, steps=2)
    assert scales == [SCALE / 2, SCALE / 2]
    assert [n for n in seen[0] if not np.array_equal(seen[0][n], seen[1][n])] == []     # step 0: nothing moved
    assert [n for n in seen[1] if not np.array_equal(seen[1][n], seen[2][n])] != []     # step 1 trained


def test_grad_scaler_not_passed_to_train_batch_is_refused_at_its_step():
    """Unscaling gradients no backward scaled would shrink every update by the scale, silently: refused."""
    with pytest.raises(RuntimeError, match="ran without it"):
        _grad_scaler_run({"schedule": "1F1B"}, pass_scaler=False)


def test_optimizer_step_after_a_scaled_train_batch_is_refused():
    """The reverse: gradients scaled by the GradScaler stepped by ``opt.step()`` (never unscaled) are refused;
    the same loop through ``scaler.step`` runs (the control)."""
    from autoparallel.testing.gpu_scaler import gpu_grad_scaler

    for through_scaler in (True, False):
        with ap.simulate(world_size=2):
            model = pp_common.build()
            pipe = apply_pp(model, strategy({"schedule": "1F1B"}))
            opt = pipe.wrap_optimizer(optimizer(model.parameters(), None, sgd=True))
            scaler = gpu_grad_scaler(init_loss_scaling=SCALE)
            (x, y), = pp_common.batches(1)
            with paddle.amp.auto_cast():
                pipe.train_batch(x, y, scaler=scaler)
            if through_scaler:
                scaler.step(opt)
                scaler.update()
                assert pipe.grads_scaled_by is None
            else:
                with pytest.raises(RuntimeError, match="still scaled"):
                    opt.step()


def test_grad_scaler_and_strategy_amp_together_are_refused():
    from autoparallel.testing.gpu_scaler import gpu_grad_scaler

    with ap.simulate(world_size=2):
        pipe = apply_pp(pp_common.build(), amp_strategy({"schedule": "1F1B", "amp": "float16"}))
        x, y = pp_common.batches(1)[0]
        with pytest.raises(ValueError, match="strategy.amp already scales the pipeline's loss"):
            pipe.train_batch(x, y, scaler=gpu_grad_scaler(init_loss_scaling=SCALE))
        with pytest.raises(TypeError, match="expected a paddle.amp.GradScaler, got float"):
            pipe.train_batch(x, y, scaler=1024.0)
