"""Non-LLM models on 4 real gloo ranks (one job of the shared 4-rank launch,
tests/dist_scripts/probe_real_layers_worker.py): resnet18 with BatchNorm in train mode, data parallel over 4, two
SGD steps fed by ``ap.shard_dataloader`` (losses, parameters, running statistics, eval output); a channel-split conv +
BatchNorm; a small UNet with Conv2DTranspose under dp2 x tp2; a user PyLayer under dp4; float64 gradient buckets.
Each against the one-process run on the same rank (separate autograd graphs, hooks and real collectives per
rank, which the simulated world shares). Negative controls: the gradients not reduced, the PyLayer run per shard, BatchNorm statistics per shard."""
import os

import pytest

from dist_scripts import shared_launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts", "probe_real_layers_worker.py")
JOB = shared_launch.job(__name__, "probe_real_layers", WORKER, 4, timeout=120)
FORMS = 7


@pytest.fixture(scope="module")
def ranks():
    _, got = shared_launch.results(JOB)
    assert sorted(r["rank"] for r in got) == [0, 1, 2, 3]
    for r in got:
        print(f"rank {r['rank']}:", {k: (v.get("err", "error"), v.get("s")) for k, v in {**r["forms"], **r["negative"]}.items()})
    return got


def test_every_form_ran_on_every_rank(ranks):
    assert all(len(r["forms"]) == FORMS for r in ranks), [sorted(r["forms"]) for r in ranks]


def test_negative_controls_are_seen_on_real_ranks(ranks):
    """The float64 CNN with no gradient reduction (each rank steps on its own shard's gradient), the PyLayer
    centring each rank's shard of the batch, BatchNorm's running statistics of each rank's shard (sums not
    all-reduced): every rank sees the difference from one process."""
    for r in ranks:
        assert len(r["negative"]) == 3
        for name, got in r["negative"].items():
            assert "error" not in got, f"{name}, rank {r['rank']}:\n{got['error']}"
            assert got["err"] > 1.0, (name, r["rank"], got["err"])


@pytest.mark.parametrize("i", range(FORMS))
def test_form_equals_one_process_on_real_ranks(ranks, i):
    name = sorted(ranks[0]["forms"])[i]
    for rank, r in enumerate(ranks):
        got = r["forms"][name]
        assert "error" not in got, f"{name}, rank {rank}:\n{got['error']}"
        assert got["err"] <= 1.0, f"{name}, rank {rank}: {got['err']:.3g} x the tolerance"
