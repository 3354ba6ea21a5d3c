"""PaddleFormers' ``Trainer`` (plain mode, ``enable_auto_parallel`` off) over a Llama parallelized here, in the
simulated world: 3 steps give every parameter of the same Trainer in one process, with the tensor-parallel
model and with ZeRO-3 (the optimizer ap.parallelize returned, handed over as ``optimizers=(opt, None)``); the
Trainer's own optimizer over ZeRO-managed parameters is refused, naming the optimizer to pass."""
import importlib.machinery
import sys
import tempfile
import types

import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.testing import paddleformers_models as pfm

pytestmark = pytest.mark.skipif(not pfm.available(), reason="PaddleFormers is not installed (the models extra)")
IDS, LABELS = pfm.batch(0, b=8, t=8)


@pytest.fixture(scope="module")
def trainer_cls():
    try:
        from paddleformers.trainer import Trainer, TrainingArguments
    except ImportError:               # the trainer imports `datasets`, whose pyarrow may need another numpy:
        stub = types.ModuleType("datasets")           # it only isinstance-checks datasets.Dataset
        stub.Dataset = type("Dataset", (), {})
        stub.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
        with pytest.MonkeyPatch.context() as mp:      # the stub is gone after the import
            mp.setitem(sys.modules, "datasets", stub)
            from paddleformers.trainer import Trainer, TrainingArguments
    return Trainer, TrainingArguments


class Data(paddle.io.Dataset):
    def __len__(self):
        return len(IDS)

    def __getitem__(self, i):
        return {"input_ids": IDS[i], "labels": LABELS[i]}


def train(cls, strategy=None, hand_over=True, accumulate=1, recompute=None):
    Trainer, TrainingArguments = cls
    model = pfm.build("llama", 0)
    opt = (paddle.optimizer.AdamW(1e-3, parameters=model.parameters(), weight_decay=0.0) if accumulate == 1 and
           not recompute else
           paddle.optimizer.SGD(0.5, parameters=model.parameters()))    # SGD: Adam hides a gradient's scale
    if strategy is not None:
        model, opt = ap.parallelize(model, opt, strategy=strategy)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=3, per_device_train_batch_size=4 // accumulate,
                             gradient_accumulation_steps=accumulate,
                             learning_rate=1e-3, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
                             amp_master_grad=False, logging_steps=1, recompute_granularity=recompute)
    Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt if hand_over else None, None)).train()
    return {n: (p.full() if ap.is_dist(p) else p).numpy() for n, p in model.named_parameters()}


def strategy(tp=1, stage=0):
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = 4 // tp, tp
    if stage:
        s.sharding.enable, s.sharding.stage = True, stage
    return s


@pytest.fixture(scope="module")
def one(trainer_cls):
    return train(trainer_cls)


@pytest.mark.parametrize("tp,stage", [(2, 0), (1, 3)])
def test_trainer_steps_equal_one_process(trainer_cls, one, tp, stage):
    with ap.simulate(world_size=4):
        got = train(trainer_cls, strategy(tp, stage))
    initial = pfm.build("llama", 0).state_dict()
    moved = max(float(np.abs(v - initial[n].numpy()).max()) for n, v in one.items())
    assert moved > 1e-4                                   # the steps changed the weights (the comparison can fail)
    for n, v in one.items():
        np.testing.assert_allclose(got[n], v, rtol=1e-4, atol=1e-5, err_msg=n)


def test_trainer_own_optimizer_over_zero_parameters_is_refused(trainer_cls):
    with ap.simulate(world_size=4), pytest.raises(NotImplementedError, match="optimizers=\\(opt, None\\)"):
        train(trainer_cls, strategy(1, 1), hand_over=False)


@pytest.mark.parametrize("accumulate,recompute", [(2, None), (1, "full")])
def test_trainer_no_sync_paths_under_tensor_parallel(trainer_cls, monkeypatch, accumulate, recompute):
    """Accumulation: the Trainer runs the non-final micro-batches under model.no_sync() and divides p.grad by hand
    (every simulated rank's copy is divided: trainer_forms.py). recompute_granularity: every backward under
    no_sync, then the Trainer's own fused_allreduce_gradients, which leaves the distributed parameters to the
    optimizer (it failed on paddle's uninitialised global group)."""
    monkeypatch.setattr(paddle.device, "synchronize", lambda *a, **k: None)     # the Trainer calls it; CPU refuses
    want = train(trainer_cls, accumulate=accumulate, recompute=recompute)
    with ap.simulate(world_size=4):
        got = train(trainer_cls, strategy(2, 0), accumulate=accumulate, recompute=recompute)
    for n, v in want.items():
        np.testing.assert_allclose(got[n], v, rtol=1e-4, atol=1e-5, err_msg=n)


