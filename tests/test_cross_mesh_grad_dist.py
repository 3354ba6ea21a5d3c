"""Gradients through ap.reshard between meshes of different ranks on 4 launched gloo ranks (one shared-launch
job, dist_scripts/cross_mesh_worker.py), against one process: an MLP split over [0]/[1] and over [0,1]/[2,3]
(Shard(0) batch, Shard -> Replicate, Partial -> Replicate), whole tensors between meshes of different sizes, two
models, a chain of three meshes, a loss back on the first mesh that also uses the sent tensor, a tensor moved
twice and a received tensor never used, a GAN whose two backward passes per step read the move detached and whole. Every rank calls loss.backward(). Negative control: the moves
detached (the only form that ran on launched ranks before) leave the first layer behind."""
import os

import numpy as np
import pytest

import cross_mesh_cases as C
from dist_scripts import shared_launch

HERE = os.path.join(os.path.dirname(__file__), "dist_scripts")
JOB = shared_launch.job(__name__, "cross_mesh", os.path.join(HERE, "cross_mesh_worker.py"), 4, timeout=240)


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


def _check(got, ref, held):
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-4, atol=1e-6)
    assert sorted(got["params"]) == sorted(held)
    for k in held:
        np.testing.assert_allclose(np.asarray(got["params"][k]), np.asarray(ref["params"][k]), rtol=1e-4,
                                   atol=1e-5, err_msg=k)


def _held(case, rank):
    meshes, where = C.CASES[case][0], C.CASES[case][1]
    return [f"{k}.{n}" for k, m in enumerate(where) if rank in meshes[m] for n in ("weight", "bias")]


@pytest.mark.parametrize("case", list(C.CASES))
def test_two_steps_on_launched_ranks_equal_one_process(ranks, case):
    ref = C.run(case, False)
    loss_mesh = C.CASES[case][0][C.CASES[case][4]]
    for rank, got in enumerate(ranks):
        want = dict(ref, losses=ref["losses"] if rank in loss_mesh else [])
        _check(got[case], want, _held(case, rank))


def test_the_functional_backward_form_carries_the_moved_gradient_too(ranks):
    ref = C.run("mlp [0]/[1]", False)
    for rank, got in enumerate(ranks):
        want = dict(ref, losses=ref["losses"] if rank == 1 else [])
        _check(got["mlp [0]/[1], paddle.autograd.backward"], want, _held("mlp [0]/[1]", rank))


def test_a_gan_with_two_backward_passes_per_step_equals_one_process(ranks):
    """The discriminator's backward reads the moved fake detached: the move's gradient waits for the
    generator's backward (a backward sends only the moves its loss depends on)."""
    ref = C.run_gan(False)
    for rank, got in enumerate(ranks):
        want = dict(ref, losses=ref["losses"] if rank == 1 else [])
        _check(got["gan"], want, [f"{k}.{n}" for k in range(2) if rank == k for n in ("weight", "bias")])


def test_backward_twice_with_retain_graph_sends_the_moved_gradient_twice(ranks):
    ref = C.run_retained(False)
    for rank, got in enumerate(ranks):
        held = [f"{rank}.weight"] if rank < 2 else []
        assert sorted(got["retain_graph"]) == held
        for k in held:
            np.testing.assert_allclose(got["retain_graph"][k], ref[k], rtol=1e-5, atol=1e-6)


def test_negative_control_detached_moves_leave_the_first_layer_behind(ranks):
    ref = C.run("mlp [0]/[1]", False)
    got = ranks[0]["mlp [0]/[1], moves detached (control)"]["params"]
    assert not np.allclose(np.asarray(got["0.weight"]), np.asarray(ref["params"]["0.weight"]), atol=1e-4)
    assert np.allclose(ranks[0]["mlp [0]/[1]"]["params"]["0.weight"], ref["params"]["0.weight"], atol=1e-5)


def test_meshes_sharing_some_ranks_are_refused_on_every_rank_before_any_message(ranks):
    for got in ranks:
        e = got["meshes sharing a rank"]
        assert e["error"] == "NotImplementedError" and "share some ranks ([1])" in e["text"]


def test_paddle_grad_through_a_move_is_refused(ranks):
    for got in ranks:
        assert got["paddle.grad"]["error"] == "NotImplementedError"
        assert "paddle.grad through an ap.reshard" in got["paddle.grad"]["text"]
