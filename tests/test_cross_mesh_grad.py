"""Gradients through ap.reshard between meshes of different ranks: which destination sends each source its
gradient (pure), the refusal of meshes sharing some ranks, and the programs of cross_mesh_cases.py in the
simulated world against one process -- including whole tensors moved between meshes of different sizes, whose
gradient was wrong in simulation too before (twice the gradient for a source feeding two ranks, none for a
source that sent nothing). The launched-rank runs are in test_cross_mesh_grad_dist.py."""
import numpy as np
import paddle
import pytest

import autoparallel as ap
import cross_mesh_cases as C
from autoparallel.cross_mesh_grad import grad_pairs, unsupported
from reshard.program import whole_pairs


def test_grad_pairs_reverse_a_one_to_one_move():
    assert grad_pairs([(0, 2), (1, 3)], [0, 1], [2, 3]) == ((2, 0), (3, 1))


def test_grad_pairs_a_source_feeding_two_ranks_gets_one_gradient():
    pairs = whole_pairs([0], [1, 2])
    assert pairs == ((0, 1), (0, 2))
    assert grad_pairs(pairs, [0], [1, 2]) == ((1, 0),)


def test_grad_pairs_a_source_that_sent_nothing_still_gets_its_gradient():
    pairs = whole_pairs([0, 1, 2], [5])
    assert pairs == ((0, 5),)
    assert grad_pairs(pairs, [0, 1, 2], [5]) == ((5, 0), (5, 1), (5, 2))
    assert grad_pairs(whole_pairs([0, 1, 2], [5, 6]), [0, 1, 2], [5, 6]) == ((5, 0), (6, 1), (5, 2))


def test_grad_pairs_a_rank_of_both_meshes_keeps_its_own():
    pairs = whole_pairs([0, 1], [1, 2, 3])
    assert pairs == ((1, 1), (1, 2), (0, 3))
    assert grad_pairs(pairs, [0, 1], [1, 2, 3]) == ((3, 0), (1, 1))


def test_only_meshes_sharing_some_ranks_with_messages_are_refused():
    assert unsupported([0], [1], [(0, 1)]) is None
    assert unsupported([0, 1], [1, 0], [(0, 1), (1, 0)]).count("share some ranks ([0, 1])") == 1
    assert unsupported([0, 1], [1, 2], [(1, 1), (1, 2)]) is not None
    assert unsupported([0, 1], [0, 1], [(0, 0), (1, 1)]) is None          # same ranks: nothing crosses


@pytest.mark.parametrize("src,sp,dst", [([0], ap.Replicate(), [1, 2]), ([0, 1], ap.Shard(0), [2]),
                                        ([0, 1, 2], ap.Replicate(), [3])])
def test_a_whole_tensor_between_meshes_of_different_sizes_gets_its_gradient_once(src, sp, dst):
    """Regression: the simulated move summed every copy's gradient (4w instead of 2w from [0] to [1, 2]) and
    a source rank that sent nothing got none (rows of rank 1 zero from [0, 1] S(0) to [2])."""
    w = paddle.arange(12, dtype="float32").reshape([6, 2])
    with ap.simulate(world_size=4):
        x = ap.shard_tensor(w, ap.ProcessMesh(src, dim_names=["x"]), [sp])
        x.stop_gradient = False
        y = ap.reshard(x * 1.0, ap.ProcessMesh(dst, dim_names=["x"]), [ap.Replicate()])
        (y * y).sum().backward()
        np.testing.assert_allclose(x.grad.full().numpy(), 2 * w.numpy())


@pytest.mark.parametrize("case", ["mlp [0,1] S(0) -> [2] R", "mlp [0] -> [1,2] R", "mlp Partial -> R",
                                  "loop back, sender holds a loss term", "crosses twice, one received unused"])
def test_programs_over_meshes_of_different_ranks_equal_one_process_in_simulation(case):
    ref = C.run(case, False)
    with ap.simulate(world_size=4):
        got = C.run(case, True)
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
    for k, v in ref["params"].items():
        np.testing.assert_allclose(np.asarray(got["params"][k]), np.asarray(v), rtol=1e-5, atol=1e-6, err_msg=k)


class _Twice(paddle.autograd.PyLayer):
    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


def _loop_back(through_pylayer: bool):
    """Rank 0's records of the loop-back form: h sent to rank 1 (older), z received back (newer), and a loss
    that reads z and h itself."""
    from autoparallel.cross_mesh_grad import Transfer

    a = paddle.ones([2, 2])
    a.stop_gradient = False
    h = _Twice.apply(a) if through_pylayer else a * 2.0
    z = paddle.ones([2, 2])
    z.stop_gradient = False
    loss = (h * z).sum()
    sent, received = Transfer([0], [1], [(0, 1)]), Transfer([1], [0], [(1, 0)])
    sent.sent, received.buf = h, z
    return [sent, received], loss


@pytest.mark.parametrize("through_pylayer", [False, True])
def test_two_passes_reaching_one_collective_are_refused_before_any_message(through_pylayer):
    from autoparallel.cross_mesh_grad import check_passes, pass_seeds

    recs, loss = _loop_back(through_pylayer)
    passes = pass_seeds(recs, 0, [loss])
    assert [len(p) for p in passes] == [1, 1]            # the loss before z's gradient goes, then h
    if through_pylayer:
        with pytest.raises(NotImplementedError, match="run a collective's backward twice"):
            check_passes(passes)
    else:
        check_passes(passes)                              # plain ops run again with the graph kept
    assert pass_seeds(recs, 1, []) == [] and len(pass_seeds(recs[:1], 0, [loss])) == 1
