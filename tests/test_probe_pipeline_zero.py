"""ZeRO stage 1 / 2 inside pipeline stages in the simulated world (parallel/pipeline/zero.py): each stage's
optimizer states (stage 2: also gradients) sharded over the stage's data ranks, against one process on one big
batch (AdamW, 2 steps: every loss, every rank's shard of every parameter), HSDP and offload included; global-norm
clipping over every stage (the norm of each step equals the unsharded pipeline's; negative control: a chunk
counted on one shard rank only moves the parameters away); each rank holds half the moments (negative control:
the unsharded pipeline's are whole); AMP and a GradScaler; a checkpoint resumed under another stage and in one
process; parameter groups with a schedule; the refusals (stage 3, stages on one rank); paddle's
opt.state_dict() through paddle.distributed.save_state_dict into another stage."""

import numpy as np
import paddle
import pytest

import pp_common  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel.parallel.pipeline import zero as pzero  # noqa: E402
from autoparallel.parallel.pipeline.runtime import apply_pp  # noqa: E402

STEPS, RTOL, ATOL = 2, 1e-4, 2e-5         # 2 steps: the second runs on the first's sharded AdamW moments
RESUMED = 3                               # the checkpoint tests: 2 steps saved, the third after the load
_REFS = {}


def ref(clip=None, steps=STEPS):
    if (clip, steps) not in _REFS:
        _REFS[clip, steps] = pp_common.reference("gpt", False, steps=steps, clip=clip)
    return _REFS[clip, steps]


def strategy(job):
    s = pp_common.strategy(job)
    if job.get("zero"):
        s.sharding.enable, s.sharding.stage = True, job["zero"]
        s.sharding.degree, s.sharding.offload = job.get("degree"), job.get("offload", False)
    return s


_RUNS = {}


def train(job):
    """(losses, grad norms, pipe, opt, names of rank shards that differ from one process); cached per job."""
    key = repr(sorted(job.items()))
    if key not in _RUNS:
        _RUNS[key] = _train(job)
    return _RUNS[key]


def _train(job):
    from autoparallel.testing.models import tp_plan

    from test_pipeline_sim import every_rank_mismatch

    world = job.get("pp", 2) * job.get("dp", 1) * job.get("tp", 1)
    with ap.simulate(world_size=world):
        model = pp_common.build("gpt")
        opt = pp_common.optimizer(model.parameters(), job.get("clip"))
        pipe = apply_pp(model, strategy(job), tp_plan=tp_plan("gpt") if job.get("tp", 1) > 1 else None)
        opt = pipe.wrap_optimizer(opt)
        losses, norms = [], []
        for x, y in pp_common.batches(STEPS):
            losses.append(pipe.train_batch(x, y))
            opt.step()
            norms.append(getattr(opt, "last_grad_norm", None))
            opt.clear_grad()
        bad = every_rank_mismatch(pipe, ref(job.get("clip"))[1])
    return losses, norms, pipe, opt, bad


JOBS = [{"schedule": "1F1B", "dp": 2, "zero": 1},
        {"schedule": "1F1B", "dp": 2, "zero": 2, "clip": 0.05},
        {"schedule": "VPP", "vpp": 2, "dp": 2, "zero": 1, "clip": 0.05},
        {"schedule": "ZB-H1", "dp": 2, "tp": 2, "zero": 2, "clip": 0.05},
        {"schedule": "1F1B", "dp": 4, "mb": 2, "zero": 2, "degree": 2, "clip": 0.05},     # HSDP inside the stages
        {"schedule": "FThenB", "dp": 2, "zero": 1, "offload": True}]


