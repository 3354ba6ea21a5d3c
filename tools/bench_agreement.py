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
    args = ap.parse_args()
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])), "AP_WATCHDOG": "off"}
    job = run_job(os.path.join(ROOT, "tools", "_bench_agreement_worker.py"), 2, [args.repeat, args.steps],
                  timeout=900, env=env)
    if not job.results or not job.results[0]:
        raise SystemExit(f"the benchmark ranks failed:\n{job.failure()}")
    res = job.results[0]
    print("| all_reduce of | check off (us) | check on (us) | added (us) |\n|---|---|---|---|")
    sizes = sorted({k.split(" check")[0] for k in res["calls"]}, key=lambda s: int(s.split()[0]))
    for size in sizes:
        off, on = res["calls"][f"{size} check off"], res["calls"][f"{size} check on"]
        print(f"| {size} | {off * 1e6:.0f} | {on * 1e6:.0f} | {(on - off) * 1e6:.0f} |")
    print("\n| DP=2 step (MLP 256-1024-256, batch 32) | median step (ms) | agreement checks per step |\n|---|---|---|")
    for name, r in res["steps"].items():
        print(f"| {name} | {r['step_s'] * 1e3:.2f} | {r['checks_per_step']:.1f} |")


if __name__ == "__main__":
    main()
