"""Runs on every rank of a 2-rank launch: a PaddleFormers Llama (3 layers) on two pipeline stages driven with
model keyword inputs (an attention mask), labels with -100 and eval_batch (loss, then logits), then two train
steps; then two optimizer steps of the one-process loop on the pipeline called like the model
(``(model(**inputs, labels=labels, return_dict=True).loss / 2).backward()`` on two batches per step); reports
what each rank got (test_probe_pipeline_dist.py compares it with one process). Last, a GPT whose embedding and
LM head are tied across the two ranks, two batches per optimizer step: through train_batch and called like the
model.

    pp_forms_worker.py OUT_DIR
"""
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist

import autoparallel as ap
from autoparallel.parallel.pipeline.runtime import apply_pp
from autoparallel.testing import paddleformers_models as pf
from autoparallel.testing.launch import write_result


def batch(i):
    rng = np.random.default_rng(i)
    ids, labels = rng.integers(0, 128, (4, 8)), rng.integers(0, 128, (4, 8))
    mask = np.ones((4, 8), "int64")
    mask[0, 5:] = 0
    labels[0, :] = -100
    labels[1, :6] = -100
    return {"input_ids": paddle.to_tensor(ids), "attention_mask": paddle.to_tensor(mask)}, labels


def tied_accumulation(out_dir, rank):
    """Two batches per optimizer step on a tied GPT (the tied gradient is all-reduced in every step): each rank's
    final parameters for train_batch and for the call form."""
    import pp_common

    losses = {}
    for mode in ("train_batch", "call"):
        model = pp_common.build("gpt", tie=True)
        pipe = apply_pp(model, pp_common.strategy({"schedule": "1F1B"}))
        opt = pipe.wrap_optimizer(paddle.optimizer.SGD(0.5, parameters=model.parameters()))
        losses[mode] = []
        for i, (x, y) in enumerate(pp_common.batches(4)):
            if mode == "train_batch":
                losses[mode].append(pipe.train_batch(x, y))
            else:
                loss = pipe(paddle.to_tensor(x), labels=paddle.to_tensor(y))
                loss.backward()
                losses[mode].append(float(loss))
            if i % 2:
                opt.step()
                opt.clear_grad()
        np.savez(os.path.join(out_dir, f"tied_{mode}.rank{rank}.npz"),
                 **{n: p.numpy() for n, p in pipe.named_parameters()})
    return losses


def main():
    out_dir = sys.argv[1]
    dist.init_parallel_env()
    model = pf.build("llama", num_hidden_layers=3)
    s = ap.Strategy()
    s.pipeline_parallel.degree, s.pipeline_parallel.micro_batches = 2, 2
    pipe = apply_pp(model, s)
    opt = pipe.wrap_optimizer(paddle.optimizer.SGD(0.5, parameters=model.parameters()))
    pipe.eval()
    eval_loss = pipe.eval_batch(*batch(9))
    logits = pipe.eval_batch(batch(9)[0])
    pipe.train()
    grads_after_eval = sum(p.grad is not None for p in pipe.parameters())
    losses = []
    for i in range(2):
        losses.append(pipe.train_batch(*batch(i)))
        opt.step()
        opt.clear_grad()
    params = {n: p.numpy() for n, p in pipe.named_parameters()}
    np.savez(os.path.join(out_dir, f"forms.rank{dist.get_rank()}.npz"), **params)
    called = []
    for i in range(2, 6):                                   # called like the model, accumulation 2
        inputs, labels = batch(i)
        out = pipe(**inputs, labels=paddle.to_tensor(labels), return_dict=True)
        (out.loss / 2).backward()
        called.append(float(out.loss))
        if i % 2 == 1:
            opt.step()
            opt.clear_grad()
    params = {n: p.numpy() for n, p in pipe.named_parameters()}
    np.savez(os.path.join(out_dir, f"called.rank{dist.get_rank()}.npz"), **params)
    tied = tied_accumulation(out_dir, dist.get_rank())
    write_result({"rank": dist.get_rank(), "eval_loss": eval_loss, "losses": losses, "called_losses": called,
                  "tied_losses": tied,
                  "logits": None if logits is None else logits.numpy().tolist(), "grads_after_eval": grads_after_eval})


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
