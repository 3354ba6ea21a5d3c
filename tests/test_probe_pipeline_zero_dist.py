"""ZeRO stage 1 / 2 inside pipeline stages on 4 real gloo ranks (PP2 x DP2; one job of the shared 4-rank
launch): ZeRO-1 under 1F1B and ZeRO-2 under VPP with a tied embedding / LM head; losses and every final parameter
equal one process (AdamW with a binding global-norm clip, 4 steps), ZeRO-1's clip norm of every step equals the
unsharded pipeline's, each rank holds half the moments the unsharded pipeline's rank holds (negative control),
ZeRO-2 under VPP resumed from ZeRO-1's checkpoint after step 2 ends equal to the uninterrupted run, and paddle's
``opt.state_dict()`` is refused by name. The FThenB pipeline trained by the user's own loss on the logits
(``F.cross_entropy(pipe(x), y).mean().backward()``; parallel/pipeline/external_loss.py) equals one process too,
with the same loss on every rank; after backward rank 0 alone reads it with no collective, and its read before
backward fails fast on every rank (LossReadOnSomeRanksError)."""
import os

import numpy as np
import pytest

import pp_common  # noqa: E402

from dist_scripts import shared_launch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_scripts", "pp_zero_worker.py")
STEPS, CLIP, RTOL, ATOL = 4, 0.05, 1e-4, 2e-5
JOB = shared_launch.job(__name__, "pp_zero", WORKER, 4, args=lambda out: [out, str(STEPS)], timeout=300)


@pytest.fixture(scope="module")
def run():
    out, ranks = shared_launch.results(JOB)
    for r in ranks:
        for name, job in r["jobs"].items():
            assert "error" not in job, f"rank {r['rank']} job {name}:\n{job['error']}"
    return out, ranks, {tie: pp_common.reference("gpt", tie, steps=STEPS, clip=CLIP) for tie in (False, True)}


@pytest.mark.parametrize("name", ["zero1_1f1b", "zero2_vpp_tied", "plain_1f1b", "zero2_resume"])
def test_equals_one_process(run, name):
    out, ranks, refs = run
    ref_losses, ref_params = refs[name.endswith("tied")]
    if name == "zero2_resume":                    # steps 3-4 after loading the checkpoint of step 2
        ref_losses = ref_losses[2:]
    seen = set()
    for r in ranks:
        job = r["jobs"][name]
        np.testing.assert_allclose(job["losses"], ref_losses, rtol=RTOL, atol=1e-6)
        params = np.load(os.path.join(out, f"{name}.rank{r['rank']}.npz"))
        seen |= set(params.files)
        bad = [n for n in params.files if not np.allclose(params[n], ref_params[n], rtol=RTOL, atol=ATOL)]
        assert bad == [], (name, r["rank"], bad)
        assert job["kind"] == ("PipelineOptimizer" if name.startswith("plain") else "PipelineZeroOptimizer")
    assert seen == set(ref_params)


def test_clip_norm_and_half_the_states_per_rank(run):
    _, ranks, _ = run
    for r in ranks:
        plain = r["jobs"]["plain_1f1b"]
        assert min(plain["norms"]) > CLIP                                    # the clip binds
        np.testing.assert_allclose(r["jobs"]["zero1_1f1b"]["norms"], plain["norms"], rtol=1e-5)
        for name in ("zero1_1f1b", "zero2_vpp_tied"):
            job = r["jobs"][name]
            assert min(job["norms"]) > CLIP
            assert abs(2 * job["moments"] - plain["moments"]) <= 64, (name, r["rank"], job["moments"], plain["moments"])
            assert job["moments"] < 0.6 * plain["moments"]


def test_tied_pipeline_checkpoint_loads_into_one_process(run):
    """The tied embedding / LM head is written once (by the first stage's ranks) and every entry is in the
    checkpoint: one process with paddle's AdamW loads the final parameters and non-zero moments of each."""
    import autoparallel as ap

    out, _, refs = run
    model = pp_common.build("gpt", True)
    opt = pp_common.optimizer(model.parameters(), CLIP)
    ap.load_state_dict(ap.training_state(model, opt), os.path.join(out, "zero2_vpp_tied_ck"))
    ref_params = refs[True][1]
    bad = [n for n, p in model.named_parameters() if not np.allclose(p.numpy(), ref_params[n], rtol=RTOL, atol=ATOL)]
    assert bad == []
    moments = list(opt._accumulators["moment1"].values())
    assert len(moments) == len(model.parameters()) and all(float(abs(t).sum()) > 0 for t in moments)