@pytest.mark.parametrize("job", JOBS, ids=lambda j: "-".join(f"{k}{v}" for k, v in j.items()))
def test_zero_inside_stages_equals_one_process(job):
    losses, norms, pipe, opt, bad = train(job)
    assert isinstance(opt, pzero.PipelineZeroOptimizer) and len(opt.zeros) == 2      # one per stage sub-mesh
    assert [(z.stage, z.groups.degree, z.offload) for z in opt.zeros] == \
        [(job["zero"], job.get("degree", job["dp"]), job.get("offload", False))] * 2
    np.testing.assert_allclose(losses, ref(job.get("clip"))[0], rtol=RTOL, atol=1e-6)
    assert bad == []
    if job.get("clip") and job["schedule"] == "1F1B" and job["dp"] == 2:   # each step's norm: the unsharded one's
        _, plain_norms, _, _, _ = train({k: v for k, v in job.items() if k != "zero"})
        np.testing.assert_allclose(norms, plain_norms, rtol=1e-5)
        assert min(norms) > job["clip"]                   # the clip binds on every step
    elif job.get("clip"):
        assert min(norms) > job["clip"]


def moments(opt):
    """{rank: elements of AdamW's moment1 held by that rank} for a ZeRO or a plain pipeline optimizer."""
    from autoparallel.dist_tensor import is_dist

    if isinstance(opt, pzero.PipelineZeroOptimizer):
        out = {}
        for z in opt.zeros:
            for r in z.held:
                acc = z.inner_opts[r]._accumulators["moment1"]
                out[r] = out.get(r, 0) + sum(int(np.prod(t.shape)) for t in acc.values())
        return out
    out = {}
    for p in opt.parameters:                         # the plain pipeline: moments follow the parameters' layout
        for r, t in (p.locals.items() if is_dist(p) else {0: p}.items()):
            out[r] = out.get(r, 0) + int(np.prod(t.shape))
    return out


def test_each_data_rank_holds_half_the_optimizer_states():
    _, _, _, opt, _ = train({"schedule": "1F1B", "dp": 2, "zero": 2, "clip": 0.05})     # runs cached above
    _, _, _, plain, _ = train({"schedule": "1F1B", "dp": 2, "clip": 0.05})
    sharded, whole = moments(opt), moments(plain)
    assert sorted(sharded) == sorted(whole) == [0, 1, 2, 3]
    for r in sharded:
        assert abs(2 * sharded[r] - whole[r]) <= 64, (r, sharded[r], whole[r])     # ceil chunks of a few params
        assert sharded[r] < 0.6 * whole[r]
    assert sharded[0] + sharded[1] >= whole[0]        # the two data ranks of stage 0 hold every element


def test_negative_control_chunk_counted_on_one_shard_rank_only(monkeypatch):
    """Leaving the shard dim out of a chunk's distinct dims counts only shard rank 0's chunks: another norm."""
    original = pzero._StageZero.norm_terms

    def undercount(self, grads, skip):
        return [(locs, z, sharded - {self.groups.shard_dim}) for locs, z, sharded in original(self, grads, skip)]

    monkeypatch.setattr(pzero._StageZero, "norm_terms", undercount)
    losses, _, _, _, bad = _train({"schedule": "1F1B", "dp": 2, "zero": 2, "clip": 0.05})
    assert bad or not np.allclose(losses, ref(0.05)[0], rtol=RTOL, atol=1e-6)


def test_parallelize_with_sharding_and_pipeline_equals_one_process():
    from test_pipeline_sim import every_rank_mismatch

    s = strategy({"schedule": "1F1B", "dp": 2, "zero": 2})
    with ap.simulate(world_size=4):
        model = pp_common.build("gpt")
        opt = paddle.optimizer.AdamW(pp_common.LR, parameters=model.parameters())
        pipe, opt = ap.parallelize(model, opt, strategy=s)
        assert isinstance(opt, pzero.PipelineZeroOptimizer)
        losses = []
        for x, y in pp_common.batches(STEPS):
            losses.append(pipe.train_batch(x, y))
            opt.step()
            opt.clear_grad()
        bad = every_rank_mismatch(pipe, ref()[1])
    np.testing.assert_allclose(losses, ref()[0], rtol=RTOL, atol=1e-6)
    assert bad == []


@pytest.mark.parametrize("change,world,error,match", [
    ({"zero": 3, "dp": 2}, 4, NotImplementedError, r"sharding stage 3 .* stages 1 .*and 2 .* run inside"),
    ({"zero": 1}, 2, ValueError, r"data_parallel.degree=1 and tensor_parallel.degree=1 leave every stage on one"),
])
def test_refusals(change, world, error, match):
    job = dict({"schedule": "1F1B"}, **change)
    with ap.simulate(world_size=world), pytest.raises(error, match=match):
        apply_pp(pp_common.build("gpt"), strategy(job))


