"""PaddleFormers' Trainer on 4 real gloo ranks over a Llama parallelized here (dp 4; dp 2 x tp 2), one job of the
shared 4-rank launch (tests/dist_scripts/trainer_real_worker.py): logged losses and every parameter equal the same
Trainer in one process on the same global batches (with gradient accumulation, the Trainer's own AdamW with
max_grad_norm, SGD with a global-norm clip over the shards); the clipped run against the unclipped one is the
control. The flex checkpoints the distributed Trainer wrote (``save_steps``, ``save_model``) are loaded here, in
one process, into a plain Llama and a plain AdamW and compared with the one-process Trainer's. In the same job,
hapi's paddle.Model (fit with losses per step, evaluate, predict, save) over an MLP laid out dp 4 and dp 2 x tp 2
(tests/dist_scripts/hapi_real_cases.py)."""
import os

import numpy as np
import paddle
import pytest

from autoparallel.testing import paddleformers_models as pfm
from dist_scripts import shared_launch

pytestmark = pytest.mark.skipif(not pfm.available(), reason="PaddleFormers is not installed (the models extra)")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts", "trainer_real_worker.py")
JOB = shared_launch.job(__name__, "trainer_real", WORKER, 4, args=lambda out: [out], timeout=300)
CASES = 3


@pytest.fixture(scope="module")
def job():
    out, ranks = shared_launch.results(JOB)
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    return out, ranks


def test_hapi_model_equals_one_process_on_real_ranks(job):
    for r in job[1]:
        cases = {k: v for k, v in r["cases"].items() if k.startswith("hapi")}
        assert len(cases) == 2, sorted(cases)
        for name, got in cases.items():
            assert "error" not in got, f"{name}, rank {r['rank']}:\n{got['error']}"
            assert got["moved"] > 1e-2, (name, got)
            for what in ("loss", "param", "eval", "predict", "saved", "reload"):
                assert got[what] <= 1e-5, (name, r["rank"], what, got)


def test_trainer_steps_equal_one_process_on_real_ranks(job):
    for r in job[1]:
        cases = {k: v for k, v in r["cases"].items() if not k.startswith(("control", "hapi"))}
        assert len(cases) == CASES, sorted(cases)
        for name, got in cases.items():
            assert "error" not in got, f"{name}, rank {r['rank']}:\n{got['error']}"
            assert got["moved"] > 1e-3, (name, got)                     # the steps changed the weights
            assert got["loss"] <= 1e-5 and got["param"] <= 2e-5, (name, r["rank"], got)


def test_clipping_is_seen_on_real_ranks(job):
    for r in job[1]:
        got = r["cases"]["control: clipped vs unclipped"]
        assert "error" not in got, got.get("error")
        assert got["param"] > 1e-3, (r["rank"], got)


def _load(path, template: dict) -> dict:
    paddle.distributed.load_state_dict(template, path)
    return {k: np.asarray(v.local_tensor if hasattr(v, "local_tensor") else v) for k, v in template.items()}


def _templates():
    """A plain Llama's state dict and its AdamW's flex (sharded) state dict, as one process holds them (seed 1:
    other values than the checkpoint's)."""
    model = pfm.build("llama", 1)
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters(), weight_decay=0.0)
    ids, labels = pfm.batch(1, b=2, t=8)
    pfm.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels))).backward()
    opt.step()                                      # creates the moments the checkpoint holds
    return model.state_dict(), opt.sharded_state_dict(model.sharded_state_dict())


def test_checkpoints_load_into_one_process(job):
    """``save_model`` at the end: the trained parameters; the ``save_steps=2`` checkpoint: the one-process
    Trainer's parameters and AdamW moments after step 2."""
    out, _ = job
    model, opt = _templates()
    final = _load(os.path.join(out, "dist", "final", "model_state"), model)
    trained = dict(np.load(os.path.join(out, "dist_params.npz")))
    for n, v in trained.items():
        np.testing.assert_array_equal(final[n], v, err_msg=n)
    model, opt = _templates()
    for sub, template, ref in (("model_state", model, "step2_model.npz"), ("optimizer_state", opt, "step2_opt.npz")):
        want = dict(np.load(os.path.join(out, ref)))
        got = _load(os.path.join(out, "dist", "checkpoint-2", sub), template)
        assert sorted(got) == sorted(want) and len(want) > 10, (sub, sorted(set(got) ^ set(want))[:5])
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-6, err_msg=f"{sub}: {k}")
