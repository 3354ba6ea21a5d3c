"""Pipeline parallelism in the simulated world (``ap.simulate``): every stage in one process on its own
[data, model] sub-mesh, the same schedules and action lists as on real ranks. Every schedule x {plain,
data parallel, tensor parallel} trains 3 steps and must equal one process on one big batch: losses, and
every rank's shard of every parameter (the simulated optimizer steps every rank's copy). Plus the
article's configuration (``pipeline_parallel.degree`` alone: degree micro-batches)."""

import numpy as np
import paddle
import pytest


import pp_common  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel.dist_tensor import _local_from_full  # noqa: E402
from autoparallel.parallel.pipeline import runtime  # noqa: E402

STEPS, RTOL, ATOL = 3, 1e-4, 2e-5
_REFS = {}


def ref(kind="gpt", tie=False):
    if (kind, tie) not in _REFS:
        _REFS[(kind, tie)] = pp_common.reference(kind, tie, steps=STEPS)
    return _REFS[(kind, tie)]


def every_rank_mismatch(pipe, ref_params) -> list:
    """Names of parameters whose shard on some rank differs from the reference's slice for that rank."""
    import paddle

    bad = []
    for name, p in pipe.named_parameters():
        want = paddle.to_tensor(ref_params[name])
        locals_ = p.locals if hasattr(p, "locals") and hasattr(p, "_ap_spec") else {0: p}
        for r, t in locals_.items():
            w = _local_from_full(want, p.spec, r).numpy() if hasattr(p, "_ap_spec") else want.numpy()
            if not np.allclose(t.numpy(), w, rtol=RTOL, atol=ATOL):
                bad.append(f"{name}@rank{r}")
    return bad


def run_sim(job):
    world = job.get("pp", 2) * job.get("dp", 1) * job.get("tp", 1)
    with ap.simulate(world_size=world):
        losses, pipe = pp_common.run_pipeline(job, steps=STEPS)
        bad = every_rank_mismatch(pipe, ref(job.get("kind", "gpt"), job.get("tie", False))[1])
    return losses, pipe, bad


SCHEDULES = [{"schedule": "FThenB"}, {"schedule": "1F1B"}, {"schedule": "VPP", "vpp": 2}, {"schedule": "ZB-H1"}]
INSIDE = [{}, {"dp": 2}, {"tp": 2}]
JOBS = [dict(s, **i) for s in SCHEDULES for i in INSIDE]


@pytest.mark.parametrize("job", JOBS, ids=lambda j: "-".join(f"{k}{v}" for k, v in j.items()))
def test_simulated_pipeline_equals_one_process(job):
    losses, pipe, bad = run_sim(job)
    np.testing.assert_allclose(losses, ref()[0], rtol=RTOL, atol=1e-6)
    assert bad == []
    assert len(pipe.records) == sum(len(acts) for acts in pipe.schedule)
    if job.get("dp", 1) * job.get("tp", 1) > 1:                 # stages really run on their sub-meshes
        assert {tuple(m.process_ids) for m in pipe.meshes.values()} == {(0, 1), (2, 3)}


def test_simulated_llama_with_sequence_parallel_and_zero_bubble():
    losses, _, bad = run_sim({"schedule": "ZB-H1", "tp": 2, "sp": True, "kind": "llama"})
    np.testing.assert_allclose(losses, ref("llama")[0], rtol=RTOL, atol=1e-6)
    assert bad == []


def test_negative_control_shards_handed_to_the_wrong_ranks(monkeypatch):
    """Reversing the rank order of a transfer (data shard 0 handed to data rank 1) must break equality."""
    local = runtime._local

    def swapped(t):
        out = local(t)
        return runtime._Shards(out.tensors[::-1]) if isinstance(out, runtime._Shards) else out

    monkeypatch.setattr(runtime, "_local", swapped)
    losses, _, bad = run_sim({"schedule": "1F1B", "dp": 2})
    assert bad or not np.allclose(losses, ref()[0], rtol=RTOL, atol=1e-6)


def test_article_config_degree_alone_runs_degree_micro_batches():
    s = ap.Strategy()
    s.pipeline_parallel.degree = 2                              # no micro_batches, as in the article
    model = pp_common.build("gpt")
    with ap.simulate(world_size=2):
        pipe = runtime.apply_pp(model, s)
        assert pipe.plan.micro_batches == 2
        x, y = pp_common.batches(1)[0]
        assert abs(pipe.train_batch(x, y) - ref()[0][0]) < 1e-5


def test_tied_parameters_across_stage_meshes_are_refused_in_the_simulated_world():
    with ap.simulate(world_size=4), pytest.raises(NotImplementedError, match="wte.weight.*untie them, or run on "
                                                                              "real ranks"):
        pp_common.run_pipeline({"schedule": "1F1B", "tp": 2, "tie": True}, steps=1)


def test_simulated_world_size_must_match_the_degrees():
    with ap.simulate(world_size=8), pytest.raises(ValueError, match="= 4, expected the world size 8"):
        pp_common.run_pipeline({"schedule": "1F1B", "tp": 2}, steps=1)


def test_article_hybrid_through_parallelize_in_the_simulated_world():
    """The article's 4-D config (dp, tp, pp, sequence parallel; micro-batches unset), scaled to 2x2x2."""
    from autoparallel.testing.models import tp_plan

    s = ap.Strategy()
    s.data_parallel.degree = 2
    s.tensor_parallel.degree = 2
    s.pipeline_parallel.degree = 2
    s.sequence_parallel.enable = True
    with ap.simulate(world_size=8):
        model = pp_common.build("gpt")
        opt = paddle.optimizer.AdamW(pp_common.LR, parameters=model.parameters())
        pipe, opt = ap.parallelize(model, opt, strategy=s, tp_plan=tp_plan("gpt"))
        assert pipe.plan.micro_batches == 2
        losses = []
        for x, y in pp_common.batches(STEPS):
            losses.append(pipe.train_batch(x, y))
            opt.step()
            opt.clear_grad()
        bad = every_rank_mismatch(pipe, ref()[1])
    np.testing.assert_allclose(losses, ref()[0], rtol=RTOL, atol=1e-6)
    assert bad == []
