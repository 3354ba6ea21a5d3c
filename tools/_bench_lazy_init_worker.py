"""One rank of tools/bench/lazy_init.py: build a GPT eagerly or under paddle.LazyGuard, parallelize it
(TP2 x DP2 + ZeRO-3 with AdamW) and report time, peak RSS and live parameter bytes.

    _bench_lazy_init_worker.py MODE PRESET        (MODE: eager | lazy)
"""
import sys
import time

import paddle
import paddle.distributed as dist


import autoparallel as ap  # noqa: E402
from autoparallel import layer_state  # noqa: E402
from autoparallel.memory import live_bytes, peak_rss_bytes, rss_bytes  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402
from examples.models import build  # noqa: E402


def main():
    mode, preset = sys.argv[1], sys.argv[2]
    dist.init_parallel_env()
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = 2, 2
    s.sharding.enable, s.sharding.stage = True, 3
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    paddle.seed(0)
    model = build(preset, lazy=(mode == "lazy"))
    opt = paddle.optimizer.AdamW(1e-4, parameters=model.parameters())
    t1 = time.perf_counter()
    model, opt = ap.parallelize(model, opt, s)
    t2 = time.perf_counter()
    rank = dist.get_rank()
    masters = [m for m in opt.master[rank].values()]
    report = layer_state.init_report(model)
    largest = max((e.largest for e in report), default=0) if report is not None else None
    write_result({"rank": rank, "build_s": t1 - t0, "parallelize_s": t2 - t1, "rss_before": rss0,
                  "peak_rss": peak_rss_bytes(), "rss_after": rss_bytes(),
                  "param_bytes": live_bytes(list(model.parameters()) + masters),
                  "largest_tensor_elements": largest,
                  "full_copies": None if report is None else len(report.full_copies())})


if __name__ == "__main__":
    paddle.set_device("cpu")
    main()
