"""2 gloo ranks: the article's snippets that need real processes, each section independent.

* init_parallel_env + the LLaMA custom shard hook with shard_optimizer(opt, mesh) (snippet 8)
* the monitor loop as written, rank 1 slowed down in forward: imbalance found, a Strategy suggested,
  reconfigure_distributed_model in place, training continues equal to one process (snippet 10)
* GradScaler with an inf on rank 1 only: both ranks skip the step (snippet 15)
* loss.backward(use_async_allreduce=True) on gloo (snippet 12)
* strategy.checkpoint saves from the loop, an out-of-memory, fallback_to_cpu_offload + resume (snippet 11)
Every rank also computes the single-process reference itself (same seeds, same global batches)."""
import os
import time
import traceback


import numpy as np                                         # noqa: E402
import paddle                                              # noqa: E402
import paddle.nn.functional as F                           # noqa: E402

import autoparallel as auto_parallel                       # noqa: E402
import autoparallel as dist                                # noqa: E402
from autoparallel.testing.gpu_scaler import gpu_grad_scaler  # noqa: E402
from autoparallel.testing.launch import write_result      # noqa: E402
from autoparallel.testing.models import batch, build      # noqa: E402


def make_optimizer(model):
    return paddle.optimizer.AdamW(1e-2, parameters=model.parameters(), epsilon=1e-4)


def loss_of(model, i):
    ids, lab = batch(i)
    return F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean()


def reference(steps):
    model = build("gpt")
    opt = make_optimizer(model)
    losses = []
    for i in steps:
        loss = loss_of(model, i)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: p.numpy() for n, p in model.named_parameters()}


def full_params(model, optimizer=None):
    from autoparallel.checkpoint.state import wrapper_chain
    from autoparallel.parallel.sharding import ZeroOptimizer

    for o in wrapper_chain(optimizer) if optimizer is not None else []:
        if isinstance(o, ZeroOptimizer):
            o.gather(o.params)
    return {n: (p.full().numpy() if hasattr(p, "full") else p.numpy()) for n, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max()) for k in b)


# ---- snippet 8 ----------------------------------------------------------------------------------------------
def llama_auto_shard_fn(layer_name, layer, process_mesh):
    if any(k in layer_name for k in ["q_proj", "k_proj", "v_proj"]):
        weight_spec = [dist.Shard(1)]      # split by heads
    elif "o_proj" in layer_name:
        weight_spec = [dist.Shard(0)]      # output projection split by hidden
    else:
        weight_spec = [dist.Replicate()]
    if hasattr(layer, 'weight'):
        layer.weight = dist.shard_tensor(layer.weight, process_mesh, weight_spec)
    return layer


class Out:
    def __init__(self, loss):
        self.loss = loss


