"""Code that runs on rank 0 only, on 2 real gloo ranks (one shared-launch job, dist_scripts/rank_only_worker.py):
rank-0-only reads of a data-parallel loss print the one-process value and make no collective; a ZeRO-3 state_dict
gathered on rank 0 only and a tensor-parallel evaluation forward on rank 0 only raise CollectiveMismatchError on
every rank within seconds, never paired with the other rank's collectives; so does ap.save_state_dict called on
rank 0 only (nothing written). The reads run with the defaults; the refusals with AP_COLLECTIVE_CHECK=on (off by
default: not cheap)."""
import os

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from dist_scripts import shared_launch

HERE = os.path.join(os.path.dirname(__file__), "dist_scripts")
JOB = shared_launch.job(__name__, "rank_only", os.path.join(HERE, "rank_only_worker.py"), 2, args=lambda out: [out],
                        timeout=120)


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


def one_process_losses():
    from dist_scripts.rank_only_worker import MLP, STEPS, batches

    paddle.seed(0)
    m = MLP()
    opt = paddle.optimizer.SGD(0.1, parameters=m.parameters())
    out = []
    for x, y in batches()[:STEPS]:
        loss = F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        out.append(float(loss))
    return out


def test_rank0_only_reads_of_the_loss_print_the_one_process_value_and_make_no_collective(ranks):
    ref = one_process_losses()
    reads = ranks[0]["reads"]
    assert len(reads["rank0"]) == len(ref)
    for got, want in zip(reads["rank0"], ref):            # item(), float(), f-string, numpy()
        np.testing.assert_allclose(got, [want] * 4, rtol=1e-5)
    assert reads["read_calls"] == []
    for r in ranks:                                       # training went on alike on both ranks
        np.testing.assert_allclose(r["reads"]["every_rank"], ref, rtol=1e-5)
    assert ranks[1]["reads"]["rank0"] == []


@pytest.mark.parametrize("case", ["zero3_state_dict", "tp_eval", "dp_save"])
def test_a_collective_on_rank0_only_is_refused_on_every_rank_within_seconds(ranks, case):
    texts = [r[case]["error"] or "" for r in ranks]
    for r, text in enumerate(texts):
        assert text.startswith("CollectiveMismatchError: the ranks of group [0, 1] are not making the same "
                               "collective"), (r, text)
        assert "every rank of the group must make each collective" in text and f"This rank is {r}" in text
        assert "rank_only_worker.py:" in text
        assert ranks[r][case]["seconds"] < 10, "refused before any gloo timeout"
    calls = [t.split(" (rank 0: ")[1].split("). Code that runs")[0] for t in texts]
    assert calls[0] == calls[1] and "rank 1: collective #" in calls[0], "both ranks name the same two calls"


def test_a_save_on_rank0_only_writes_nothing(ranks):
    assert not any(r["dp_save"]["written"] for r in ranks)
    assert "save_state_dict@every rank" in ranks[1]["dp_save"]["error"]

