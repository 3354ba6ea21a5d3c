"""Runs on 2 ranks (test_probe_generate6.py): ``generate`` and hand-cached forwards of PaddleFormers models laid
out by ``ap.parallelize``, each rank's result gathered so the test compares every rank with one process.

* ``tp``: llama under TP 2 (a tensor-parallel plan), ``attention_dropout=0.3`` and ``model.eval()``: greedy search
  of 3 left-padded prompts (tokens and scores), beam search of 1 prompt (3 beams, 2 sequences returned), sampling
  with a different seed on each rank and with no seed at all, a forward reusing ``past_key_values`` by hand;
* ``zero3``: qwen3_moe under DP 2 with ZeRO-3: greedy search of 3 prompts (odd: not divisible by the degree),
  top_p sampling with a different seed on each rank (of the 3 prompts, and of 1 prompt: rank 1 holds no sample), the
  hand-cached forward under ``paddle.no_grad``.
Usage: generate6_worker.py
"""
import numpy as np
import paddle
import paddle.distributed as dist

import autoparallel as ap
from autoparallel.testing import paddleformers_models as pf
from autoparallel.testing.launch import write_result

TP_PLAN = {f"model.layers.*.{m}.{p}": ap.ColWiseParallel() for m, p in
           [("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("mlp", "gate_proj"),
            ("mlp", "up_proj")]}
TP_PLAN.update({"model.layers.*.self_attn.o_proj": ap.RowWiseParallel(),
                "model.layers.*.mlp.down_proj": ap.RowWiseParallel()})
LENGTHS = [6, 3, 5]


def prompts(lengths=LENGTHS, t=6):
    ids = np.random.default_rng(3).integers(3, 60, (len(lengths), t)).astype("int64")
    mask = np.ones_like(ids)
    for i, n in enumerate(lengths):          # left padding
        ids[i, :t - n], mask[i, :t - n] = 0, 0
    return ids, mask


def full(t):
    return (t.full() if hasattr(t, "full") else t).numpy()


def generate(model, seed=None, lengths=LENGTHS, **kw):
    ids, mask = prompts(lengths)
    if seed is not None:
        paddle.seed(seed)
    out = model.generate(input_ids=paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask), max_new_tokens=4,
                         use_cache=True, **kw)
    return [full(out[0]).tolist(), full(out[1]).tolist()]


def cached_logits(model):
    """A prefix of 6 left-padded tokens, then 2 single-token forwards handing back ``past_key_values``."""
    ids, mask = prompts(t=8)
    with paddle.no_grad():
        o = model(input_ids=paddle.to_tensor(ids[:, :6]), attention_mask=paddle.to_tensor(mask[:, :6]),
                  use_cache=True, return_dict=True)
        outs = [full(o.logits)]
        for t in (6, 7):
            o = model(input_ids=paddle.to_tensor(ids[:, t:t + 1]), attention_mask=paddle.to_tensor(mask[:, :t + 1]),
                      past_key_values=o.past_key_values, use_cache=True, return_dict=True)
            outs.append(full(o.logits))
    return np.concatenate(outs, 1).tolist()


GREEDY = dict(decode_strategy="greedy_search")
BEAMS = dict(decode_strategy="beam_search", num_beams=3, num_return_sequences=2, lengths=[4])
TOP_K = dict(decode_strategy="sampling", top_k=8, temperature=0.7)
TOP_P = dict(decode_strategy="sampling", top_p=0.8)


def tp_case(rank) -> dict:
    model = pf.build("llama", 0, attention_dropout=0.3)
    s = ap.Strategy()
    s.tensor_parallel.degree = 2
    model, _ = ap.parallelize(model, None, strategy=s, tp_plan=TP_PLAN)
    model.eval()
    return {"greedy": generate(model, **GREEDY), "beams": generate(model, **BEAMS),
            "rank_seeded": generate(model, seed=100 + rank, **TOP_K), "unseeded": generate(model, **TOP_K),
            "cached": cached_logits(model),
            "sharded": any(getattr(p, "_ap_spec", None) is not None and p.shape != p._ap_spec.shape
                           for p in model.parameters())}


def zero3_case(rank) -> dict:
    model = pf.build("qwen3_moe", 0)
    s = ap.Strategy()
    s.data_parallel.degree = 2
    s.sharding.enable, s.sharding.stage = True, 3
    model, _ = ap.parallelize(model, paddle.optimizer.AdamW(1e-3, parameters=model.parameters()), strategy=s)
    model.eval()
    return {"greedy": generate(model, **GREEDY), "rank_seeded": generate(model, seed=100 + rank, **TOP_P),
            "one_prompt": generate(model, seed=100 + rank, lengths=[4], **TOP_P), "cached": cached_logits(model)}


def main():
    dist.init_parallel_env()
    rank = dist.get_rank()
    write_result({"rank": rank, "tp": tp_case(rank), "zero3": zero3_case(rank)})


if __name__ == "__main__":
    main()
