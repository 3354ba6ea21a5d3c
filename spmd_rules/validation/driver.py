"""Check every spmd rule against a full-tensor ground truth, forward and input gradients.

Every op, every sample call, every tried layout; a summary and a non-zero exit status on any failure."""
from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
import zlib

import numpy as np

import spmd_rules
from autoparallel.mesh import mesh_from_shape
from autoparallel.placement import BlockShard, Partial, Replicate, Shard
from spmd_rules.op_table import OP_TABLE

from .case import CASES, IMPLS, T, resolve
from .checker import Checker, Outcome
from .samples import _build_cases

MESHES_1D = ([2], [3])
MESH_2D = [2, 2]
SAMPLES_2D = 10            # 2x2 combinations tried per sample call without --exhaustive
MAX_EXHAUSTIVE = 50000     # --exhaustive: beyond this many 2x2 combinations a call is sampled (reported)


# ---- driver -----------------------------------------------------------------------------------------------------
def _options(t: T):
    if not t.shard:
        return [Replicate()]
    opts = [Replicate()] + [Shard(d) for d in range(t.array.ndim)]
    opts += [BlockShard(d, b) for d, b in sorted(t.blocks.items())]
    if np.issubdtype(t.array.dtype, np.floating) and t.partial:
        opts.append(Partial("sum"))
    return opts


def check_op(op: str, exhaustive: bool = False, max_combos: int = MAX_EXHAUSTIVE) -> Outcome:
    outcome = Outcome(op)
    if not spmd_rules.has_spmd_rule(op):
        outcome.no_rule = True
        return outcome
    _build_cases()
    cases = CASES.get(op)
    if not cases:
        outcome.no_cases = True
        return outcome
    for case in cases:
        impl = case.impl or IMPLS.get(op) or (resolve(OP_TABLE[op][0]) if OP_TABLE.get(op) else None)
        if impl is None:
            outcome.failures.append(f"{op}[{case.label}]: no paddle callable to check against")
            continue
        try:
            checker = Checker(op, case, impl, outcome)
        except Exception as e:
            outcome.failures.append(f"{op}[{case.label}]: the full op failed: {type(e).__name__}: "
                                    f"{str(e).splitlines()[0][:300]}")
            continue
        if case.creation:
            _run_creation(checker, case)
            continue
        opts = [_options(t) for t in checker.leaves]
        for shape in MESHES_1D:
            mesh = mesh_from_shape(shape, create_groups=False)
            for combo in itertools.product(*opts):
                checker.run(mesh, [(p,) for p in combo])
        mesh = mesh_from_shape(MESH_2D, create_groups=False)
        per_leaf = [list(itertools.product(o, o)) for o in opts]
        total = int(np.prod([len(p) for p in per_leaf])) if per_leaf else 1
        budget = max_combos if exhaustive else (case.samples_2d or SAMPLES_2D)
        if total <= budget:
            combos = itertools.product(*per_leaf)
        else:
            if exhaustive:
                outcome.sampled.append(f"{case.label}: {budget} of {total}")
            rnd = random.Random(zlib.crc32(f"{op}/{case.label}".encode()))
            combos = ([rnd.choice(p) for p in per_leaf] for _ in range(budget))
        for combo in combos:
            checker.run(mesh, list(combo))
    return outcome


def _run_creation(checker, case):
    ndim = checker.full_out[0].ndim
    opts = [Replicate()] + [Shard(d) for d in range(ndim)]
    for shape in MESHES_1D + (MESH_2D,):
        mesh = mesh_from_shape(shape, create_groups=False)
        for combo in itertools.product(*([opts] * mesh.ndim)):
            checker.run(mesh, [], tuple(combo))


def expected_ops() -> list:
    return sorted(OP_TABLE)


def run(ops, exhaustive=False, out=sys.stdout, max_combos: int = MAX_EXHAUSTIVE) -> list:
    import paddle

    paddle.set_device("cpu")
    results = []
    for op in ops:
        t0 = time.time()
        o = check_op(op, exhaustive, max_combos)
        results.append(o)
        if o.no_rule:
            status = "NO RULE"
        elif o.no_cases:
            status = "no sample cases (unchecked)"
        elif o.failures:
            status = f"FAIL ({len(o.failures)} wrong layouts)"
        else:
            status = "ok"
        extra = f", {o.needs_runtime} need runtime ({', '.join(sorted(o.runtime_ops))})" if o.needs_runtime else ""
        if o.sampled:
            extra += f"; 2x2 sampled for {'; '.join(o.sampled)}"
        print(f"{op:32s} {status:28s} {o.checked:3d} layouts checked{extra}  [{time.time() - t0:.2f}s]",
              file=out)
    return results


def main(argv=None, out=sys.stdout) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--op", action="append", help="rule name (repeatable)")
    g.add_argument("--all", action="store_true", help="every op in the op table and every registered rule")
    g.add_argument("--list", action="store_true", help="list registered rules and exit")
    ap.add_argument("--exhaustive", action="store_true", help="every 2x2 placement combination")
    ap.add_argument("--max-combos", type=int, default=MAX_EXHAUSTIVE,
                    help="with --exhaustive: sample calls with more 2x2 combinations than this (default %(default)s)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every failing layout")
    args = ap.parse_args(argv)
    if args.list:
        for op in spmd_rules.registered_ops():
            print(op, file=out)
        return 0
    ops = sorted(set(expected_ops()) | set(spmd_rules.registered_ops())) if args.all else args.op
    t0 = time.time()
    results = run(ops, args.exhaustive, out, args.max_combos)
    bad = [o for o in results if o.failures or o.no_rule]
    unchecked = [o.op for o in results if o.no_cases]
    print(f"\n{len(results)} ops, {sum(o.checked for o in results)} layouts checked, "
          f"{sum(o.needs_runtime for o in results)} need runtime, {len(bad)} failing, "
          f"{len(unchecked)} unchecked, {time.time() - t0:.1f}s", file=out)
    for o in results:
        if o.no_rule:
            print(f"NO RULE: {o.op} (register one with register_spmd_rule({o.op!r}))", file=out)
        shown = o.failures if args.verbose else o.failures[:3]
        for f in shown:
            print(f"WRONG: {f}", file=out)
        if len(o.failures) > len(shown):
            print(f"       ... {len(o.failures) - len(shown)} more for {o.op} (-v shows all)", file=out)
    if unchecked:
        print("unchecked (no sample cases): " + ", ".join(unchecked), file=out)
    if args.op and unchecked:
        return 1
    return 1 if bad else 0
