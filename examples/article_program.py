"""The article's whole training program, as a user writes it: one PaddleFormers LLaMA, one plain loop.

    python examples/article_program.py --steps 6 --log-json out/one.json                 # one process
    python -m paddle.distributed.launch --nproc_per_node 4 examples/article_program.py \\
        --pp 2 --tp 2 --sp --accum 2 --recompute --amp bf16 --steps 6 --log-json out/pp2tp2.json
    python tools/compare_logs.py out/one.json out/pp2tp2.json                              # every step's loss

What each piece is, in the article's order: the hybrid strategy (snippet 4: data, tensor and pipeline degrees,
sequence parallel), a PaddleFormers ``LlamaForCausalLM`` and the plain loop ``loss = model(**batch).loss;
loss.backward(); optimizer.step(); optimizer.clear_grad()`` (snippet 8), accumulation by ``loss / accum_steps``
(snippet 13), ``paddle.amp.auto_cast`` with a ``GradScaler`` (snippet 15), ``recompute_layers`` (snippet 6),
automatic checkpoints with ``resume_from_last_checkpoint()`` after a kill (snippet 11) and the
``PerformanceMonitor`` records with ``is_imbalanced()`` / ``suggest_optimal_strategy()`` /
``reconfigure_distributed_model`` (snippet 10). The same script runs on one process (the reference) and on
launched ranks; every rank feeds the same global batch (the parallelized model takes its own part of it).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import numpy as np
import paddle

import autoparallel as dist

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 128, 64, 128, 4, 4, 2


class Killed(RuntimeError):
    """``--kill-after``: the run stops dead after that optimizer step (a lost node); ``__main__`` exits hard."""


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="the article's training program on a tiny PaddleFormers LLaMA")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--sp", action="store_true", help="sequence parallel (inside the tensor-parallel group)")
    p.add_argument("--micro-batches", dest="micro_batches", type=int, default=None,
                   help="pipeline micro-batches per call (default: the pipeline degree)")
    p.add_argument("--accum", type=int, default=1, help="batches per optimizer step (loss / accum_steps)")
    p.add_argument("--recompute", action="store_true", help="recompute_layers over the decoder layers, 2 a segment")
    p.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none",
                   help="paddle.amp.auto_cast around the forward (fp16 with a GradScaler)")
    p.add_argument("--tied", action="store_true", help="tie the output head to the embedding")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=8, help="global batch (samples)")
    p.add_argument("--seq-len", dest="seq_len", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ckpt-dir", dest="ckpt_dir", default=None, help="strategy.checkpoint: save here")
    p.add_argument("--save-every", dest="save_every", type=int, default=2, help="save_interval_steps")
    p.add_argument("--resume", action="store_true", help="resume_from_last_checkpoint() before training")
    p.add_argument("--kill-after", dest="kill_after", type=int, default=None, help="die after this step")
    p.add_argument("--monitor", action="store_true", help="PerformanceMonitor records; re-plan when imbalanced")
    p.add_argument("--imbalance-threshold", dest="threshold", type=float, default=0.2,
                   help="monitor.is_imbalanced(threshold): 0 re-plans whenever the ranks' times differ at all")
    p.add_argument("--log-json", dest="log_json", default=None, help="write every step's loss here (rank 0)")
    return p


def check_args(p: argparse.ArgumentParser, args, world: int) -> None:
    """Refuse, naming the flag, what this run cannot honour, before any work."""
    if args.dp * args.tp * args.pp != world:
        p.error(f"--dp {args.dp} x --tp {args.tp} x --pp {args.pp} must equal the {world} ranks of this run")
    if args.sp and args.tp == 1:
        p.error("--sp needs --tp > 1: sequence parallel splits the sequence inside the tensor-parallel group")
    if args.micro_batches is not None and args.pp == 1:
        p.error(f"--micro-batches {args.micro_batches} needs --pp > 1 (use --accum for accumulation)")
    for flag in ("accum", "steps", "batch_size", "seq_len", "save_every"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    if (args.resume or args.kill_after is not None) and not args.ckpt_dir:
        p.error("--resume and --kill-after need --ckpt-dir (where the checkpoints are)")


def build_model(args):
    """A 4-layer PaddleFormers LLaMA; fuse_rms_norm=False (the fused kernel is GPU-only)."""
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                      fuse_rms_norm=False, tie_word_embeddings=args.tied)
    paddle.seed(args.seed)
    return LlamaForCausalLM(cfg)


def dataloader(args, start: int = 0):
    """Deterministic synthetic batches: batch ``i`` depends on (seed, i) only, the same on every rank."""
    i = start
    while True:
        rng = np.random.default_rng([args.seed, i])
        ids = rng.integers(0, VOCAB, (args.batch_size, args.seq_len)).astype("int64")
        yield {"input_ids": paddle.to_tensor(ids), "labels": paddle.to_tensor(np.roll(ids, -1, axis=1)),
               "return_dict": True}
        i += 1


def make_strategy(args):
    strategy = dist.Strategy()                                   # snippet 4
    strategy.data_parallel.degree = args.dp
    strategy.tensor_parallel.degree = args.tp
    strategy.pipeline_parallel.degree = args.pp
    strategy.sequence_parallel.enable = args.sp
    if args.pp > 1:
        strategy.pipeline_parallel.micro_batches = args.micro_batches or args.pp
    if args.ckpt_dir:                                            # snippet 11
        strategy.checkpoint.enable = True
        strategy.checkpoint.save_interval_steps = args.save_every
        strategy.checkpoint.dir = args.ckpt_dir
    return strategy


def is_decoder_layer(layer) -> bool:
    return type(layer).__name__ == "LlamaDecoderLayer"


def train(args) -> dict:
    """Run the program; returns {"world_size", "steps": [{"step", "loss"}], "reconfigured"}."""
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    if world > 1:
        dist.init_parallel_env()
    rank = paddle.distributed.get_rank() if world > 1 else 0
    model = build_model(args)
    if args.recompute:                                           # snippet 6
        model = dist.recompute_layers(model, segment_func=is_decoder_layer, checkpoint_every_n_layers=2)
    optimizer = paddle.optimizer.AdamW(learning_rate=args.lr, parameters=model.parameters())
    model, optimizer = dist.parallelize(model, optimizer, strategy=make_strategy(args))
    start = 0
    if args.resume:                                              # snippet 11, after the kill
        info = dist.resume_from_last_checkpoint()
        if info is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {args.ckpt_dir}")
        start = int(info.step)
    scaler = paddle.amp.GradScaler(init_loss_scaling=1024) if args.amp == "fp16" else None   # snippet 15
    cast = {"bf16": dict(dtype="bfloat16"), "fp16": dict(dtype="float16")}.get(args.amp)
    monitor = dist.PerformanceMonitor(warmup_steps=1, measure_steps=2) if args.monitor else None   # snippet 10
    record = monitor.record if monitor else (lambda name: contextlib.nullcontext())
    accum_steps = args.accum
    batches = dataloader(args, start * accum_steps)
    steps, reconfigured = [], None
    for step in range(start, args.steps):
        total = 0.0
        for _ in range(accum_steps):                             # snippet 13
            batch = next(batches)
            with record("forward"), (paddle.amp.auto_cast(**cast) if cast else contextlib.nullcontext()):
                loss = model(**batch).loss / accum_steps
            with record("backward"):
                (scaler.scale(loss) if scaler else loss).backward()
            total += float(loss)
        with record("step"):
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.clear_grad()
        if monitor:
            monitor.step()
            if monitor.done and reconfigured is None:
                reconfigured = _maybe_reconfigure(monitor, model, args.threshold)
        steps.append({"step": step, "loss": total})
        if rank == 0:
            print(f"step {step}: loss {total:.6f}", flush=True)
        if args.kill_after is not None and step + 1 == args.kill_after:
            raise Killed(f"killed after step {step + 1}")
    log = {"world_size": world, "args": vars(args), "steps": steps, "reconfigured": reconfigured}
    if args.log_json and rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.log_json)), exist_ok=True)
        with open(args.log_json, "w") as f:
            json.dump(log, f, indent=1)
    return log


def _maybe_reconfigure(monitor, model, threshold):
    """Snippet 10: every rank asks (collective); an imbalanced run is re-planned in place. Returns the new
    strategy's degrees, or False."""
    if not monitor.is_imbalanced(threshold=threshold):
        return False
    new_strategy = monitor.suggest_optimal_strategy()
    dist.reconfigure_distributed_model(model, new_strategy)
    return {k: getattr(new_strategy, k).degree for k in ("data_parallel", "tensor_parallel", "pipeline_parallel")}


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = make_parser()
    args = parser.parse_args(argv[1:] if argv[:1] == ["--"] else argv)
    check_args(parser, args, int(os.environ.get("PADDLE_TRAINERS_NUM", "1")))
    return train(args)


if __name__ == "__main__":
    try:
        main()
    except Killed as e:
        print(e, flush=True)
        os._exit(137)                                            # no clean-up: as a lost node
