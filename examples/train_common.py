"""The training loop shared by train_gpt.py and train_llama.py.

One process (no launcher) trains the plain paddle model: the single-process reference. Under
``python -m paddle.distributed.launch`` the same script calls ``ap.parallelize`` with the strategy from
the flags and feeds it ``DistributedDataLoader`` batches: the three lines that change.
The model is a byte-level language model over the Python standard library's own source files.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import autoparallel as ap  # noqa: E402
from autoparallel import layer_state  # noqa: E402
from autoparallel.checkpoint.errors import CheckpointOwnershipError, CheckpointRootError  # noqa: E402
from autoparallel.data import ByteTextDataset, DistributedDataLoader  # noqa: E402
from autoparallel.memory import live_bytes, peak_rss_bytes, rss_bytes  # noqa: E402
from autoparallel.parallel.recompute import SavedBytes  # noqa: E402
from autoparallel.strategy import Strategy  # noqa: E402
from autoparallel.watchdog import set_current_op, start_default  # noqa: E402
from models import PRESETS, build  # noqa: E402
from train_args import SAVE_EVERY, check_args, make_parser  # noqa: E402  (the examples' flags)


class NoCheckpointToResume(FileNotFoundError):
    """``--resume`` on a checkpoint root that holds no complete checkpoint."""


# refused before the first step because of what the user pointed the run at: exit 2 with one line
REFUSED = (CheckpointOwnershipError, CheckpointRootError, NoCheckpointToResume)


def model_config(name: str, seq_len: int, vocab: int):
    """The preset resized to the byte vocabulary and the sequence length; dropout off."""
    c = PRESETS[name]
    c = dataclasses.replace(c, vocab_size=vocab, max_positions=max(seq_len, c.max_positions))
    return dataclasses.replace(c, dropout=0.0) if hasattr(c, "dropout") else c


def init_distributed(watchdog: bool = True) -> int:
    """Initialise a launched rank and start its watchdog (``watchdog=False``: none, as AP_WATCHDOG=off)."""
    if not watchdog:
        os.environ["AP_WATCHDOG"] = "off"     # parallelize and the checkpoint rendezvous start none either
    if int(os.environ.get("PADDLE_TRAINERS_NUM", "1")) > 1 and not dist.is_initialized():
        dist.init_parallel_env()
    if watchdog:
        start_default()
    return dist.get_world_size() if dist.is_initialized() else 1


def train(args):
    """Run the training; returns (log dict, model, optimizer)."""
    world = init_distributed(getattr(args, "watchdog", True))
    rank = dist.get_rank() if world > 1 else 0
    strategy = Strategy.from_args(args)
    k = strategy.gradient_accumulation_steps
    paddle.seed(args.seed)
    np.random.seed(args.seed)
    rss_start = rss_bytes()                      # before the model exists: the baseline of the RSS change
    dataset = ByteTextDataset(args.seq_len)
    model = build(model_config(args.model, args.seq_len, dataset.vocab_size))
    opt = paddle.optimizer.AdamW(learning_rate=args.lr, parameters=model.parameters())
    pipelined = strategy.pipeline_parallel.degree > 1
    if getattr(args, "static", False):
        return _train_static(args, world, rank, strategy, dataset, model, opt, k)
    strategy.global_batch_size = args.batch_size      # (ap.to_static takes the batch from its loader)
    if world > 1 or _non_trivial(strategy):
        auto = {"seq_len": args.seq_len} if strategy.auto_mode == "full" else {}
        model, opt = ap.parallelize(model, opt, strategy=strategy, **auto)
        if strategy.auto_mode == "full":         # --auto: train with the strategy the planner chose
            strategy = layer_state.chosen_strategy(model)
            k, pipelined = strategy.gradient_accumulation_steps, strategy.pipeline_parallel.degree > 1
        mesh = None if pipelined else layer_state.mesh_of(model)     # the pipeline takes the plain global batch
        loss_scale = 1.0                         # the optimizer divides accumulated gradients by k
    else:
        mesh, loss_scale = None, 1.0 / k
    if pipelined:
        k = 1                                    # micro-batching happens inside the pipeline schedule
    loader = DistributedDataLoader(dataset, args.batch_size, mesh=mesh, num_micro_batches=k, seed=args.seed)
    batches = loader.batches()
    steps, memory, saved = [], None, 0
    ckpt, state, start = _checkpointing(args, model, opt, pipelined)
    for _ in range(start * k):                   # the data-loader position: the batches already trained on
        next(batches)
    bar = _progress(args.steps, rank, start)
    for step in bar:
        prof = ap.profile().start() if args.profile and step == args.steps - 1 else None     # --profile
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(k):
            x, y = next(batches)
            if pipelined:
                set_current_op("pipeline train_batch", step)
                total += float(model.train_batch(x, y))
                continue
            last = step == args.steps - 1        # the last step's forwards count their saved activations
            set_current_op("forward", step)      # named by the watchdog if a peer is lost meanwhile
            with SavedBytes() if last else contextlib.nullcontext() as counter:
                loss = F.cross_entropy(model(x), y)
            saved = max(saved, counter.bytes) if last else saved
            scaled = loss * loss_scale if loss_scale != 1.0 else loss
            set_current_op("backward", step)
            (opt.scale(scaled) if hasattr(opt, "scale") else scaled).backward()     # AMP loss scaling
            total += float(loss) / k
        set_current_op("optimizer step", step)
        opt.step()
        if step == args.steps - 1:
            memory = dict(memory_bytes(model, opt), saved_activations=saved, rss_start=rss_start)
        opt.clear_grad()
        dt = time.perf_counter() - t0
        if prof is not None:
            _report_profile(prof.stop(), args.profile, rank)
        steps.append({"step": step, "loss": total, "time": dt})
        set_current_op(None)
        if ckpt is not None:
            ckpt.maybe_save(state, step + 1, extra={"loader_batches": (step + 1) * k})
            if ckpt.should_stop():               # SIGTERM (preemption): a final checkpoint, then stop
                ckpt.save(state, step + 1, extra={"loader_batches": (step + 1) * k, "stopped": True})
                break
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{total:.4f}")
    if memory is None:                           # resumed at or past --steps: nothing trained here
        memory = dict(memory_bytes(model, opt), saved_activations=saved, rss_start=rss_start)
    log = {"model": args.model, "world_size": world, "strategy": strategy.to_dict(),
           "mesh": None if mesh is None else {"shape": mesh.shape, "dim_names": mesh.dim_names,
                                              "ranks": mesh.mesh.tolist()},
           "global_batch_size": args.batch_size, "seq_len": args.seq_len, "steps": steps,
           "memory_per_rank": gather_memory(memory, world)}
    if args.log_json and rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.log_json)), exist_ok=True)
        with open(args.log_json, "w") as f:
            json.dump(log, f, indent=1)
    return log, model, opt


def _train_static(args, world, rank, strategy, dataset, model, opt, k):
    """--static: trace once, complete the layouts over the whole graph, run them pinned."""
    dm = ap.to_static(model, None, F.cross_entropy, opt, strategy=strategy,
                      input_spec=[([args.batch_size // k, args.seq_len], "int64")] * 2)
    loader = DistributedDataLoader(dataset, args.batch_size, mesh=dm.mesh, num_micro_batches=k, seed=args.seed)
    batches = loader.batches()
    steps = []
    for step in _progress(args.steps, rank):
        prof = ap.profile().start() if args.profile and step == args.steps - 1 else None     # --profile
        t0 = time.perf_counter()
        loss = dm.train_step([next(batches) for _ in range(k)])
        if prof is not None:
            _report_profile(prof.stop(), args.profile, rank)
        steps.append({"step": step, "loss": float(loss), "time": time.perf_counter() - t0})
    log = {"model": args.model, "world_size": world, "strategy": strategy.to_dict(), "static": True,
           "global_batch_size": args.batch_size, "seq_len": args.seq_len, "steps": steps}
    if args.log_json and rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.log_json)), exist_ok=True)
        with open(args.log_json, "w") as f:
            json.dump(log, f, indent=1)
    return log, dm, opt


def _report_profile(prof, path: str, rank: int) -> None:
    """--profile: rank 0 prints the table and writes the plot (and the numbers beside it as JSON)."""
    if rank != 0:
        return
    print(prof.table())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    prof.plot(path)
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(prof.to_dict(), f, indent=1)
    print(f"profile of the last step written to {path}")


def _non_trivial(s: Strategy) -> bool:
    return (s.data_parallel.degree or 1) > 1 or s.tensor_parallel.degree > 1 or s.pipeline_parallel.degree > 1 \
        or s.sequence_parallel.enable or s.sharding.enable or s.recompute.enable or s.amp.enable \
        or s.auto_mode == "full"


def _checkpointing(args, model, opt, pipelined):
    """(manager, state, first step): distributed checkpoints of the model and the optimizer states, saved
    every --save-every steps; with --resume training continues after the newest complete one. The state
    has the same names under every strategy (ZeRO chunks and pipeline stages included), so a checkpoint
    of one strategy resumes under another."""
    if not args.ckpt_dir:
        if args.resume:
            raise ValueError("--resume needs --ckpt-dir (where the checkpoints are)")
        return None, None, 0
    from autoparallel.checkpoint.manager import CheckpointManager
    from autoparallel.checkpoint.state import training_state

    ckpt = CheckpointManager(args.ckpt_dir, args.save_every or SAVE_EVERY, optimizer=opt)  # + generators, scale, LR
    ckpt.install_sigterm_handler()
    state = training_state(model, opt)           # a PipelineModule or a ZeRO optimizer names its own state
    # before the first step: the root is writable with room for one checkpoint, and is this run's (another
    # run's checkpoints there are refused without --resume); --resume loads the newest, which 'latest' names
    info = ckpt.start(state, resume=args.resume)
    start = 0
    if args.resume:
        if info is None:
            raise NoCheckpointToResume(f"--resume: no complete checkpoint under {ckpt.dir}")
        start = int(info.step)
    return ckpt, state, start


def _progress(steps: int, rank: int, start: int = 0):
    if rank != 0:
        return range(start, steps)
    try:
        from tqdm import tqdm
    except ImportError:
        return range(start, steps)
    return tqdm(range(start, steps), desc="train", dynamic_ncols=True, initial=start, total=steps)


def memory_bytes(model, opt) -> dict:
    """Bytes this rank holds, counted from live local tensors (no allocator statistics on CPU), with the
    process's peak and current resident set sizes."""
    rss = {"peak_rss": peak_rss_bytes(), "rss": rss_bytes()}
    if hasattr(opt, "memory_bytes"):                     # ZeRO counts its own chunks
        return dict(opt.memory_bytes(), **rss)
    inner = getattr(opt, "_inner", opt)
    params = list(model.parameters())
    states = [t for acc in inner._accumulators.values() for t in acc.values()]
    states += list(getattr(inner, "_master_weights", {}).values())
    return {"params": live_bytes(params), "grads": live_bytes([p.grad for p in params]),
            "optimizer_states": live_bytes(states), **rss}


def gather_memory(mine: dict, world: int) -> list:
    keys = ("params", "grads", "optimizer_states", "saved_activations", "peak_rss", "rss", "rss_start")
    if world == 1:
        return [dict(rank=0, **mine)]
    local = paddle.to_tensor([mine[k] for k in keys], dtype="int64")
    parts = []
    dist.all_gather(parts, local)
    return [dict(rank=r, **dict(zip(keys, map(int, t.numpy())))) for r, t in enumerate(parts)]


def main(default_model: str, argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--"]:          # the separator that keeps paddle's launcher from reading our flags
        argv = argv[1:]
    parser = make_parser(default_model)
    args = parser.parse_args(argv)
    check_args(parser, args, init_distributed(args.watchdog))
    try:
        log, _, _ = train(args)
    except REFUSED as e:            # the user's checkpoint root or flags: a short message, no traceback
        parser.exit(2, f"{parser.prog}: error: {type(e).__name__}: {e}\n")
    if log["world_size"] == 1 or dist.get_rank() == 0:
        last = log["steps"][-1]
        print(f"{args.model}: {len(log['steps'])} steps, final loss {last['loss']:.4f}, "
              f"median step {np.median([s['time'] for s in log['steps']]) * 1e3:.0f} ms")
    return log
