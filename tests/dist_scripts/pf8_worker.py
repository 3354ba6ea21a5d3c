"""Every rank of 2 (gloo): PaddleFormers forms never run on real ranks before, each against the one-process run
every rank makes itself. DPO with PaddleFormers' criterion (a frozen reference model; ``paddle.gather`` with a
0-d index) under DP 2 and under TP 2 with sequence parallelism; GPT-OSS (attention sinks, a sliding-window layer,
MoE) greedy ``generate()`` with its cache under TP 2 with sequence parallelism."""
import sys

import numpy as np
import paddle
import paddle.distributed as dist

import autoparallel as ap
from autoparallel.testing import paddleformers_models as pf
from autoparallel.testing import paddleformers_runs as pr
from autoparallel.testing.launch import write_result

sys.path.insert(0, __file__.rsplit("/dist_scripts/", 1)[0])
import test_probe_pf8 as t  # noqa: E402

GPT_OSS = dict(hidden_size=32, intermediate_size=48, layer_types=["sliding_attention", "full_attention"],
               sliding_window=3)
REF = []


def dpo_case(dp, tp, sp):
    if not REF:
        REF.append(t.train_dpo(steps=2))
    ref = REF[0]
    got = t.train_dpo(pr.strategy(dp, tp, sp), steps=2)
    bad = [] if np.allclose(got[0], ref[0], rtol=1e-5, atol=1e-5) else ["losses"]
    bad += [n for n, g in ref[1].items() if not np.allclose(got[1][n], g, rtol=1e-4, atol=1e-5)]
    bad += [n for n, v in ref[2].items() if not np.allclose(got[2][n], v, rtol=1e-4, atol=1e-5)]
    return {"case": f"dpo dp{dp} tp{tp}", "bad": bad, "losses": got[0][:, 0].tolist()}


def generate(model):
    model.eval()
    ids = np.random.default_rng(3).integers(3, 60, (2, 5)).astype("int64")
    out = model.generate(input_ids=paddle.to_tensor(ids), max_new_tokens=3, use_cache=True,
                         decode_strategy="greedy_search")
    out = out[0] if isinstance(out, (tuple, list)) else out
    return np.asarray(out.full().numpy() if hasattr(out, "full") else out.numpy()).tolist()


def generate_case(family, overrides):
    def tokens(distributed):
        model = pf.build(family, 0, fill_zeros=True, **overrides)
        if distributed:
            model, _ = ap.parallelize(model, None, strategy=pr.strategy(1, 2, True))
        return generate(model)

    return {"case": family, "tokens": tokens(True), "ref_tokens": tokens(False)}


def main():
    dist.init_parallel_env()
    paddle.set_device("cpu")
    write_result([dpo_case(2, 1, False), dpo_case(1, 2, True), generate_case("gpt_oss", GPT_OSS)])


if __name__ == "__main__":
    main()