def test_trainer_on_several_ranks_is_refused(trainer_cls):
    """On N launched ranks the Trainer sets up fleet's groups and paddle.DataParallel over the model (checked on 2
    real ranks by hand: fleet failed with AttributeError '_hcg' before): refused when it is built."""
    from autoparallel import trainer_forms

    trainer_forms.install()
    Trainer, _ = trainer_cls
    with ap.simulate(world_size=2):
        model = ap.shard_layer(paddle.nn.Linear(2, 2), ap.ProcessMesh([0, 1], dim_names=["dp"]))
        with pytest.raises(NotImplementedError, match="Trainer on 2 launched ranks"):
            Trainer(model=model, args=types.SimpleNamespace(world_size=2))


# ---- over a pipeline-parallel model (ap.parallelize with pipeline_parallel.degree 2): autoparallel/trainer_pipeline.py

def pipe_llama():
    return pfm.build("llama", 0, tie_word_embeddings=False, num_hidden_layers=4)


def train_pipe(cls, pp_dp=None, accumulate=1, clip=0.0, evals=False, steps=3, resume=None, **extra):
    """The Trainer over the 4-layer untied Llama (pipelined when ``pp_dp`` is (pp, dp)), the optimizer handed over
    (``clip``: its ClipGradByGlobalNorm, which is what clips with a handed-over optimizer). Returns (logged losses
    with the evaluation losses, parameters by name)."""
    from paddleformers.trainer import TrainerCallback

    Trainer, TrainingArguments = cls
    model = pipe_llama()
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters(), weight_decay=0.0,
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(clip) if clip else None)
    if pp_dp is not None:
        s = ap.Strategy()
        s.pipeline_parallel.degree, s.pipeline_parallel.micro_batches = pp_dp[0], 2
        s.data_parallel.degree = pp_dp[1]
        if len(pp_dp) > 2:                                          # (pp, dp, tp, ZeRO stage)
            s.tensor_parallel.degree = pp_dp[2]
            if pp_dp[3]:
                s.sharding.enable, s.sharding.stage = True, pp_dp[3]
        model, opt = ap.parallelize(model, opt, strategy=s)
    logged = []

    class Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.extend((k, v) for k, v in sorted((logs or {}).items()) if k in ("loss", "eval_loss"))

    ev = dict(evaluation_strategy="steps", eval_steps=2, per_device_eval_batch_size=4) if evals else {}
    kw = dict(output_dir=tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=4,
              gradient_accumulation_steps=accumulate, learning_rate=1e-3, save_strategy="no", report_to=[],
              disable_tqdm=True, seed=0, amp_master_grad=False, logging_steps=1, sharding="", max_grad_norm=clip,
              dataloader_shuffle=False, **ev)
    kw.update(extra)
    args = TrainingArguments(**kw)
    Trainer(model=model, args=args, train_dataset=Data(), eval_dataset=Data() if evals else None,
            optimizers=(opt, None), callbacks=[Log()]).train(resume_from_checkpoint=resume)
    return logged, {n: (p.full() if ap.is_dist(p) else p).numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dp,tp,stage,accumulate,clip,evals", [
    (1, 1, 0, 1, 0.0, True), (1, 1, 0, 2, 0.05, False), (2, 1, 0, 2, 0.05, True), (1, 2, 0, 2, 0.05, True),
    (2, 1, 2, 2, 0.05, True)])
def test_trainer_over_pipeline_equals_one_process(trainer_cls, monkeypatch, dp, tp, stage, accumulate, clip, evals):
    """PP2, PP2 x DP2, PP2 x TP2 and PP2 x DP2 x ZeRO-2 (1F1B, 2 micro-batches): every logged loss, the evaluation loss (the Trainer's evaluation
    loop: the pipeline's eval_batch) and every parameter equal the one-process Trainer. With accumulation the
    Trainer's model.no_sync() raised (the pipeline's, for train_batch users); clipping binds (the losses differ
    from the unclipped run's)."""
    monkeypatch.setattr(paddle.device, "synchronize", lambda *a, **k: None)     # the Trainer calls it; CPU refuses
    want_losses, want = train_pipe(trainer_cls, None, accumulate, clip, evals)
    with ap.simulate(world_size=2 * dp * tp):
        losses, got = train_pipe(trainer_cls, (2, dp, tp, stage), accumulate, clip, evals)
    assert [k for k, _ in losses] == [k for k, _ in want_losses] and len(losses) == 3 + evals
    np.testing.assert_allclose([v for _, v in losses], [v for _, v in want_losses], rtol=1e-5)
    start = pipe_llama().state_dict()
    assert max(float(np.abs(v - start[n].numpy()).max()) for n, v in want.items()) > 1e-4
    assert set(got) == set(want)
    for n, v in want.items():
        np.testing.assert_allclose(got[n], v, rtol=1e-4, atol=2e-5, err_msg=n)
    if clip:
        unclipped, _ = train_pipe(trainer_cls, None, accumulate, 0.0, evals)
        assert abs(unclipped[1][1] - want_losses[1][1]) > 1e-5          # the clip changed the second step


