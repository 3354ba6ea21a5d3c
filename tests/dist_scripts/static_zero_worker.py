"""Every rank: the training example under ZeRO-2 (DP4), eager vs --static, for GPT and LLaMA: per-step
losses and final parameters (each rank's local values)."""
import os
import sys

import numpy as np
import paddle.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

import train_common  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402


def run(model, static):
    argv = ["--dp", "4", "--sharding-stage", "2", "--steps", "6", "--seed", "0", "--model", model]
    args = train_common.make_parser(model).parse_args(argv + (["--static"] if static else []))
    log, net, _ = train_common.train(args)
    net = getattr(net, "network", net)
    params = {n: np.asarray(p.numpy(), dtype=np.float64).ravel()[:64].tolist() for n, p in net.named_parameters()}
    return [s["loss"] for s in log["steps"]], params


def main():
    dist.init_parallel_env()
    out = {}
    for model in ("gpt-tiny", "llama-tiny"):
        out[model] = {"eager": run(model, False), "static": run(model, True)}
    write_result(out)


if __name__ == "__main__":
    main()
