"""The same user programs through paddle's own auto-parallel and through autoparallel, on 2 or 4 gloo ranks. Run:

    OMP_NUM_THREADS=1 PYTHONPATH=.:examples python -m paddle.distributed.launch --nproc_per_node 2 \\
        tools/check_vs_paddle_native.py [--program NAME ...] [--json PATH]

(``--nproc_per_node 4``: the 4-rank programs on 2 x 2 meshes, vs_paddle_native_programs4.py.)

Rank 0 prints one row per program: what paddle gave, what autoparallel gave (``ok`` and the output placements,
or the error type), and whether the values (global, and the local shards of explicitly placed tensors) agree
on both ranks. A difference not documented in docs/vs_paddle_native.md exits 1. The programs are
tests/dist_scripts/vs_paddle_native_programs.py and vs_paddle_native_training.py (also the suite's job
``vs_paddle_native``, tests/test_probe_vs_paddle_native.py), on 4 ranks vs_paddle_native_programs4.py (job
``vs_paddle_native4``, tests/test_probe_vs_paddle_native4.py). Any other world size is refused.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Run on 2 (or 4) ranks: python -m paddle.distributed.launch --nproc_per_node 2 "
                                       "tools/check_vs_paddle_native.py")
    p.add_argument("--program", action="append", default=[], help="run only this program (repeatable)")
    p.add_argument("--json", help="rank 0 writes both ranks' records there")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    if world not in (2, 4):
        parser.error(f"needs 2 or 4 launched ranks (python -m paddle.distributed.launch --nproc_per_node 2), "
                     f"got a world of {world}")
    module = "" if world == 2 else "vs_paddle_native_programs4"
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "dist_scripts"))
    import paddle.distributed as dist

    import autoparallel as ap
    import vs_paddle_native_worker as w

    ap.init_parallel_env()
    programs, oracles = w.program_set(module)[:2]
    unknown = sorted(set(args.program) - {p.__name__ for p in programs})
    if unknown:
        parser.error(f"unknown programs {unknown}")
    mine = w.run_all(args.program or None, module)
    both = []
    dist.all_gather_object(both, mine)
    if dist.get_rank() != 0:
        return 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(both, f)
    undocumented = 0
    print(f"{'program':34} {'paddle native':40} {'autoparallel':40} equal?")
    for name in mine:
        diffs = [d for r in both for d in w.compare(r[name])]
        why = w.documented(name, module)
        verdict = "yes" if not diffs and not why else ("documented: " + why if why else "NO")
        if name in oracles and why:
            wrong = [d for r in range(world) for d in w.oracle_diffs(name, both[r][name]["ap"], r, oracles)]
            verdict = "NO: " + "; ".join(wrong)[:150] if wrong else verdict
        undocumented += verdict.startswith("NO")
        p, o = w.summary(both[0][name])
        print(f"{name:34} {p[:40]:40} {o[:40]:40} {verdict}")
        for d in diffs[:4] if verdict.startswith("NO") else ():
            print(f"    {d[:200]}")
    print(f"{len(mine)} programs, {undocumented} undocumented differences")
    return 1 if undocumented else 0


if __name__ == "__main__":
    raise SystemExit(main())
