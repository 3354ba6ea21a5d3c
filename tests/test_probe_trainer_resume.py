"""PaddleFormers' Trainer checkpoints (``save_steps``, its default flex format) over a Llama parallelized here with
ZeRO, in the simulated world (``ap.simulate(world_size=4)``): the run that saved equals one process, and a new
Trainer with ``resume_from_checkpoint`` (checkpoint-2 of 4 steps) logs the same losses 3-4 and ends with every
parameter of the uninterrupted one-process run -- under ZeRO-1/2/3, dp 2 x tp 2 x ZeRO-2, and a ZeRO-2 save
resumed under ZeRO-3 and plain DP. Negative control: the same resume without the optimizer states ends
elsewhere. Forms that cannot be honoured are refused when the Trainer is
built (before: ShardedExportError at the first save, or the ZeRO guard at the first flex save)."""
import importlib.machinery
import os
import sys
import tempfile
import types

import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.testing import paddleformers_models as pfm

pytestmark = pytest.mark.skipif(not pfm.available(), reason="PaddleFormers is not installed (the models extra)")
IDS, LABELS = pfm.batch(0, b=16, t=8)
STEPS = 4


@pytest.fixture(scope="module")
def trainer_cls():
    try:
        from paddleformers.trainer import Trainer, TrainerCallback, TrainingArguments
    except ImportError:               # the trainer imports `datasets`, whose pyarrow may need another numpy:
        stub = types.ModuleType("datasets")           # it only isinstance-checks datasets.Dataset
        stub.Dataset = type("Dataset", (), {})
        stub.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
        with pytest.MonkeyPatch.context() as mp:      # the stub is gone after the import
            mp.setitem(sys.modules, "datasets", stub)
            from paddleformers.trainer import Trainer, TrainerCallback, TrainingArguments
    return Trainer, TrainerCallback, TrainingArguments


class Data(paddle.io.Dataset):
    def __len__(self):
        return len(IDS)

    def __getitem__(self, i):
        return {"input_ids": IDS[i], "labels": LABELS[i]}


def strategy(tp=1, stage=0):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = 4 // tp, tp
    if stage:
        s.sharding.enable, s.sharding.stage = True, stage
    return s


def run(cls, layout=None, out=None, resume=None, save=True, sched=False, build=None, **kw):
    """(logged losses, {name: global parameter}) of a Trainer over a fresh Llama; ``layout`` (tp, stage) is
    built inside ap.simulate(world_size=4), None is one process. ``sched``: AdamW over a StepDecay scheduler
    handed to the Trainer with it (``optimizers=(opt, scheduler)``)."""
    Trainer, Callback, TrainingArguments = cls
    seen = []

    class Losses(Callback):
        def on_log(self, args, state, control, logs=None, **_):
            if logs and "loss" in logs:
                seen.append(logs["loss"])

    def go():
        model = (build or (lambda: pfm.build("llama", 0)))()
        lr = paddle.optimizer.lr.StepDecay(3e-3, step_size=1, gamma=0.5) if sched else 1e-3
        opt = paddle.optimizer.AdamW(lr, parameters=model.parameters(), weight_decay=0.0)
        if layout is not None:
            model, opt = ap.parallelize(model, opt, strategy=strategy(*layout))
        args = TrainingArguments(
            output_dir=out or tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=4, seed=0,
            learning_rate=1e-3, weight_decay=0.0, dataloader_shuffle=False, sharding="", amp_master_grad=False,
            logging_steps=1, report_to=[], disable_tqdm=True, save_strategy="steps" if save else "no",
            save_steps=2, **kw)
        Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, lr if sched else None),
                callbacks=[Losses()]).train(resume_from_checkpoint=resume)
        return {n: (p.full() if ap.is_dist(p) else p).numpy() for n, p in model.named_parameters()}

    if layout is None:
        return seen, go()
    with ap.simulate(world_size=4):
        return seen, go()


@pytest.fixture(scope="module")
def one(trainer_cls):
    return run(trainer_cls, save=False)


@pytest.fixture(scope="module")
def saved(trainer_cls):
    """{layout: (the saving run, its output directory)}, each saved once."""
    cache = {}

    def get(layout):
        if layout not in cache:
            out = tempfile.mkdtemp()
            cache[layout] = (run(trainer_cls, layout, out=out), out)
        return cache[layout]

    return get


def assert_equal(got, want, losses=None):
    assert len(got[0]) == len(losses or want[0]), (got[0], want[0])
    np.testing.assert_allclose(got[0], want[0][-len(got[0]):], rtol=0, atol=1e-5)
    for n, v in want[1].items():
        np.testing.assert_allclose(got[1][n], v, rtol=1e-4, atol=1e-5, err_msg=n)   # as tests/test_probe_loops2_trainer.py