@pytest.mark.parametrize("job", [{"schedule": "1F1B", "dp": 2, "zero": 1, "amp": "float16", "clip": 0.05},
                                 {"schedule": "ZB-H1", "dp": 2, "zero": 2, "amp": "float16", "level": "O2"}],
                         ids=["fp16-O1-zero1-clip", "fp16-O2-zero2"])
def test_zero_with_amp_inside_stages_equals_one_process(job):
    from test_pipeline_compose import amp_reference, amp_strategy, mismatched

    want_losses, want = amp_reference(job["amp"], job.get("level", "O1"), steps=STEPS, clip=job.get("clip"))
    with ap.simulate(world_size=4):
        model = pp_common.build()
        s = amp_strategy(job)
        s.sharding.enable, s.sharding.stage = True, job["zero"]
        pipe = apply_pp(model, s)
        opt = pipe.wrap_optimizer(pp_common.optimizer(model.parameters(), job.get("clip"), sgd=True))
        assert isinstance(opt.optimizer, pzero.PipelineZeroOptimizer)
        losses, ran = [], []
        for x, y in pp_common.batches(STEPS):
            losses.append(pipe.train_batch(x, y))
            ran.append(opt.step())
            opt.clear_grad()
        bad = mismatched(pipe, want, ATOL)
    assert ran == [True] * STEPS
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=1e-6)
    assert bad == []


def test_zero_with_a_grad_scaler_passed_to_train_batch_equals_one_process():
    """The article's loop: ``train_batch(x, y, scaler=...)`` under ``auto_cast``, ``scaler.step(opt)``."""
    from autoparallel.testing.gpu_scaler import gpu_grad_scaler
    from test_pipeline_compose import SCALE, _fp32_scaled_reference, mismatched

    want_losses, want = _fp32_scaled_reference(STEPS)
    with ap.simulate(world_size=4):
        model = pp_common.build()
        pipe = apply_pp(model, strategy({"schedule": "1F1B", "dp": 2, "zero": 2}))
        opt = pipe.wrap_optimizer(pp_common.optimizer(model.parameters(), None, sgd=True))
        scaler, losses = gpu_grad_scaler(init_loss_scaling=SCALE), []
        for x, y in pp_common.batches(STEPS):
            with paddle.amp.auto_cast():
                losses.append(pipe.train_batch(x, y, scaler=scaler))
            scaler.step(opt)
            scaler.update()
            opt.clear_grad()
        bad = mismatched(pipe, want, ATOL)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=1e-6)
    assert bad == []


def _pipeline_run(job, world=4):
    model = pp_common.build("gpt")
    pipe = apply_pp(model, strategy(job))
    return pipe, pipe.wrap_optimizer(pp_common.optimizer(model.parameters(), job.get("clip")))


def test_paddle_state_dict_of_a_pipelined_zero_run_resumes_under_another_stage(tmp_path):
    """opt.state_dict() of a ZeRO-1 pipeline (was refused) through paddle.distributed.save_state_dict, loaded in
    place into a fresh ZeRO-2 VPP pipeline's opt.state_dict() (the model through ap.training_state's "model"):
    the third step equals the uninterrupted run's. Negative control: the model alone resumes differently."""
    from test_pipeline_sim import every_rank_mismatch

    data = pp_common.batches(RESUMED)
    with ap.simulate(world_size=4), paddle.utils.unique_name.guard():
        pipe, opt = _pipeline_run({"schedule": "1F1B", "dp": 2, "zero": 1})
        for x, y in data[:2]:
            pipe.train_batch(x, y)
            opt.step()
            opt.clear_grad()
        ap.save_state_dict(ap.training_state(pipe, opt), str(tmp_path / "ck"))
        sd = opt.state_dict()
        assert any(k.endswith("_moment1_0") and ap.is_dist(v) for k, v in sd.items())
        paddle.distributed.save_state_dict(sd, str(tmp_path / "opt"))
    for load in (True, False):
        with ap.simulate(world_size=4), paddle.utils.unique_name.guard():
            pipe, opt = _pipeline_run({"schedule": "VPP", "vpp": 2, "dp": 2, "zero": 2})
            ap.load_state_dict({"model": ap.training_state(pipe, opt)["model"]}, str(tmp_path / "ck"), strict=False)
            if load:
                paddle.distributed.load_state_dict(opt.state_dict(), str(tmp_path / "opt"))
            loss = pipe.train_batch(*data[2])
            opt.step()
            bad = every_rank_mismatch(pipe, ref(steps=RESUMED)[1])
        assert (abs(loss - ref(steps=RESUMED)[0][2]) < 1e-5 and bad == []) == load, (load, loss, bad[:3])


