"""Pipeline parallelism composed with gradient clipping by the global norm, in the simulated world: the
norm over every stage (data / tensor parallel inside them, a tied embedding counted once) equals one
process with the same ``ClipGradByGlobalNorm``; clipping each stage by its own norm does not."""

import numpy as np
import paddle
import pytest

import pp_common

import autoparallel as ap
from autoparallel.parallel.pipeline.runtime import apply_pp

STEPS, CLIP, RTOL, ATOL = 3, 0.05, 1e-4, 2e-5
_REFS = {}


def optimizer(params, clip=CLIP):
    grad_clip = paddle.nn.ClipGradByGlobalNorm(clip) if clip else None
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


def mismatched(pipe, want) -> list:
    from autoparallel.dist_tensor import _local_from_full

    bad = []
    for name, p in pipe.named_parameters():
        full = paddle.to_tensor(want[name])
        locals_ = p.locals if hasattr(p, "_ap_spec") else {0: p}
        for r, t in locals_.items():
            w = _local_from_full(full, p.spec, r).numpy() if hasattr(p, "_ap_spec") else full.numpy()
            if not np.allclose(t.numpy(), w, rtol=RTOL, atol=ATOL):
                bad.append(f"{name}@rank{r}")
    return bad


def train(job, clip=CLIP, between=None):
    """Train ``job`` through apply_pp for STEPS steps: (losses, pipe, optimizer, norms)."""
    from autoparallel.testing.models import tp_plan

    kind = job.get("kind", "gpt")
    model = pp_common.build(kind, job.get("tie", False))
    pipe = apply_pp(model, pp_common.strategy(job), tp_plan=tp_plan(kind) if job.get("tp", 1) > 1 else None)
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
