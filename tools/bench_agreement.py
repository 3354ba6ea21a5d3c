"""Cost of the rank-divergence guards on this machine (2 gloo ranks): the collective agreement check per call
(comm/agreement.py) and a data-parallel step with and without settling one-element Partial results
(read_value.py) and the check.

    python -m tools.bench_agreement [--repeat 300] [--steps 20]      (from the repository root)
"""
import argparse
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from autoparallel.testing.launch import run_job  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=300)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hot-path-only", action="store_true", help="only the in-process cost of the collective log")
    args = ap.parse_args()
    hot_path()
    if args.hot_path_only:
        return
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])), "AP_WATCHDOG": "off"}
    job = run_job(os.path.join(ROOT, "tools", "_bench_agreement_worker.py"), 2, [args.repeat, args.steps],
                  timeout=900, env=env)
    if not job.results or not job.results[0]:
        raise SystemExit(f"the benchmark ranks failed:\n{job.failure()}")
    res = job.results[0]
    print("| all_reduce of | check off (us) | check on (us) | added (us) | log off (us) | log on (us) |\n"
          "|---|---|---|---|---|---|")
    sizes = sorted({k.split(" check")[0] for k in res["calls"] if " check " in k}, key=lambda s: int(s.split()[0]))
    for size in sizes:
        off, on = res["calls"][f"{size} check off"], res["calls"][f"{size} check on"]
        lo, ln = res["calls"][f"{size} log off"], res["calls"][f"{size} log on"]
        print(f"| {size} | {off * 1e6:.0f} | {on * 1e6:.0f} | {(on - off) * 1e6:.0f} | {lo * 1e6:.0f} | "
              f"{ln * 1e6:.0f} |")
    print("\n| DP=2 step (MLP 256-1024-256, batch 32) | median step (ms) | agreement checks per step |\n|---|---|---|")
    for name, r in res["steps"].items():
        print(f"| {name} | {r['step_s'] * 1e3:.2f} | {r['checks_per_step']:.1f} |")


def hot_path(calls: int = 20000, depth: int = 40) -> None:
    """The collective log's cost in one process: ``RealTransport._agree`` with the log on and off (the strict check
    off), from ``depth`` frames of a training loop, and the heartbeat thread's drain of the notes."""
    import statistics
    import time

    import paddle

    from autoparallel.comm import collective_log, transport

    t, x = transport.RealTransport(0, "gloo"), paddle.ones([64, 64])
    os.environ.pop("AP_COLLECTIVE_CHECK", None)

    def timed(log_on, k=depth):
        if k:
            return timed(log_on, k - 1)
        transport._LOG_ON[0] = log_on
        start = time.thread_time()          # this thread's CPU time: what the log costs, not the machine's load
        for _ in range(calls):
            t._agree("all_reduce", [0, 1], payload={0: x})
        return (time.thread_time() - start) / calls

    rows = {False: [], True: []}
    for _ in range(5):
        for on in (False, True):
            rows[on].append(timed(on))
    collective_log.LOG.drain()
    for _ in range(collective_log.RING):
        t._agree("all_reduce", [0, 1], payload={0: x})         # a full ring, drained as the heartbeat does
    transport._LOG_ON[0] = None
    start = time.thread_time()
    collective_log.LOG.drain()
    drain = (time.thread_time() - start) / collective_log.RING
    off, on = statistics.median(rows[False]) * 1e6, statistics.median(rows[True]) * 1e6
    print(f"| hot path per collective ({depth} frames deep) | log off (us) | log on (us) | added (us) | drain per "
          f"note, heartbeat thread (us) |\n|---|---|---|---|---|\n| RealTransport._agree | {off:.2f} | {on:.2f} | "
          f"{on - off:.2f} | {drain * 1e6:.2f} |\n")


if __name__ == "__main__":
    main()