def test_checkpoint_of_a_pipelined_zero_run_resumes_under_another_stage(tmp_path):
    """2 steps under ZeRO-1, saved; loaded into a fresh ZeRO-2 pipeline and into one process (plain AdamW): the
    third step equals the uninterrupted run's. Negative control: the fresh pipeline without the load differs."""
    from test_pipeline_sim import every_rank_mismatch

    data = pp_common.batches(RESUMED)
    with ap.simulate(world_size=4):
        pipe, opt = _pipeline_run({"schedule": "1F1B", "dp": 2, "zero": 1})
        for x, y in data[:2]:
            pipe.train_batch(x, y)
            opt.step()
            opt.clear_grad()
        ap.save_state_dict(ap.training_state(pipe, opt), str(tmp_path / "ck"))
        for load in (True, False):
            pipe, opt = _pipeline_run({"schedule": "VPP", "vpp": 2, "dp": 2, "zero": 2})
            if load:
                ap.load_state_dict(ap.training_state(pipe, opt), str(tmp_path / "ck"))
            loss = pipe.train_batch(*data[2])
            opt.step()
            bad = every_rank_mismatch(pipe, ref(steps=RESUMED)[1])
            assert (abs(loss - ref(steps=RESUMED)[0][2]) < 1e-5 and bad == []) == load, (load, loss, bad[:3])
    model = pp_common.build("gpt")                     # one process, paddle's AdamW
    plain = pp_common.optimizer(model.parameters())
    ap.load_state_dict(ap.training_state(model, plain), str(tmp_path / "ck"))
    x, y = data[2]
    loss = paddle.nn.functional.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
    loss.backward()
    plain.step()
    want_losses, want = ref(steps=RESUMED)
    assert abs(float(loss) - want_losses[2]) < 1e-5
    bad = [n for n, p in model.named_parameters() if not np.allclose(p.numpy(), want[n], rtol=RTOL, atol=ATOL)]
    assert bad == []


def _grouped_adamw(model):
    """Two parameter groups (a learning-rate factor, a weight decay) over a StepDecay schedule."""
    ps = list(model.parameters())
    sched = paddle.optimizer.lr.StepDecay(3e-3, step_size=1, gamma=0.5)
    groups = [{"params": ps[:5], "learning_rate": 2.0}, {"params": ps[5:], "weight_decay": 0.1}]
    return paddle.optimizer.AdamW(sched, parameters=groups), sched


def test_parameter_groups_and_a_scheduler_equal_one_process():
    from autoparallel.testing.models import parameters_np
    from test_pipeline_sim import every_rank_mismatch

    model = pp_common.build("gpt")
    opt, sched = _grouped_adamw(model)
    want_losses = []
    for x, y in pp_common.batches(STEPS):
        loss = paddle.nn.functional.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        sched.step()
        want_losses.append(float(loss))
    want = parameters_np(model)
    with ap.simulate(world_size=4):
        model = pp_common.build("gpt")
        opt, sched = _grouped_adamw(model)
        pipe = apply_pp(model, strategy({"schedule": "1F1B", "dp": 2, "zero": 1}))
        opt = pipe.wrap_optimizer(opt)
        losses = []
        for x, y in pp_common.batches(STEPS):
            losses.append(pipe.train_batch(x, y))
            opt.step()
            opt.clear_grad()
            sched.step()
        bad = every_rank_mismatch(pipe, want)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=1e-6)
    assert bad == []
