"""The user's own paddle.distributed collectives on 2 real gloo ranks (one shared-launch job,
dist_scripts/launch_forms_worker.py; docs/launch_forms.md): a metric all_reduce every step (of the loss's value
as a plain tensor; of the distributed loss itself refused) beside the data-parallel run's own reductions (values equal one process, no false collective-log mismatch), a
hand-made broadcast of a replicated weight, a refused broadcast / all_reduce of a tensor-parallel weight, and a
broadcast_object_list written on two lines by rank, after which the ranks' collective logs still agree."""
import os

import numpy as np
import paddle
import pytest

from dist_scripts import shared_launch

HERE = os.path.join(os.path.dirname(__file__), "dist_scripts")
JOB = shared_launch.job(__name__, "launch_forms", os.path.join(HERE, "launch_forms_worker.py"), 2,
                        args=lambda out: [out], timeout=120)


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


def one_process():
    import paddle.nn.functional as F

    from dist_scripts.launch_forms_worker import MLP, batches

    paddle.seed(0)
    m = MLP()
    opt = paddle.optimizer.SGD(0.1, parameters=m.parameters())
    out = []
    for x, y in batches():
        loss = F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        out.append(float(loss))
    return out


def test_metric_all_reduce_beside_data_parallel_equals_one_process(ranks):
    ref = one_process()
    for got in ranks:
        np.testing.assert_allclose(np.array(got["dp"]), np.array([ref, ref, [1.0] * len(ref)]).T, rtol=1e-5,
                                   atol=1e-6)


def test_broadcast_of_a_replicated_weight_syncs_it(ranks):
    assert [r["broadcast_replicated"] for r in ranks] == [True, True]


def test_collectives_on_a_sharded_weight_are_refused_and_move_nothing(ranks):
    for r in ranks:
        assert all(e is not None and "S(1) on mesh dim 'x'" in e for e in r["sharded"]["errors"]), r["sharded"]
        assert r["sharded"]["unchanged"]
    assert ranks[0]["sharded"]["full"] == ranks[1]["sharded"]["full"]


def test_user_collectives_from_different_lines_keep_the_logs_equal(ranks):
    assert [r["object"] for r in ranks] == [{"lr": 0.1}, {"lr": 0.1}]
    assert [r["logs_agree"] for r in ranks] == [True, True]