@pytest.mark.parametrize("src,dst", [((1, 1), (1, 1)), ((1, 2), (1, 2)), ((1, 3), (1, 3)), ((2, 2), (2, 2)),
                                     ((1, 2), (1, 3)), ((1, 2), (1, 0))])
def test_trainer_resumes_under_zero_equal_to_one_process(trainer_cls, one, saved, src, dst):
    first, out = saved(src)
    assert_equal(first, one)                                    # the saving run itself
    got = run(trainer_cls, dst, resume=os.path.join(out, "checkpoint-2"), save=False)
    assert_equal(got, one, losses=one[0][2:])                   # steps 3 and 4 after the resume


def test_resume_with_a_scheduler_under_zero(trainer_cls):
    """The Trainer saves and restores the scheduler handed to it (scheduler.pdparams): steps 3-4 after the resume
    under ZeRO-3 run at the decayed rates, as in one process."""
    want = run(trainer_cls, save=False, sched=True)
    out = tempfile.mkdtemp()
    assert_equal(run(trainer_cls, (1, 2), out=out, sched=True), want)
    assert_equal(run(trainer_cls, (1, 3), resume=os.path.join(out, "checkpoint-2"), save=False, sched=True), want,
                 losses=want[0][2:])


def test_a_checkpoint_of_another_model_is_refused(trainer_cls, saved):
    """A Llama of 3 layers resuming from the 2-layer checkpoint: ValueError naming the missing entries."""
    _, out = saved((1, 2))
    with pytest.raises(ValueError, match="lacks .* entries of LlamaForCausalLM.*layers.2"):
        run(trainer_cls, (1, 2), resume=os.path.join(out, "checkpoint-2"), save=False,
            build=lambda: pfm.build("llama", 0, num_hidden_layers=3))


def test_resume_without_optimizer_states_differs(trainer_cls, one, saved, monkeypatch):
    """The control: the checkpoint's parameters with fresh AdamW moments end away from the uninterrupted run."""
    from autoparallel import trainer_resume

    load = trainer_resume.load
    monkeypatch.setattr(trainer_resume, "load", lambda m, o, p, with_optimizer=True: load(m, o, p, False))
    _, out = saved((1, 2))
    got = run(trainer_cls, (1, 2), resume=os.path.join(out, "checkpoint-2"), save=False)
    assert len(got[0]) == 2 and max(float(np.abs(got[1][n] - v).max()) for n, v in one[1].items()) > 1e-4


@pytest.mark.parametrize("kw,named", [
    ({"save_checkpoint_format": None}, "save_checkpoint_format=None with save_strategy='steps'"),
    ({"save_checkpoint_format": "sharding_io"}, "save_checkpoint_format='sharding_io'"),
    ({"load_checkpoint_format": "sharding_io", "save_strategy": "no"}, "load_checkpoint_format='sharding_io'"),
    ({"aoa_config": {"x": ["y"]}}, "aoa_config="),
])
def test_checkpoint_forms_not_honoured_are_refused_when_built(trainer_cls, kw, named):
    """Before: no refusal; the first save_steps raised ShardedExportError (paddle.save of the ZeRO optimizer's
    distributed states) after two steps had run."""
    Trainer, _, TrainingArguments = trainer_cls
    base = dict(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=4, sharding="",
                report_to=[], disable_tqdm=True, save_strategy="steps", save_steps=2, amp_master_grad=False)
    with ap.simulate(world_size=4):
        model = pfm.build("llama", 0)
        model, opt = ap.parallelize(model, paddle.optimizer.AdamW(1e-3, parameters=model.parameters()),
                                    strategy=strategy(1, 2))
        with pytest.raises(NotImplementedError, match=named.replace("(", "\\(").replace("[", "\\[")):
            Trainer(model=model, args=TrainingArguments(**{**base, **kw}), train_dataset=Data(),
                    optimizers=(opt, None))


def test_saving_master_weights_is_refused_when_built(trainer_cls):
    """A multi_precision optimizer over bfloat16 parameters: its fp32 masters are not in the one-process flex
    checkpoint. Before: the first save_steps raised NotImplementedError (whole_state.py) after two steps."""
    Trainer, _, TrainingArguments = trainer_cls
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=4,
                             sharding="", report_to=[], disable_tqdm=True, save_strategy="steps", save_steps=2,
                             amp_master_grad=False)
    with ap.simulate(world_size=4):
        net = paddle.nn.Linear(4, 4)
        net.to(dtype="bfloat16")
        opt = paddle.optimizer.AdamW(1e-3, parameters=net.parameters(), multi_precision=True)
        model, opt = ap.parallelize(net, opt, strategy=strategy(1, 2))
        with pytest.raises(NotImplementedError, match="multi_precision optimizer"):
            Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None))
        args.save_strategy = "no"
        Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None))   # not saving: built
