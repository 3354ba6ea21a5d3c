"""Shared by the pipeline tests and their worker: tiny models, the data of every step, the single-process
reference run and a pipeline run of one job description."""
from __future__ import annotations


import numpy as np
import paddle


from autoparallel.data import ByteTextDataset  # noqa: E402
from autoparallel.strategy import Strategy  # noqa: E402
from autoparallel.testing.models import fit, parameters_np  # noqa: E402

STEPS, BATCH, SEQ, LR = 6, 8, 16, 3e-3
_DATA = {}


def build(kind: str = "gpt", tie: bool = False, layers: int = 4, seed: int = 0):
    """Tiny GPT or LLaMA over the byte vocabulary (hidden 32), built after ``paddle.seed(seed)``."""
    from examples.models import GPT, GPTConfig, Llama, LlamaConfig

    paddle.seed(seed)
    if kind == "gpt":
        return GPT(GPTConfig(vocab_size=256, hidden=32, layers=layers, heads=4, max_positions=SEQ,
                             tie_embeddings=tie))
    return Llama(LlamaConfig(vocab_size=256, hidden=32, layers=layers, heads=4, kv_heads=2, intermediate=64,
                             max_positions=SEQ, tie_embeddings=tie))


def batches(steps: int = STEPS, batch: int = BATCH):
    """(ids, labels) numpy int64 [batch, SEQ] for every step: consecutive windows of Python's own sources."""
    key = (steps, batch)
    if key not in _DATA:
        ds = ByteTextDataset(SEQ)
        out = []
        for s in range(steps):
            items = [ds[s * batch + j] for j in range(batch)]
            out.append((np.stack([i[0] for i in items]), np.stack([i[1] for i in items])))
        _DATA[key] = out
    return _DATA[key]


def reference(kind: str = "gpt", tie: bool = False, layers: int = 4, steps: int = STEPS, clip=None, amp=None):
    """Single process, whole batch per step (``clip``: ClipGradByGlobalNorm(clip); ``amp``: float16 under the
    emulated autocast, ``paddle.amp.auto_cast`` and a GradScaler(AMP_SCALE), with SGD): (losses, {name: final
    parameter})."""
    model = build(kind, tie, layers)
    opt = optimizer(model.parameters(), clip, sgd=amp is not None)
    if amp is None:
        return fit(model, opt, batches(steps)), parameters_np(model)
    import paddle.nn.functional as F

    from autoparallel.parallel.amp import apply_amp
    from autoparallel.testing.gpu_scaler import gpu_grad_scaler

    if amp != "float16":
        raise ValueError(f"the AMP reference runs float16 with a GradScaler, got amp={amp!r}")
    apply_amp(model, amp)
    scaler, losses = gpu_grad_scaler(init_loss_scaling=AMP_SCALE), []
    for x, y in batches(steps):
        with paddle.amp.auto_cast(dtype=amp):
            loss = F.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, parameters_np(model)


AMP_SCALE, SGD_LR = 1024.0, 0.5


def optimizer(params, clip=None, sgd=False):
    """AdamW (SGD for AMP: AdamW turns the rounding noise of an exactly-zero gradient into full steps)."""
    grad_clip = paddle.nn.ClipGradByGlobalNorm(clip) if clip else None
    if sgd:
        return paddle.optimizer.SGD(SGD_LR, parameters=params, grad_clip=grad_clip)
    return paddle.optimizer.AdamW(LR, parameters=params, grad_clip=grad_clip)


def strategy(job: dict) -> Strategy:
    s = Strategy()
    s.pipeline_parallel.degree = job.get("pp", 2)
    s.pipeline_parallel.micro_batches = job.get("mb", 4)
    s.pipeline_parallel.schedule = job["schedule"]
    s.pipeline_parallel.vpp_degree = job.get("vpp", 1)
    if job.get("split_points"):
        s.pipeline_parallel.split_points = job["split_points"]
    s.data_parallel.degree = job.get("dp", 1)
    s.tensor_parallel.degree = job.get("tp", 1)
    if job.get("rc"):
        s.recompute.enable, s.recompute.granularity = True, job["rc"]
    if job.get("amp"):
        s.amp.enable, s.amp.dtype = True, job["amp"]
        if job["amp"] == "float16":
            s.amp.init_loss_scaling = AMP_SCALE
    return s


def run_pipeline(job: dict, steps: int = STEPS):
    """Train one job through apply_pp: (losses, pipe)."""
    from autoparallel.parallel.pipeline.runtime import apply_pp
    from autoparallel.testing.models import tp_plan

    kind = job.get("kind", "gpt")
    model = build(kind, job.get("tie", False), job.get("layers", 4))
    opt = optimizer(model.parameters(), job.get("clip"), sgd=bool(job.get("amp")))
    plan = tp_plan(kind) if job.get("tp", 1) > 1 else None
    if plan and job.get("sp"):
        plan = sequence_parallel(plan, model)
    pipe = apply_pp(model, strategy(job), tp_plan=plan)
    opt = pipe.wrap_optimizer(opt)
    losses = []
    for x, y in batches(steps):
        losses.append(pipe.train_batch(x, y))
        opt.step()
        opt.clear_grad()
    return losses, pipe


def sequence_parallel(plan: dict, model) -> dict:
    """The tensor-parallel plan with sequence parallelism: row-parallel and vocab-parallel outputs on
    sequence shards, every norm layer on sequence shards."""
    import dataclasses

    from autoparallel.parallel.tensor_parallel import RowWiseParallel, SequenceParallel, VocabParallelEmbedding

    out = {k: dataclasses.replace(v, sequence_parallel=True) if isinstance(v, (RowWiseParallel, VocabParallelEmbedding))
           else v for k, v in plan.items()}
    for name, layer in model.named_sublayers():
        if type(layer).__name__.endswith("Norm"):
            out[name] = SequenceParallel()
    return out