@pytest.mark.parametrize("form,match", [
    ("own optimizer", r"optimizers=\(opt, None\)"), ("best", "load_best_model_at_end=True"),
    ("recompute", "recompute_granularity='full'"), ("resume elsewhere", "holds no pipeline_state/"),
    ("save format", "save_checkpoint_format='unified_checkpoint'")])
def test_trainer_over_pipeline_refusals(trainer_cls, form, match):
    """What cannot be honoured over a pipeline is refused by name before any step (the Trainer's own optimizer
    would not reduce the data-parallel gradients nor clip over every stage; its checkpoints are one process's state
    dict; recompute_granularity makes it all-reduce every parameter over the world itself; a checkpoint without
    the pipeline's state; another save format)."""
    from autoparallel import trainer_forms

    trainer_forms.install()
    Trainer, TrainingArguments = trainer_cls
    with ap.simulate(world_size=2):
        s = ap.Strategy()
        s.pipeline_parallel.degree, s.pipeline_parallel.micro_batches = 2, 2
        model = pipe_llama()
        pipe, opt = ap.parallelize(model, paddle.optimizer.AdamW(1e-3, parameters=model.parameters()), strategy=s)
        before = {n: p.numpy().copy() for n, p in pipe.named_parameters()}
        extra = {"best": dict(load_best_model_at_end=True, save_strategy="steps", evaluation_strategy="steps",
                              save_steps=1, eval_steps=1),
                 "save format": dict(save_strategy="steps", save_checkpoint_format="unified_checkpoint"),
                 "recompute": dict(recompute_granularity="full")}.get(form, {})
        kw = dict(output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=4, save_strategy="no",
                  report_to=[], disable_tqdm=True, sharding="", amp_master_grad=False)
        kw.update(extra)
        with pytest.raises(FileNotFoundError if form == "resume elsewhere" else NotImplementedError, match=match):
            t = Trainer(model=pipe, args=TrainingArguments(**kw), train_dataset=Data(),
                        optimizers=(None if form == "own optimizer" else opt, None))
            if form == "resume elsewhere":
                t.train(resume_from_checkpoint=tempfile.mkdtemp())
        for n, p in pipe.named_parameters():                      # refused before any step
            np.testing.assert_array_equal(p.numpy(), before[n])


def test_trainer_over_pipeline_checkpoint_resumes_equal_to_one_process(trainer_cls, tmp_path):
    """PP2 x DP2 saving every 2 of 4 steps writes each stage's parameters and AdamW states (ap.training_state with
    ap.save_state_dict, <checkpoint>/pipeline_state); a new Trainer over a new pipeline resumes from checkpoint-2:
    the logged losses of steps 3-4 and every parameter equal one process's 4 steps (before: AttributeError
    'PipelineModule' object has no attribute 'sharded_state_dict' at the first save). The parameters alone
    (ignore_load_lr_and_optim) give other parameters: the optimizer states were read."""
    import os

    want = train_pipe(trainer_cls, None, steps=4)
    with ap.simulate(world_size=4):
        train_pipe(trainer_cls, (2, 2), steps=4, output_dir=str(tmp_path), save_strategy="steps", save_steps=2)
        assert os.path.isdir(tmp_path / "checkpoint-2" / "pipeline_state")
        got_losses, got = train_pipe(trainer_cls, (2, 2), steps=4, resume=str(tmp_path / "checkpoint-2"))
        _, control = train_pipe(trainer_cls, (2, 2), steps=4, resume=str(tmp_path / "checkpoint-2"),
                                ignore_load_lr_and_optim=True)
    assert len(got_losses) == 2
    np.testing.assert_allclose([v for _, v in got_losses], [v for _, v in want[0][-2:]], rtol=1e-5)
    for n, v in want[1].items():
        np.testing.assert_allclose(got[n], v, rtol=1e-4, atol=2e-5, err_msg=n)
    assert max(float(np.abs(control[n] - v).max()) for n, v in want[1].items()) > 1e-4
