"""Pipeline parallelism on real gloo ranks against the single-process run (one big batch per step).

Three launches: 2 ranks (PP2 under FThenB, 1F1B, VPP v=2 and ZB-H1; GPT and LLaMA, tied and untied
embeddings; a negative control without the tied-gradient all-reduce), 4 ranks (PP2xDP2, PP2xTP2 with each
stage on its own [data, model] sub-mesh, ZB-H1 and VPP among them; PP4; PP2xTP2 with a tied embedding, a binding
global-norm clip and full recompute; PP2xDP2 under float16 AMP with loss scaling and the clip) and 8 ranks
(DP2xTP2xPP2).
6 steps each; losses and every final parameter must match with rtol 1e-4 plus a small atol. The 2-rank
launch also checks that every rank executed exactly its schedule's action list and draws the measured
timeline. Every schedule x {plain, DP, TP} also runs in the simulated world (test_pipeline_sim.py);
here each inside-stage layout meets real transfers, ZB-H1 with TP on GPT's biased Linears among them.
Inside stages, tensor parallelism uses the GPT / LLaMA plans of ``autoparallel.testing.models``
(one LLaMA job with sequence parallelism and ZB-H1).
"""
import json
import os

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

import pp_common  # noqa: E402

from autoparallel.parallel.pipeline import bubble_fraction, make_schedule, simulate  # noqa: E402
from dist_scripts import shared_launch  # noqa: E402

WORKER = os.path.join(HERE, "dist_scripts", "pp_worker.py")
RTOL, ATOL = 1e-4, 2e-5

LAUNCHES = {
    2: [{"name": "pp2_fthenb", "schedule": "FThenB"},
        {"name": "pp2_1f1b_tied", "schedule": "1F1B", "tie": True},
        {"name": "pp2_vpp", "schedule": "VPP", "vpp": 2},
        {"name": "pp2_zb_tied", "schedule": "ZB-H1", "tie": True},
        {"name": "llama_pp2_vpp_tied", "schedule": "VPP", "vpp": 2, "kind": "llama", "tie": True},
        {"name": "neg_no_tie_reduce", "schedule": "1F1B", "tie": True, "negative": "no_tie_reduce"}],
    4: [{"name": "pp2dp2_1f1b", "schedule": "1F1B", "dp": 2},
        {"name": "pp2tp2_1f1b", "schedule": "1F1B", "tp": 2},
        {"name": "pp2tp2_zb", "schedule": "ZB-H1", "tp": 2},        # GPT: a row-parallel bias under ZB-H1
        {"name": "pp2dp2_zb_tied", "schedule": "ZB-H1", "dp": 2, "tie": True},
        {"name": "pp2tp2_vpp_tied", "schedule": "VPP", "vpp": 2, "tp": 2, "tie": True},
        {"name": "llama_pp2tp2_sp_zb", "schedule": "ZB-H1", "tp": 2, "sp": True, "kind": "llama"},
        {"name": "pp4_1f1b_tied", "schedule": "1F1B", "pp": 4, "tie": True},
        {"name": "pp2tp2_clip_recompute_tied", "schedule": "1F1B", "tp": 2, "tie": True, "clip": 0.05, "rc": "full"},
        {"name": "pp2dp2_fp16_clip", "schedule": "1F1B", "dp": 2, "amp": "float16", "clip": 0.05}],
    8: [{"name": "dp2tp2pp2_1f1b_tied", "schedule": "1F1B", "dp": 2, "tp": 2, "tie": True}],
}
JOBS = {j["name"]: (n, j) for n, jobs in LAUNCHES.items() for j in jobs}
SHARED = {n: shared_launch.job(__name__, f"pp{n}", WORKER, n, args=lambda out, n=n: [out, json.dumps(LAUNCHES[n])])
          for n in LAUNCHES}
_REFS = {}


