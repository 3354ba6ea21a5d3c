"""Training loops beyond one model and one loss (tests/dist_scripts/loops6_programs.py), each against the same
program in one process (losses and every parameter, 1e-5): an EMA of the weights kept by hand on a deepcopy
(``set_value`` and ``paddle.assign``, evaluated with the EMA weights) under DP, TP and ZeRO-3; distillation from a
frozen TP teacher (eval, stop_gradient, no_grad) into a DP / ZeRO-3 student with a KL loss; a GAN (two models,
two optimizers, a detached fake batch) under DP and ZeRO-2; a CLIP-style loss whose negatives are the whole
global batch; siamese towers sharing their weights; two heads with weighted losses, one backward, two backwards
(``retain_graph``) or ``paddle.autograd.backward([l1, l2])``; layers frozen and unfrozen between steps under
ZeRO-1/2/3; ``train()`` / ``eval()`` toggles with BatchNorm; a head added after parallelize; EMA weights swapped
into a ZeRO model for evaluation and the trained ones restored (``paddle.assign(backup, p)``, ``p[...] = backup``,
``p.scale_(0.0).add_(backup)``: before, the restored values never reached the ZeRO master weights, so training
went on from the EMA weights (ZeRO-1/2) or crashed (ZeRO-3)); self-distillation from a deepcopy of the student.
On 2 and 4 real gloo ranks (jobs ``loops6`` / ``loops6_4`` of the shared launches) and in ``ap.simulate``."""
import os
import subprocess
import sys

import numpy as np
import pytest

import autoparallel as ap
from autoparallel import retained_graph
from dist_scripts import shared_launch
from loops6_programs import CASES, REFUSED, reference, run_case

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts")
WORKER = os.path.join(HERE, "loops6_worker.py")
JOB = shared_launch.job(__name__, "loops6", WORKER, 2, timeout=240)
JOB4 = shared_launch.job(__name__, "loops6_4", WORKER, 4, timeout=300)


@pytest.fixture(scope="module")
def references():
    return {name: reference(name) for name in CASES}


def same(got, ref, name):
    assert "error" not in got, f"{name}: {got.get('error')}: {got.get('text')}"
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=1e-5, err_msg=name)
    assert len(got["values"]) == len(ref["values"])
    for g, r in zip(got["values"], ref["values"]):
        assert g.keys() == r.keys(), name
        for k in r:
            np.testing.assert_allclose(g[k], r[k], rtol=1e-5, atol=1e-5, err_msg=f"{name}: {k}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_simulated_equals_one_process(references, name, world):
    with ap.simulate(world_size=world):
        got = run_case(name)
    same(got, references[name], name)


@pytest.mark.parametrize("job", [JOB, JOB4], ids=["2 ranks", "4 ranks"])
def test_real_ranks_equal_one_process(references, job):
    ranks = shared_launch.results(job)[1]
    for r in ranks:
        for name in CASES:
            same(r[name], references[name], f"rank {ranks.index(r)}: {name}")


@pytest.mark.parametrize("job", [JOB, JOB4], ids=["2 ranks", "4 ranks"])
def test_real_ranks_refuse_the_same_forms_typed(job):
    for r in shared_launch.results(job)[1]:
        for name, (_, _, kind) in REFUSED.items():
            assert r[name].get("error") == kind.__name__, (name, r[name])


def test_the_hand_gather_form_is_told_the_value_is_already_global():
    with ap.simulate(world_size=2):
        got = run_case("clip all_gather by hand")
    assert got["error"] == "TypeError" and "already the whole global batch" in got["text"]


def test_a_second_backward_from_a_temporary_root_is_refused_not_a_crash():
    """``(0.7 * l1).backward(retain_graph=True); (0.3 * l2).backward()`` through a TP trunk. Before: the
    retained graph was remembered under its root, a temporary, so the check forgot it as the statement ended and
    paddle killed the process re-running the trunk's collective (SIGSEGV). Run in a child process so that the
    crash, if it comes back, fails this test rather than the session. The message names a form that works
    (``paddle.autograd.backward([l1, l2])``, equal to one process: case "two heads autograd.backward tp"), and
    the graphs held after their root is gone are the last few only (a loop retaining every step stays bounded;
    a held graph is let go after two backward passes that do not go through it)."""
    code = ("import sys; sys.path.insert(0, %r)\n"
            "import autoparallel as ap, loops6_programs as P\n"
            "from autoparallel import retained_graph as R\n"
            "with ap.simulate(world_size=2):\n"
            "    for _ in range(R._HELD_GRAPHS + 2):\n"
            "        try:\n            P.two_heads('tp', 'two')\n"
            "        except NotImplementedError as e:\n            print('REFUSED', e)\n"
            "print('HELD', [e[2] for e in R._HELD])\n") % HERE
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.path.dirname(os.path.dirname(
        HERE)), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    refused = [ln for ln in lines if ln.startswith("REFUSED")]
    assert len(refused) == retained_graph._HELD_GRAPHS + 2 and "autograd.backward([l1, l2])" in refused[0]
    # each step's graph is let go by the next step's two passes: only the last one is held, its miss count reset
    # by the refused pass through it
    assert lines[-1] == "HELD [0]"
