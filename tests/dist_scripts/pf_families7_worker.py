"""Every rank of 4 (gloo): PaddleFormers family options and a classification head under ``ap.parallelize``
(dp2 x tp2 with sequence parallel and ZeRO) for 2 AdamW steps; each rank trains the one-process reference itself
and reports the comparison (``fuzz_runs.compare``: "" when losses and every state entry match)."""
import sys

import numpy as np
import paddle
import paddle.distributed as dist

import autoparallel as ap
from autoparallel.testing import fuzz_runs
from autoparallel.testing import pf_fuzz as z
from autoparallel.testing.launch import write_result

sys.path.insert(0, __file__.rsplit("/dist_scripts/", 1)[0])
import test_probe_pf_families7 as t  # noqa: E402

CASES = [("gemma3", dict(final_logit_softcapping=5.0, attn_logit_softcapping=3.0), {}, t.SP_ZERO3),
         ("phi3", dict(rope_scaling=t.LONGROPE, original_max_position_embeddings=4), dict(kv_heads=1), t.TP_ZERO1)]


def family_case(family, options, dims, sspec):
    cfg = t.config(family, options, **dims)
    ref = z.reference(cfg)
    model = z.build(cfg)
    model, opt = ap.parallelize(model, z._optimizer(model.parameters()), strategy=z.make_strategy(sspec, cfg))
    losses = z.train(model, opt, cfg)
    state = {k: np.asarray(v.numpy()) for k, v in ap.full_state_dict(model).items()}
    return {"case": family, "diff": fuzz_runs.compare(ref, (losses, state)), "losses": losses}


def head_case():
    cls = "Qwen2ForSequenceClassification"
    ref = t._train_head(cls, "class", True, None)
    got = t._train_head(cls, "class", True, "sp-zero3")
    return {"case": cls, "diff": fuzz_runs.compare(ref, got), "losses": got[0]}


def main():
    dist.init_parallel_env()
    paddle.set_device("cpu")
    out = [family_case(*c) for c in CASES] + [head_case()]
    write_result(out)


if __name__ == "__main__":
    main()