class LLaMAForCausalLM(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.model = build("llama")

    def forward(self, input_ids, labels):
        return Out(F.cross_entropy(self.model(input_ids), labels).mean())


def llama_section(out):
    from paddle.optimizer import AdamW

    dataloader = [{"input_ids": paddle.to_tensor(x), "labels": paddle.to_tensor(y)} for x, y in map(batch, range(2))]
    ref = LLaMAForCausalLM()
    ref_opt = AdamW(learning_rate=3e-5, parameters=ref.parameters())
    ref_losses = []
    for b in dataloader:
        loss = ref(**b).loss
        loss.backward()
        ref_opt.step()
        ref_opt.clear_grad()
        ref_losses.append(float(loss))
    mesh = dist.ProcessMesh(mesh=[[0], [1]], dim_names=["data", "model"])
    model = LLaMAForCausalLM()
    model = dist.shard_layer(model, mesh, llama_auto_shard_fn)       # apply_sharding(model, mesh, fn)
    optimizer = AdamW(learning_rate=3e-5, parameters=model.parameters())
    optimizer = auto_parallel.shard_optimizer(optimizer, mesh)
    losses = []
    for b in dataloader:
        loss = model(**b).loss
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    out["llama_max_loss_diff"] = float(np.abs(np.array(losses) - np.array(ref_losses)).max())
    out["q_local_shape"] = list(model.model.layers[0].self_attn.q_proj.weight.shape)
    out["llama_max_param_diff"] = max_diff(full_params(model), {n: p.numpy() for n, p in ref.named_parameters()})


# ---- snippet 10 ----------------------------------------------------------------------------------------------
def monitor_section(out, rank):
    from autoparallel import reconfigure_distributed_model

    model = build("gpt")
    optimizer = make_optimizer(model)
    model = auto_parallel.DataParallel(model, strategy=auto_parallel.Strategy())
    optimizer = auto_parallel.Optimizer(optimizer)
    if rank == 1:                                         # a slower device: 100 ms more per forward
        model.register_forward_post_hook(lambda *_: time.sleep(0.1))

    def step_loss(i):
        return loss_of(model, i)

    dataloader = range(34)
    monitor = dist.PerformanceMonitor(warmup_steps=10, measure_steps=20)
    for step, batch_ in enumerate(dataloader):
        with monitor.record("forward"):
            loss = step_loss(batch_)
        with monitor.record("backward"):
            loss.backward()
        with monitor.record("step"):
            optimizer.step()
            optimizer.clear_grad()
        if step == 30 and monitor.is_imbalanced():
            new_strategy = monitor.suggest_optimal_strategy()
            out["imbalanced"] = True
            out["suggested_is_strategy"] = isinstance(new_strategy, auto_parallel.Strategy)
            out["suggested"] = new_strategy.to_dict()
            imb = monitor.imbalance()
            out["slowest_rank"], out["slowest_phase"] = imb.get("slowest_rank"), imb.get("slowest_phase")
            before = full_params(model, optimizer)
            reconfigure_distributed_model(model, new_strategy)
            out["reconfigured"] = max_diff(full_params(model, optimizer), before) == 0.0
    imb = monitor.imbalance()
    out["imbalance"] = {k: imb[k] for k in ("ranks", "rank_steps", "rank_compute", "phases")}
    _, ref = reference(range(34))
    out["after_reconfigure_max_diff"] = max_diff(full_params(model, optimizer), ref)


# ---- snippet 15 ----------------------------------------------------------------------------------------------
def scaler_section(out, rank):
    model = build("gpt")
    initial = {n: p.numpy() for n, p in model.named_parameters()}
    optimizer = make_optimizer(model)
    model = auto_parallel.DataParallel(model, strategy=auto_parallel.Strategy())
    optimizer = auto_parallel.Optimizer(optimizer)
    scaler = gpu_grad_scaler(init_loss_scaling=1024)
    with paddle.amp.auto_cast():
        loss = loss_of(model, 0)
    scaled_loss = scaler.scale(loss)
    scaled_loss.backward()
    if rank == 1:                                         # an overflow on this rank only
        g = dict(model.named_parameters())["lm_head.weight"].grad
        g.set_value(paddle.full_like(g, float("inf")))
    scaler.step(optimizer)
    scaler.update()
    optimizer.clear_grad()
    now = full_params(model)
    out["skipped_on_overflow"] = max_diff(now, initial) == 0.0
    out["scale_after_overflow"] = float(scaler._scale)
    mine = paddle.to_tensor(np.concatenate([v.ravel() for _, v in sorted(now.items())]))
    parts = []
    paddle.distributed.all_gather(parts, mine)
    out["params_identical"] = bool(np.array_equal(parts[0].numpy(), parts[1].numpy()))


# ---- snippet 12 ----------------------------------------------------------------------------------------------
def async_section(out):
    model = build("gpt")
    optimizer = make_optimizer(model)
    model = auto_parallel.DataParallel(model, strategy=auto_parallel.Strategy())
    optimizer = auto_parallel.Optimizer(optimizer)
    for i in range(2):
        loss = loss_of(model, i)
        loss.backward(use_async_allreduce=True)
        optimizer.step()
        optimizer.clear_grad()
    _, ref = reference(range(2))
    out["async_allreduce_max_diff"] = max_diff(full_params(model), ref)


# ---- snippet 11 ----------------------------------------------------------------------------------------------
def checkpoint_section(out):
    from autoparallel import fallback_to_cpu_offload, resume_from_last_checkpoint

    root = os.path.join(os.environ.get("AP_RESULT_DIR", "/tmp"), "..", "article_ckpt")
    strategy = auto_parallel.Strategy()
    strategy.checkpoint.dir = root
    model = build("gpt")
    optimizer = make_optimizer(model)
    strategy.checkpoint.enable = True
    strategy.checkpoint.save_interval_steps = 2
    model = auto_parallel.DataParallel(model, strategy=strategy)
    optimizer = auto_parallel.Optimizer(optimizer)
    failed = []

    def train():
        from autoparallel.auto_checkpoint import current_run

        for i in range(current_run().step, 4):
            loss = loss_of(model, i)
            loss.backward()
            if i == 2 and not failed:
                failed.append(i)
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            optimizer.step()
            optimizer.clear_grad()

    try:
        train()
    except RuntimeError as e:
        if "CUDA out of memory" in str(e):
            fallback_to_cpu_offload(model)
            resume_from_last_checkpoint()
    paddle.distributed.barrier()                          # rank 0 commits and writes "latest" after the others
    out["saved_before_failure"] = sorted(n for n in os.listdir(root) if not n.startswith("."))
    optimizer.clear_grad()
    train()
    paddle.distributed.barrier()
    out["saved"] = sorted(n for n in os.listdir(root) if not n.startswith("."))
    _, ref = reference(range(4))
    out["recovered_max_diff"] = max_diff(full_params(model, optimizer), ref)
    out["offloaded"] = bool(getattr(optimizer, "offload", False))


def main():
    out = {"errors": {}}
    try:
        dist.init_parallel_env()
        out["init_parallel_env"] = True
    except Exception:
        out["errors"]["init_parallel_env"] = traceback.format_exc()
        paddle.distributed.init_parallel_env()
        out["init_parallel_env"] = False
    rank = paddle.distributed.get_rank()
    sections = [("llama", lambda: llama_section(out)), ("monitor", lambda: monitor_section(out, rank)),
                ("scaler", lambda: scaler_section(out, rank)), ("async", lambda: async_section(out)),
                ("checkpoint", lambda: checkpoint_section(out))]
    for name, fn in sections:
        try:
            fn()
        except Exception:
            out["errors"][name] = traceback.format_exc()
        paddle.distributed.barrier()
    write_result(out)


if __name__ == "__main__":
    main()
