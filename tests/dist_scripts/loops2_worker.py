"""Runs on every rank (4): the simulated probes of tests/test_probe_loops2_no_sync.py and
test_probe_loops2_autograd.py on real gloo ranks -- no_sync accumulation, gradient penalties through real
collectives (create_graph), an input's gradient gathered across ranks, parameter vectors -- each against the
one-process run computed on the rank itself. Reports {form: {"err"} or {"error": traceback}} (err <= 1: equal
within the tolerance)."""

import numpy as np
import paddle

import autoparallel as ap
import loops2_helpers as H
import test_probe_loops2_autograd as A
import test_probe_loops2_no_sync as N
from autoparallel.comm import collectives
from autoparallel.testing.launch import write_result
from forms_runner import run_all

world = ap.init_parallel_env()


def err(want, got, tol=1e-4) -> float:
    pairs = [(got[0], want[0])] + [(got[1][n], v) for n, v in want[1].items()]
    return max(float((np.abs(np.asarray(a, "float64") - np.asarray(b, "float64")) /
                      (tol + tol * np.abs(np.asarray(b, "float64")))).max()) for a, b in pairs)


def form(probe, run):
    return lambda: err(probe(H.One()), probe(H.RUNS[run]()))


def no_sync(env):
    return N.accumulate(env, use_no_sync=type(env) is not H.One)


def saliency():
    want = A.saliency(H.One()).numpy()
    got = A.saliency(H.Parallelize(tp=2)).numpy()
    return float((np.abs(got - want) / (1e-5 + 1e-4 * np.abs(want))).max())


FORMS = {f"no_sync / {r}": form(no_sync, r) for r in ("dp x tp", "zero2", "parallelize dp", "parallelize zero3")}
FORMS.update({f"parameter penalty / {r}": form(lambda e: A.train(e, A.param_penalty), r)
              for r in ("dp x tp", "parallelize tp", "zero3")})
FORMS.update({f"input penalty / {r}": form(lambda e: A.train(e, A.input_penalty), r)
              for r in ("dp x tp", "parallelize dp")})
FORMS.update({f"parameter vector / {r}": form(lambda e: A.train(e, A.shrink_by_vector), r)
              for r in ("zero3", "parallelize tp")})
FORMS["input gradient x.grad / parallelize tp"] = saliency


def ddp_refused():
    """paddle.DataParallel over a parallelized model (a second reduction of its gradients) is refused, naming the
    double reduction (0: refused so; inf: anything else). hapi and PaddleFormers' Trainer no longer wrap such a
    model on several ranks (tests/test_probe_trainer_real.py)."""
    env = H.Parallelize()
    m, _ = env.wrap(env.model(), None)
    try:
        paddle.DataParallel(m)
    except NotImplementedError as e:
        return 0.0 if "paddle.DataParallel over" in str(e) else float("inf")
    return float("inf")


FORMS["paddle.DataParallel over a parallelized model refused"] = ddp_refused


def cut_second_order():
    """The control: the collectives' create_graph backward forced to no_grad (second-order terms cut)."""
    old = collectives._differentiable_backward
    collectives._differentiable_backward = A._no_grad
    try:
        return FORMS["parameter penalty / dp x tp"]()
    finally:
        collectives._differentiable_backward = old




paddle.seed(0)
write_result({"rank": world.rank, "forms": run_all(FORMS), "negative": run_all({"cut": cut_second_order})})