def test_paddle_state_dict_of_zero_stages_equals_the_unsharded_pipeline(run):
    """opt.state_dict() of ZeRO-1 inside the stages (was refused by name) holds this rank's stages' moments as
    distributed tensors (S(0) over the stage's data ranks, or gathered into the parameter's layout), and gathered
    (ap.full_state_dict) they equal the unsharded 1F1B pipeline's moments of the same steps."""
    _, ranks, _ = run
    for r in ranks:
        zero, plain = r["jobs"]["zero1_1f1b"]["state_dict"], r["jobs"]["plain_1f1b"]["state_dict"]
        assert zero["plain"] == [] and zero["layouts"], zero
        assert set(zero["sums"]) == set(plain["sums"]) and zero["sums"], (sorted(zero["sums"]), sorted(plain["sums"]))
        for n, v in plain["sums"].items():
            np.testing.assert_allclose(zero["sums"][n], v, rtol=1e-4, atol=1e-6, err_msg=n)


def test_external_loss_on_real_ranks_equals_one_process(run):
    """loss_fn(model(x), y) on PP2 x DP2: every rank's float(loss) of every step and every final parameter equal
    one process (the clip binds, AdamW)."""
    out, ranks, refs = run
    ref_losses, ref_params = refs[False]
    seen = set()
    for r in ranks:
        job = r["jobs"]["external_fthenb"]
        np.testing.assert_allclose(job["losses"], ref_losses, rtol=1e-5, atol=1e-6)
        params = np.load(os.path.join(out, f"external_fthenb.rank{r['rank']}.npz"))
        seen |= set(params.files)
        bad = [n for n in params.files if not np.allclose(params[n], ref_params[n], rtol=RTOL, atol=ATOL)]
        assert bad == [], (r["rank"], bad)
    assert seen == set(ref_params)
    assert len({tuple(r["jobs"]["external_fthenb"]["losses"]) for r in ranks}) == 1


def test_rank_zero_alone_reads_the_loss_after_backward(run):
    """``if rank == 0: float(loss)`` (also item(), numpy(), f"{loss:.6f}") after loss.backward() on a rank that
    holds no shard of the loss: every step's value equals one process's, with no paddle.distributed call."""
    _, ranks, refs = run
    reads = ranks[0]["jobs"]["external_fthenb"]["rank0_reads"]
    assert len(reads) == STEPS and all(r["calls"] == 0 for r in reads), reads
    for read, want in zip(reads, refs[False][0]):
        np.testing.assert_allclose(read["values"], [want] * 4, rtol=1e-5, atol=1e-6)
    assert all(r["jobs"]["external_fthenb"]["rank0_reads"] == [] for r in ranks[1:])


def test_rank_zero_alone_reading_before_backward_fails_fast_on_every_rank(run):
    """The same read BEFORE loss.backward() (was: rank 0 waited 30 s in gloo, then ``TIMEOUT pair_rank = -1``, the
    last stage's ranks a failed SEND_B): every rank raises LossReadOnSomeRanksError naming rank 0 and the fix."""
    from autoparallel.parallel.pipeline.loss_sync import FIX

    _, ranks, _ = run
    for r in ranks:
        job = r["jobs"]["external_read_before_backward"]["before_backward"]
        assert job["error_type"] == "LossReadOnSomeRanksError", (r["rank"], job)
        assert "was read on 1 of 4 ranks [0] while 3 rank(s) were at loss.backward() and 0 at" in job["message"]
        assert job["message"].endswith(FIX)
        assert job["seconds"] < 10, job["seconds"]


def test_rank_zero_alone_reading_a_tensor_made_after_backward_fails_fast(run):
    """``float(loss * 2)`` on rank 0 alone after backward (not kept) while the others call the pipeline again: every
    rank raises LossReadOnSomeRanksError at the call's first exchange (before any transfer)."""
    _, ranks, _ = run
    for r in ranks:
        job = r["jobs"]["external_read_before_backward"]["derived_after_backward"]
        assert job["error_type"] == "LossReadOnSomeRanksError", (r["rank"], job)
        assert "was read on 1 of 4 ranks [0] while 0 rank(s) were at loss.backward() and 3 at the pipeline's next " \
               "call" in job["message"]
        assert job["seconds"] < 10, job["seconds"]