def reference(job):
    key = (job.get("kind", "gpt"), job.get("tie", False), job.get("clip"), job.get("amp"))
    if key not in _REFS:
        _REFS[key] = pp_common.reference(*key[:2], clip=key[2], amp=key[3])
    return _REFS[key]


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def get(nproc):
        if nproc not in cache:
            out, ranks = shared_launch.results(SHARED[nproc])
            for r in ranks:
                for name, job in r["jobs"].items():
                    assert "error" not in job, f"rank {r['rank']} job {name}:\n{job['error']}"
            cache[nproc] = (out, ranks)
        return cache[nproc]
    return get


def compare(name, out, ranks):
    """(losses match on every rank, every rank's final parameters match, names covered by the ranks)."""
    _, job = JOBS[name]
    ref_losses, ref_params = reference(job)
    ok_loss = all(np.allclose(r["jobs"][name]["losses"], ref_losses, rtol=RTOL, atol=1e-6) for r in ranks)
    seen, ok_params = set(), True
    for r in ranks:
        params = np.load(os.path.join(out, f"{name}.rank{r['rank']}.npz"))
        seen |= set(params.files)
        ok_params &= all(np.allclose(params[n], ref_params[n], rtol=RTOL, atol=ATOL) for n in params.files)
    return ok_loss, ok_params, seen == set(ref_params)


@pytest.mark.parametrize("name", [n for n in JOBS if not n.startswith("neg")])
def test_pipeline_matches_single_process(runs, name):
    nproc, job = JOBS[name]
    out, ranks = runs(nproc)
    ok_loss, ok_params, covered = compare(name, out, ranks)
    got = ranks[0]["jobs"][name]["losses"]
    assert ok_loss, f"{name}: losses {np.round(got, 5).tolist()} vs {np.round(reference(job)[0], 5).tolist()}"
    assert ok_params, f"{name}: final parameters differ from the single-process run"
    assert covered, f"{name}: the ranks together do not hold every parameter"
    tied = {tuple(r["jobs"][name]["tied"]) for r in ranks}
    if job.get("tie"):                      # the shared embedding lives on the first and the last rank
        for r in ranks:
            holds = r["jobs"][name]["pp_rank"] in (0, job.get("pp", 2) - 1)
            assert (r["jobs"][name]["tied"] != []) == holds, (name, r["rank"], r["jobs"][name]["tied"])
    else:
        assert tied == {()}


def test_negative_control_without_tied_gradient_reduction(runs):
    out, ranks = runs(2)
    ok_loss, ok_params, _ = compare("neg_no_tie_reduce", out, ranks)
    assert not ok_loss and not ok_params


def test_each_rank_executed_its_action_list_and_the_timeline(runs, tmp_path):
    from autoparallel.parallel.pipeline.timeline import plot_timeline

    _, ranks = runs(2)
    for name, (nproc, job) in JOBS.items():
        if nproc != 2 or name.startswith("neg"):
            continue
        sched = make_schedule(job["schedule"], 2, 4, job.get("vpp", 1))
        for r in ranks:
            recs = r["jobs"][name]["records"]
            done = [(k, s, i) for _, k, s, i, _, _ in recs]
            assert done == [(a.kind, a.stage, a.microbatch) for a in sched[r["jobs"][name]["pp_rank"]]], name
            assert all(end >= start for *_, start, end in recs)
    records = [tuple(x) for r in ranks for x in r["jobs"]["pp2_1f1b_tied"]["records"]]
    measured = bubble_fraction(records, 2)
    stage_time = {k: [np.mean([e - s for _, kk, st, _, s, e in records if kk == k and st == stage])
                      for stage in range(2)] for k in ("F", "B")}
    planned = simulate(make_schedule("1F1B", 2, 4), forward=stage_time["F"], backward=stage_time["B"]).bubble_fraction
    plot_timeline(records, str(tmp_path / "measured.png"), title="PP2 1F1B measured", num_ranks=2)
    assert os.path.getsize(tmp_path / "measured.png") > 1000
    assert 0.0 <= planned < 1.0 and 0.0 <= measured < 1.0
    print(f"PP2 1F1B m=4: measured bubble {measured:.3f}, planned {planned:.3f} (formula {1 / 5:.3f})")
