#!/usr/bin/env python
"""Check every spmd rule against a full-tensor ground truth, forward and input gradients.

    python tools/check_rules.py --all                 # every rule, default sampling
    python tools/check_rules.py --op matmul --exhaustive
    python tools/check_rules.py --list

For each op and each sample call (``add_case`` below; ``CASES``), every placement combination of the tensor inputs
(R, S(d) for every dim, P(sum) for float tensors) is tried on 1-d meshes of 2 and 3 ranks, and on a 2x2
mesh (a deterministic sample; with --exhaustive every combination, up to --max-combos per sample call,
beyond which a deterministic sample of that size is taken and reported). The rule gives the required input
specs; each rank's local inputs are built from the full tensors per those specs (S: the rank's slice,
R: whole, P(sum): random terms summing to the full tensor, P(max/min): terms whose max/min is it), the
paddle op (or the reference of a purely local ``local_op``) runs per rank with ``local_attrs(coords)``,
and the outputs are assembled per the output specs (S: slices, R: all ranks equal, P: reduced) and
compared with the op on the full tensors; local output shapes must equal ``spec.local_shape``.

Backward: a random full output gradient is seeded into each rank's local output (S: its slice, R and
P(sum): whole, P(max/min): where the rank holds the reduced value) and each rank's local input gradients
are checked by the convention: required S -> the slice of the full gradient; required P -> the full
gradient; required R on a mesh dim where the op is split -> the sum over that dim's group is the full
gradient; otherwise the full gradient. Results with a ``local_op`` that needs collectives or shared
randomness are counted as "needs runtime" (not passed; only their output shapes and dtypes are checked).
Ops of the op table without a rule and wrong rules are reported; the exit status is non-zero on any
failure. Other code may call ``main(argv)`` in-process and add cases with ``add_case`` (tests do).
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import time
import zlib
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autoparallel.mesh import mesh_from_shape  # noqa: E402
from autoparallel.placement import BlockShard, Partial, Replicate, Shard  # noqa: E402
from autoparallel.spec import DistSpec  # noqa: E402

import spmd_rules  # noqa: E402
from spmd_rules.op_table import OP_TABLE  # noqa: E402
from spmd_rules.registry import flatten_specs, replace_specs  # noqa: E402

MESHES_1D = ([2], [3])
MESH_2D = [2, 2]
SAMPLES_2D = 10            # 2x2 combinations tried per sample call without --exhaustive
MAX_EXHAUSTIVE = 50000     # --exhaustive: beyond this many 2x2 combinations a call is sampled (reported)


# ---- sample calls ---------------------------------------------------------------------------------------------------
@dataclass
class T:
    """A tensor argument of a sample call: its full value; ``grad``: check its gradient; ``partial``: also
    try it as P(sum)."""
    array: np.ndarray
    grad: bool = True
    partial: bool = True
    shard: bool = True          # False: only R is tried (scalar hyper-parameter tensors)
    blocks: dict = field(default_factory=dict)   # {dim: block sizes}: S(dim,blocks=..) is tried too

    def __post_init__(self):
        self.array = np.asarray(self.array)
        if not np.issubdtype(self.array.dtype, np.floating):
            self.grad = False


@dataclass
class Case:
    args: tuple
    kwargs: dict
    label: str = ""
    impl: object = None          # callable overriding the op table's canonical paddle callable
    grad: bool = True
    rtol: float = 1e-5
    atol: float = 1e-8
    samples_2d: int = 0
    creation: bool = False       # no tensor inputs: the OUTPUT placements are enumerated (mesh=, placements=)


CASES: dict = {}                 # op -> [Case]
IMPLS: dict = {}                 # op -> callable used as ground truth (and locally) instead of OP_TABLE[op][0]


def add_case(op: str, *args, label: str | None = None, impl=None, grad: bool = True, rtol: float = 1e-5,
             atol: float = 1e-8, samples_2d: int = 0, creation: bool = False, **kwargs) -> Case:
    """Register a sample call of ``op``: tensors as ``T(array)``, other arguments as python values."""
    cases = CASES.setdefault(op, [])
    c = Case(args, kwargs, label or str(len(cases)), impl, grad, rtol, atol, samples_2d, creation)
    cases.append(c)
    return c


def resolve(dotted: str):
    """The paddle callable at a dotted path such as ``paddle.Tensor.__add__``."""
    import importlib

    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, p in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, p)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


# ---- building local tensors -----------------------------------------------------------------------------------
def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _terms(full: np.ndarray, kind: str, n: int, rng) -> list:
    """``n`` arrays whose reduction by ``kind`` is ``full``."""
    if kind in ("sum", "avg"):
        total = full * n if kind == "avg" else full
        if np.issubdtype(full.dtype, np.integer):
            parts = [rng.integers(-3, 4, size=full.shape).astype(full.dtype) for _ in range(n - 1)]
        elif full.dtype == np.bool_:
            raise ValueError("a bool tensor cannot be Partial(sum)")
        else:
            parts = [rng.standard_normal(full.shape).astype(full.dtype) for _ in range(n - 1)]
        return parts + [total - sum(parts, np.zeros_like(full))]
    owner = rng.integers(0, n, size=full.shape)
    out = []
    for j in range(n):
        gap = np.abs(rng.standard_normal(full.shape)).astype(full.dtype) + 0.5
        t = full - gap if kind == "max" else full + gap
        out.append(np.where(owner == j, full, t))
    return out


def local_input(full: np.ndarray, spec: DistSpec, coords, key) -> np.ndarray:
    arr = full
    pdims = spec.partial_mesh_dims()
    for k, m in enumerate(pdims):
        earlier = tuple(coords[q] for q in pdims[:k])
        parts = _terms(arr, spec.placements[m].reduce_type, spec.mesh.shape[m], _rng(key, m, earlier))
        arr = parts[coords[m]]
    return np.ascontiguousarray(arr[spec.local_slices(coords)])


def _reduce(kind, vals):
    if kind == "sum":
        return sum(vals[1:], vals[0])
    if kind == "avg":
        return sum(vals[1:], vals[0]) / len(vals)
    return np.maximum.reduce(vals) if kind == "max" else np.minimum.reduce(vals)


def assemble(locals_: dict, spec: DistSpec, rtol, atol) -> np.ndarray:
    """Global array from per-rank local arrays per ``spec``; raises AssertionError on inconsistency."""
    mesh = spec.mesh
    rdims = [m for m, p in enumerate(spec.placements) if isinstance(p, Replicate)]
    pdims = spec.partial_mesh_dims()
    for c, a in locals_.items():
        rep = list(c)
        for m in rdims:
            rep[m] = 0
        b = locals_[tuple(rep)]
        if a.shape != b.shape or not _close(a, b, rtol, atol):
            raise AssertionError(f"output is R on mesh dims {rdims} but ranks at {c} and {tuple(rep)} differ")

    def value(c, dims):
        if not dims:
            return locals_[tuple(c)]
        m, vals = dims[0], []
        for j in range(mesh.shape[m]):
            cc = list(c)
            cc[m] = j
            vals.append(value(cc, dims[1:]))
        return _reduce(spec.placements[m].reduce_type, vals)

    canvas = np.zeros(spec.shape, dtype=np.result_type(*[a.dtype for a in locals_.values()]))
    cover = np.zeros(spec.shape, dtype=np.int64)
    for c in np.ndindex(*mesh.shape):
        if any(c[m] != 0 for m in rdims + pdims):
            continue
        sl = spec.local_slices(c)
        canvas[sl] = value(list(c), pdims)
        cover[sl] += 1
    if spec.numel and not (cover == 1).all():
        raise AssertionError(f"the shards of the output do not tile the global shape {list(spec.shape)}")
    return canvas


def _close(a, b, rtol, atol) -> bool:
    if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):
        return np.array_equal(a, b)
    return np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)


# ---- running ops ------------------------------------------------------------------------------------------------
def _paddle():
    import paddle

    return paddle


def _to_paddle(arr: np.ndarray, grad: bool):
    paddle = _paddle()
    t = paddle.to_tensor(arr)
    t.stop_gradient = not grad
    return t


def _outputs(out) -> list:
    if isinstance(out, (list, tuple)):
        return list(out)
    return [out]


def _np(t):
    return None if t is None else np.asarray(t.numpy())


@dataclass
class Outcome:
    op: str
    checked: int = 0
    needs_runtime: int = 0
    failures: list = field(default_factory=list)
    layouts: set = field(default_factory=set)
    runtime_ops: set = field(default_factory=set)
    no_rule: bool = False
    no_cases: bool = False
    sampled: list = field(default_factory=list)     # --exhaustive calls too large to enumerate


class Checker:
    def __init__(self, op: str, case, impl, outcome: Outcome):
        self.op, self.case, self.impl, self.outcome = op, case, impl, outcome
        self.leaves = flatten_specs(case.args, case.kwargs, is_leaf=lambda v: isinstance(v, T))
        self.seen: dict = {}
        self._specs: dict = {}
        self._full()

    # ground truth on full tensors
    def _full(self):
        paddle = _paddle()
        case = self.case
        tensors = [_to_paddle(t.array, t.grad and case.grad) for t in self.leaves]
        args, kwargs = replace_specs(case.args, case.kwargs, tensors, is_leaf=lambda v: isinstance(v, T))
        outs = _outputs(self.impl(*args, **kwargs))
        self.full_out = [_np(o) for o in outs]
        self.grads = None
        diff = [i for i, t in enumerate(self.leaves) if t.grad and case.grad]
        float_outs = [k for k, o in enumerate(outs) if o is not None and _is_float(o) and not o.stop_gradient]
        if diff and float_outs:
            rng = _rng(self.op, case.label, "seed")
            self.seeds = {k: rng.standard_normal(self.full_out[k].shape).astype(self.full_out[k].dtype)
                          for k in float_outs}
            loss = sum((outs[k] * paddle.to_tensor(self.seeds[k])).sum() for k in float_outs)
            loss.backward()
            self.grads = {i: (_np(tensors[i].grad) if tensors[i].grad is not None
                              else np.zeros_like(self.leaves[i].array)) for i in diff}

    def specs_for(self, mesh, placements):
        out = []
        for i, (t, pl) in enumerate(zip(self.leaves, placements)):
            key = (i, mesh, tuple(pl))
            if key not in self._specs:
                self._specs[key] = DistSpec(mesh, tuple(pl), t.array.shape, str(t.array.dtype))
            out.append(self._specs[key])
        return out

    def run(self, mesh, placements, out_placements=None):
        try:
            specs = self.specs_for(mesh, placements)
        except ValueError:
            if any(isinstance(p, BlockShard) for pl in placements for p in pl):
                return                  # not a layout (a nested or non-dividing block split): nothing to check
            raise
        args, kwargs = replace_specs(self.case.args, self.case.kwargs, specs, is_leaf=lambda v: isinstance(v, T))
        where = f"{self.op}[{self.case.label}] on mesh {mesh.short()} with inputs " + \
                ", ".join("[" + ", ".join(map(str, pl)) + "]" for pl in placements)
        if self.case.creation:
            kwargs = dict(kwargs, mesh=mesh, placements=out_placements)
            where += f" creating [{', '.join(map(str, out_placements))}]"
        try:
            res = _resolve_local_shaped(spmd_rules.get_spmd_rule(self.op)(*args, **kwargs), self.full_out)
        except Exception as e:  # a rule must accept every layout
            self.outcome.failures.append(f"{where}: the rule raised {type(e).__name__}: {e}")
            return
        coords_all = list(np.ndindex(*mesh.shape))
        try:
            attrs = tuple(repr(sorted(res.local_kwargs(c).items())) for c in coords_all)
        except Exception as e:
            self.outcome.failures.append(f"{where}: local_attrs raised {type(e).__name__}: {e}")
            return
        key = (res.inputs, res.outputs, res.local_op, attrs)
        if key in self.seen:
            return
        self.seen[key] = True
        if res.local_op is not None and res.local_op not in LOCAL_OPS:
            self.outcome.needs_runtime += 1
            self.outcome.runtime_ops.add(res.local_op)
            try:
                self._check_shapes(res)
            except AssertionError as e:
                self.outcome.failures.append(f"{where}: rule says {res}: {e}")
            return
        try:
            self._verify(res, coords_all)
            self.outcome.checked += 1
            self.outcome.layouts.add(str(res))
        except AssertionError as e:
            self.outcome.failures.append(f"{where}: rule says {res}: {e}")
        except Exception as e:
            self.outcome.failures.append(f"{where}: rule says {res}: local run failed: {type(e).__name__}: "
                                         f"{str(e).splitlines()[0][:300]}")

    def _check_shapes(self, res):
        """The shape-function half of a rule: global output shapes and dtypes equal the full op's."""
        outs = [o for o in res.outputs]
        if len(outs) != len(self.full_out):
            raise AssertionError(f"the rule gives {len(outs)} outputs, the op returns {len(self.full_out)}")
        for k, (spec, full) in enumerate(zip(outs, self.full_out)):
            if (spec is None) != (full is None):
                got = "a tensor" if full is not None else None
                raise AssertionError(f"output {k}: the rule gives {spec}, the op returns {got}")
            if spec is not None and (tuple(spec.shape) != full.shape or spec.dtype != str(full.dtype)):
                raise AssertionError(f"output {k}: spec {list(spec.shape)} {spec.dtype} != op output "
                                     f"{list(full.shape)} {full.dtype}")

    def _verify(self, res, coords_all):
        paddle = _paddle()
        case = self.case
        rtol, atol = case.rtol, case.atol
        fn = LOCAL_OPS[res.local_op] if res.local_op else self.impl
        local_in, local_out = {}, {}
        for c in coords_all:
            tensors = []
            for i, (t, spec) in enumerate(zip(self.leaves, res.inputs)):
                arr = local_input(t.array, spec, c, (self.op, case.label, i))
                tensors.append(_to_paddle(arr, t.grad and case.grad))
            args, kwargs = replace_specs(case.args, case.kwargs, tensors, is_leaf=lambda v: isinstance(v, T))
            args, kwargs = spmd_rules.get_spmd_rule(self.op).local_call(res, args, kwargs, c)
            outs = _outputs(fn(*args, **kwargs))
            local_in[c], local_out[c] = tensors, outs
            if len(outs) != len(res.outputs):
                raise AssertionError(f"the local op returned {len(outs)} outputs, the rule gives "
                                     f"{len(res.outputs)} output specs")
            for k, (o, spec) in enumerate(zip(outs, res.outputs)):
                if (o is None) != (spec is None):
                    raise AssertionError(f"output {k}: local op returned {o is not None and 'a tensor' or None},"
                                         f" the rule gives {spec}")
                if o is None:
                    continue
                if tuple(o.shape) != spec.local_shape(c):
                    raise AssertionError(f"output {k}: local shape {list(o.shape)} at coords {c} != "
                                         f"spec.local_shape {list(spec.local_shape(c))}")
                if str(o.dtype).replace("paddle.", "") != spec.dtype:
                    raise AssertionError(f"output {k}: dtype {o.dtype} != spec dtype {spec.dtype}")
        for k, spec in enumerate(res.outputs):
            if spec is None:
                continue
            if tuple(spec.shape) != tuple(self.full_out[k].shape):
                raise AssertionError(f"output {k}: spec shape {list(spec.shape)} != full output shape "
                                     f"{list(self.full_out[k].shape)}")
            got = assemble({c: _np(local_out[c][k]) for c in coords_all}, spec, rtol, atol)
            if not _close(got, self.full_out[k], rtol, atol):
                err = np.max(np.abs(got.astype(np.float64) - self.full_out[k].astype(np.float64)))
                raise AssertionError(f"output {k} differs from the full op (max abs error {err:.3g})")
        if self.grads is None:
            return
        split = set(res.split_mesh_dims())
        local_grads = {}
        for c in coords_all:
            outs = local_out[c]
            terms = []
            for k, seed in self.seeds.items():
                spec, o = res.outputs[k], outs[k]
                sl = spec.local_slices(c)
                g = seed[sl]
                for m in spec.partial_mesh_dims():
                    if spec.placements[m].reduce_type in ("max", "min"):   # adjoint of all_reduce(max/min)
                        g = np.where(_np(o) == self.full_out[k][sl], g, 0)
                terms.append((o * paddle.to_tensor(np.ascontiguousarray(g))).sum())
            loss = sum(terms)
            if loss.stop_gradient:
                local_grads[c] = {}
                continue
            loss.backward()
            local_grads[c] = {i: (_np(t.grad) if t.grad is not None else None)
                              for i, t in enumerate(local_in[c]) if i in self.grads}
        for i, full_g in self.grads.items():
            spec = res.inputs[i]
            sum_dims = [m for m in split if isinstance(spec.placements[m], Replicate)]
            for c in coords_all:
                total = None
                for cc in _group(c, sum_dims, spec.mesh.shape):
                    g = local_grads[cc].get(i)
                    if g is None:
                        g = np.zeros(spec.local_shape(cc), dtype=full_g.dtype)
                    total = g if total is None else total + g
                want = full_g[spec.local_slices(c)]
                if total.shape != want.shape or not _close(total, want, rtol, atol):
                    how = f"summed over mesh dims {sum_dims}" if sum_dims else "local"
                    err = np.max(np.abs(total - want)) if total.shape == want.shape else "shape mismatch"
                    raise AssertionError(f"gradient of input {i} ({how}) at coords {c} is wrong for required "
                                         f"[{', '.join(map(str, spec.placements))}] (max abs error {err})")


def _resolve_local_shaped(res, full_out):
    """A value-dependent output (replicated) takes the full op's shape and dtype, as the runtime takes them
    from the local result."""
    from spmd_rules.result import LocalShaped, SpmdResult

    if not any(isinstance(o, LocalShaped) for o in res.outputs):
        return res
    outs = tuple(o.resolve(full.shape, str(full.dtype)) if isinstance(o, LocalShaped) else o
                 for o, full in zip(res.outputs, list(full_out) + [None] * len(res.outputs)))
    return SpmdResult(res.inputs, outs, res.local_op, res.local_attrs, res.op)


def _group(c, dims, shape):
    ranges = [range(shape[m]) if m in dims else [c[m]] for m in range(len(shape))]
    return list(itertools.product(*ranges))


def _is_float(t) -> bool:
    return "float" in str(t.dtype)


# ---- reference implementations of purely local local_ops -------------------------------------------------------
def _vocab_parallel_embedding(x, weight, padding_idx=None, max_norm=None, norm_type=2.0, sparse=False,
                              scale_grad_by_freq=False, name=None, *, vocab_start, vocab_end):
    paddle = _paddle()
    F = paddle.nn.functional
    mask = (x >= vocab_start) & (x < vocab_end)
    ids = paddle.where(mask, x - vocab_start, paddle.zeros_like(x))
    out = F.embedding(ids, weight, padding_idx=padding_idx, sparse=sparse)
    return out * mask.unsqueeze(-1).astype(out.dtype)


def _global_mean(x, axis=None, keepdim=False, name=None, *, global_count, dtype=None):
    paddle = _paddle()
    return paddle.sum(x, axis=axis, dtype=dtype, keepdim=keepdim) / global_count


def _row_of_shard(x, index=None, *, row):
    from autoparallel.local_ops import row_of_shard

    return row_of_shard(x, index, row=row)


def _setitem(x, index, value):
    from autoparallel.local_ops import setitem

    return setitem(x, index, value)


LOCAL_OPS = {
    "setitem": _setitem,
    "vocab_parallel_embedding": _vocab_parallel_embedding,
    "global_mean": _global_mean,
    "row_of_shard": _row_of_shard,
}


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


# ---- the sample calls of every built-in rule -------------------------------------------------------------------
_BUILT = False
_COUNTER = [0]


def f(*shape, lo=None):
    """A deterministic float64 array (positive when ``lo`` is given)."""
    _COUNTER[0] += 1
    a = _rng("f", _COUNTER[0]).standard_normal(shape)
    if lo is not None:
        a = np.abs(a) + lo
    return T(a)


def ints(high, *shape, low=0):
    _COUNTER[0] += 1
    return T(_rng("i", _COUNTER[0]).integers(low, high, size=shape).astype(np.int64))


def _build_cases():
    global _BUILT
    if _BUILT:
        return
    _BUILT = True
    _COUNTER[0] = 0
    _impls()
    for build in (_cases_matmul, _cases_elementwise, _cases_reduction, _cases_norm, _cases_nn, _cases_shape,
                  _cases_creation, _cases_optimizer, _cases_routing, _cases_more, _cases_blocks):
        build()


def blocked(t: T, **dims) -> T:
    """``t`` also tried block-sharded: ``blocked(f(4, 18), d1=(12, 6))``."""
    t.blocks = {int(k[1:]): tuple(v) for k, v in dims.items()}
    return t


def _cases_blocks():
    """Fused projections: blocks divisible by 2 and 3 (both 1-d meshes), aligned and misaligned pieces."""
    add_case("linear", f(2, 3, 6), blocked(f(6, 18), d1=(12, 6)), blocked(f(18), d0=(12, 6)), label="fused")
    add_case("matmul", f(3, 6), blocked(f(6, 12), d1=(6, 6)), label="fused")
    add_case("chunk", blocked(f(4, 12), d1=(6, 6)), 2, axis=-1, label="fused")
    add_case("chunk", blocked(f(4, 12), d1=(6, 6)), 3, axis=-1, label="misaligned")
    add_case("split", blocked(f(4, 18), d1=(6, 6, 6)), [12, 6], axis=1, label="fused")
    add_case("split", blocked(f(4, 18), d1=(12, 6)), [6, 12], axis=1, label="misaligned")
    add_case("getitem", blocked(f(2, 18), d1=(6, 6, 6)), (Ellipsis, slice(0, 6)), label="block-q")
    add_case("getitem", blocked(f(2, 18), d1=(6, 6, 6)), (Ellipsis, slice(6, None)), label="block-kv")
    add_case("getitem", blocked(f(2, 18), d1=(6, 6, 6)), (Ellipsis, slice(3, 9)), label="block-misaligned")
    add_case("multiply", blocked(f(4, 12), d1=(6, 6)), blocked(f(4, 12), d1=(6, 6)), label="fused")
    add_case("add", blocked(f(4, 12), d1=(6, 6)), blocked(f(12), d0=(6, 6)), label="fused-broadcast")
    add_case("silu", blocked(f(4, 12), d1=(6, 6)), label="fused")
    add_case("transpose", blocked(f(4, 12), d1=(6, 6)), [1, 0], label="fused")
    add_case("softmax", blocked(f(4, 12), d1=(6, 6)), axis=0, label="fused-other-axis")
    add_case("softmax", blocked(f(4, 12), d1=(6, 6)), axis=1, label="fused-axis")
    add_case("sum", blocked(f(4, 12), d1=(6, 6)), axis=1, label="fused-reduced")
    add_case("mean", blocked(f(4, 12), d1=(6, 6)), axis=1, label="fused-reduced")
    add_case("mean", blocked(f(4, 12), d1=(6, 6)), axis=0, label="fused-kept")
    add_case("max", blocked(f(4, 12), d1=(6, 6)), axis=1, label="fused-reduced")
    add_case("argmax", blocked(f(4, 12), d1=(6, 6)), axis=1, label="fused-unaware")
    add_case("sgd", blocked(T(f(4, 12).array, partial=False, grad=False), d1=(6, 6)),
             T(np.array([0.1]), shard=False, grad=False),
             blocked(T(f(4, 12).array, grad=False), d1=(6, 6)), label="fused")
    add_case("reshape", blocked(f(4, 12), d1=(6, 6)), [4, 2, 6], label="fused-split")
    add_case("reshape", blocked(f(2, 3, 12), d2=(6, 6)), [6, 12], label="fused-kept")
    add_case("flatten", blocked(f(2, 3, 12), d2=(6, 6)), start_axis=0, stop_axis=1, label="fused-kept")
    add_case("flatten", blocked(f(2, 12, 3), d1=(6, 6)), start_axis=1, label="fused-merged")


def _impls():
    paddle = _paddle()
    F = paddle.nn.functional

    def rms_norm(x, normalized_shape, weight=None, eps=1e-05, name=None):
        k = len(normalized_shape) if isinstance(normalized_shape, (list, tuple)) else 1
        axes = list(range(x.ndim - k, x.ndim))
        inv = paddle.rsqrt((x * x).mean(axis=axes, keepdim=True) + eps)
        out = x * inv
        if weight is not None:
            out = out * weight.reshape(x.shape[x.ndim - k:])
        return out, inv.reshape([-1]).astype("float32")

    def rotary_embedding(x, cos, sin):
        x1, x2 = paddle.chunk(x, 2, axis=-1)
        return x * cos + paddle.concat([-x2, x1], axis=-1) * sin

    def sgd(param, learning_rate, grad, master_param=None, multi_precision=False):
        p = param.clone()
        out = paddle._C_ops.sgd_(p, learning_rate, grad, master_param, multi_precision)
        return out

    def adamw(param, grad, learning_rate, moment1, moment2, moment2_max, beta1_pow, beta2_pow, master_weight,
              found_inf, *rest, **kw):
        c = [None if t is None else t.clone() for t in (param, moment1, moment2, moment2_max, beta1_pow, beta2_pow,
                                                          master_weight)]
        out = paddle._C_ops.adamw_(c[0], grad, learning_rate, c[1], c[2], c[3], c[4], c[5], c[6], found_inf,
                                   *rest, *kw.values())
        return tuple(out)

    def batch_norm(x, running_mean, running_var, *args, **kwargs):
        return F.batch_norm(x, running_mean.clone(), running_var.clone(), *args, **kwargs)

    def setitem(x, index, value):
        y = x.clone()
        y[index] = value
        return y

    IMPLS.update(setitem=setitem)
    IMPLS.update(rms_norm=rms_norm, rotary_embedding=rotary_embedding, sgd=sgd, adamw=adamw, batch_norm=batch_norm)


def _cases_matmul():
    add_case("matmul", f(5, 6), f(6, 7))
    add_case("matmul", f(2, 3, 5), f(7, 5), transpose_y=True, label="batched-transpose_y")
    add_case("matmul", f(6, 5), f(6, 7), transpose_x=True, label="transpose_x")
    add_case("matmul", f(3, 1, 5, 6), f(1, 2, 6, 5), label="broadcast-batch")
    add_case("matmul", f(6), f(6, 5), label="vector")
    add_case("linear", f(2, 5, 6), f(6, 7), f(7))
    add_case("linear", f(5, 6), f(6, 7), label="no-bias")
    add_case("bmm", f(3, 5, 6), f(3, 6, 2))
    add_case("einsum", "bij,bjk->bik", f(2, 5, 6), f(2, 6, 3))
    add_case("einsum", "bshd,bthd->bhst", f(2, 3, 2, 5), f(2, 5, 2, 5), label="attention-scores")
    add_case("einsum", "ij->j", f(5, 3), label="reduce")
    add_case("einsum", "...ij,jk->...ik", f(2, 5, 6), f(6, 3), label="ellipsis")


def _cases_elementwise():
    for op in ("exp", "tanh", "sigmoid", "erf", "sin", "cos", "silu", "relu", "abs", "square", "neg", "clone",
               "gelu"):
        add_case(op, f(5, 6))
    for op in ("log", "sqrt", "rsqrt", "log1p"):
        add_case(op, f(5, 6, lo=0.5))
    add_case("floor", f(5, 3), grad=False)
    add_case("sign", f(5, 3), grad=False)
    add_case("leaky_relu", f(5, 3), negative_slope=0.1)
    add_case("clip", f(5, 3), min=-0.5, max=0.5)
    add_case("pow", f(5, 3, lo=0.5), 3.0)
    add_case("pow", f(5, 3, lo=0.5), f(3), label="tensor-exponent")
    add_case("scale", f(5, 3), scale=2.0)
    add_case("scale", f(5, 3), scale=2.0, bias=1.0, label="bias")
    add_case("cast", f(5, 3), "float32", rtol=1e-6, atol=1e-6)
    add_case("cast", f(5, 3), "int64", label="to-int", grad=False)
    add_case("logical_not", T(_rng("b", 0).random((5, 3)) > 0.5))
    for op in ("add", "subtract", "multiply", "divide", "maximum", "minimum"):
        add_case(op, f(5, 6), f(6))
        add_case(op, f(5, 1, 6), f(3, 6, lo=0.5), label="broadcast")
    add_case("add", f(5, 6), 2.5, label="scalar", impl=lambda x, y: x + y)
    add_case("add", f(5, 6), f(5, 6), alpha=2.0, label="alpha")
    add_case("divide", f(5, 6), f(6, lo=0.5), rounding_mode="floor", label="floor", grad=False)
    add_case("subtract", 2.5, f(5, 6), label="scalar-first", impl=lambda x, y: x - y)
    add_case("multiply", f(5, 6), 2.5, label="scalar", impl=lambda x, y: x * y)
    add_case("divide", 3.0, f(5, 6, lo=0.5), label="scalar-numerator", impl=lambda x, y: x / y)
    add_case("divide", f(5, 6), 4.0, label="scalar-denominator", impl=lambda x, y: x / y)
    add_case("floor_divide", ints(9, 5, 3, low=1), ints(4, 3, low=1))
    add_case("remainder", ints(9, 5, 3), ints(4, 3, low=1))
    for op in ("equal", "not_equal", "less_than", "less_equal", "greater_than", "greater_equal"):
        add_case(op, f(5, 6), f(6))
    bools = T(_rng("b", 1).random((5, 6)) > 0.5)
    add_case("logical_and", bools, T(_rng("b", 2).random((6,)) > 0.5))
    add_case("logical_or", bools, T(_rng("b", 3).random((5, 6)) > 0.5))
    add_case("where", bools, f(5, 6), f(6))
    add_case("where", bools, f(5, 6), 0.0, label="scalar-y")


def _cases_reduction():
    for op in ("sum", "mean", "max", "min"):
        add_case(op, f(5, 6, 7), axis=1)
        add_case(op, f(5, 6), label="all")
        add_case(op, f(5, 6, 7), axis=[0, 2], keepdim=True, label="axes-keepdim")
    add_case("mean", f(5, 6), axis=1, dtype="float32", label="dtype", rtol=1e-6, atol=1e-6)
    add_case("sum", f(5, 6), axis=-1, dtype="float32", label="dtype", rtol=1e-6, atol=1e-6)
    for op in ("argmax", "argmin"):
        add_case(op, f(5, 6, 7), axis=1)
        add_case(op, f(5, 6), axis=-1, keepdim=True, label="keepdim")
        add_case(op, f(5, 6), label="flat")


def _cases_norm():
    for op in ("softmax", "log_softmax"):
        add_case(op, f(5, 6, 7))
        add_case(op, f(5, 6), axis=0, label="axis0")
    add_case("layer_norm", f(2, 5, 6), 6, f(6), f(6))
    add_case("layer_norm", f(5, 3, 4), [3, 4], label="two-dims-no-affine")
    add_case("rms_norm", f(5, 3, 6), [6], f(6))
    add_case("rms_norm", f(6, 5), [5], label="2d")
    stats = dict(partial=False, grad=False)
    add_case("batch_norm", f(5, 6, 3, 3), T(f(6).array, **stats), T(f(6, lo=0.5).array, **stats), f(6), f(6),
             label="eval")
    add_case("batch_norm", f(5, 6, 3, 3), T(f(6).array, **stats), T(f(6, lo=0.5).array, **stats), f(6), f(6),
             training=True, label="train")
    add_case("conv2d", f(5, 6, 4, 4), f(7, 6, 3, 3), f(7), padding=1)
    add_case("conv2d", f(5, 4, 4, 6), f(7, 6, 2, 2), stride=2, data_format="NHWC", label="nhwc")


def _cases_nn():
    add_case("embedding", ints(11, 5, 3), f(11, 6))
    add_case("embedding", ints(11, 5), f(11, 6), padding_idx=3, label="padding_idx")
    add_case("one_hot", ints(6, 5, 3), num_classes=6)
    lab = ints(7, 5)
    add_case("cross_entropy", f(5, 7), lab, reduction="none", label="none")
    add_case("cross_entropy", f(5, 7), lab, reduction="sum", label="sum")
    add_case("cross_entropy", f(5, 7), lab, label="mean")
    add_case("cross_entropy", f(2, 5, 7), ints(7, 2, 5, 1), reduction="none", label="3d-label1")
    add_case("cross_entropy", f(5, 7), T(np.abs(f(5, 7).array) / 7, grad=False), soft_label=True, reduction="sum",
             label="soft")
    add_case("cross_entropy", f(5, 7, 3), ints(7, 5, 3), axis=1, reduction="none", label="axis1")
    q, k, v = f(2, 5, 6, 3), f(2, 7, 6, 3), f(2, 7, 6, 3)
    add_case("scaled_dot_product_attention", q, k, v, samples_2d=16)
    add_case("scaled_dot_product_attention", q, k, v, is_causal=True, label="causal", samples_2d=16)
    add_case("scaled_dot_product_attention", f(2, 5, 6, 3), f(2, 5, 3, 3), f(2, 5, 3, 3), label="gqa")
    add_case("scaled_dot_product_attention", f(2, 5, 4, 3), f(2, 5, 2, 3), f(2, 5, 2, 3), label="gqa-sharded",
             samples_2d=40)
    add_case("scaled_dot_product_attention", f(2, 5, 6, 3), f(2, 7, 6, 3), f(2, 7, 6, 3), f(2, 1, 5, 7),
             label="mask")
    add_case("scaled_dot_product_attention", q, k, v, dropout_p=0.5, label="dropout", grad=False)
    fq, fk, fv = (T(a.array.astype(np.float32)) for a in (f(2, 5, 6, 3), f(2, 7, 6, 3), f(2, 7, 6, 3)))
    add_case("flash_attention", fq, fk, fv, rtol=1e-4, atol=1e-5)
    add_case("flash_attention", fq, fk, fv, causal=True, label="causal", rtol=1e-4, atol=1e-5)
    add_case("rotary_embedding", f(2, 5, 3, 6), f(5, 1, 6), f(5, 1, 6))
    add_case("dropout", f(5, 6), p=0.0, label="p0")
    add_case("dropout", f(5, 6), p=0.3, training=False, mode="downscale_in_infer", label="eval-downscale")
    add_case("dropout", f(5, 6), p=0.3, label="random", grad=False)


def _cases_shape():
    add_case("reshape", f(6, 5, 4), [6, 20])
    add_case("reshape", f(6, 20), [6, 5, 4], label="split")
    add_case("reshape", f(24, 5), [6, -1, 5], label="split-first")
    add_case("reshape", f(5, 4, 6), [20, 6], label="flatten-uneven")
    add_case("reshape", f(2, 3, 5), [6, 1, 5], label="singleton")
    add_case("reshape", f(6, 5, 4), [0, 4, 5], label="copy-dim-regroup")
    add_case("view", f(6, 5, 4), [6, 20])
    add_case("flatten", f(6, 5, 4), start_axis=1)
    add_case("flatten", f(6, 5, 4), label="all")
    add_case("transpose", f(5, 6, 7), [2, 0, 1])
    add_case("t", f(5, 6))
    add_case("unsqueeze", f(5, 6), [0, 2])
    add_case("squeeze", f(5, 1, 6), axis=1)
    add_case("expand", f(5, 1, 6), [3, 5, 7, 6])
    add_case("broadcast_to", f(1, 6), [5, 6])
    add_case("split", f(5, 6, 7), [2, -1, 3], axis=2)
    add_case("split", f(5, 6), 2, axis=1, label="equal")
    add_case("chunk", f(6, 5), 3)
    add_case("concat", [f(5, 2), f(5, 6)], axis=1)
    add_case("stack", [f(5, 6), f(5, 6)], axis=1)
    add_case("getitem", f(5, 6, 7), (slice(None), 2, slice(1, 5)))
    add_case("getitem", f(5, 6, 7), (Ellipsis, None, slice(0, 7, 2)), label="ellipsis-none-step")
    add_case("getitem", f(5, 6, 7), (slice(None), [0, 4, 1]), label="list")
    add_case("getitem", f(5, 6, 7), (slice(None), ints(6, 6, 5)), label="tensor-index")
    add_case("getitem", f(5, 6), 3, label="int")
    add_case("setitem", f(5, 6), (slice(None), slice(0, 2)), 0.5, label="scalar")
    add_case("setitem", f(5, 6), (slice(1, 3),), f(2, 6), label="tensor-value")
    add_case("setitem", f(5, 6, 4), (slice(None), 2), f(5, 4), label="int-middle")
    add_case("setitem", f(5, 6, 4), (Ellipsis, slice(0, 2)), f(6, 1), label="broadcast-value")
    add_case("setitem", f(5, 6), (T(np.array([0, 3])),), f(2, 6), label="tensor-index", grad=False)
    add_case("getitem", f(5, 6, 2), -1, label="int-last-row")
    add_case("tril", f(5, 7))
    add_case("triu", f(2, 5, 7), diagonal=1)


def _cases_routing():
    add_case("topk", f(5, 6), 2)
    add_case("topk", f(5, 6), 3, axis=0, largest=False, label="axis0-smallest")
    add_case("argsort", f(5, 6), axis=0)
    add_case("sort", f(5, 6), descending=True)
    add_case("cumsum", f(5, 6), axis=1)
    add_case("cumsum", f(3, 4), label="flat")
    add_case("take_along_axis", f(5, 6), ints(6, 5, 2), axis=1)
    add_case("put_along_axis", f(5, 6), T(np.array([[0], [3], [5], [1], [2]])), f(5, 1), axis=1,
             label="assign")
    add_case("put_along_axis", f(5, 6), T(np.array([[0, 2], [3, 3], [5, 0], [1, 1], [2, 4]])), f(5, 2), axis=1,
             reduce="add", label="add")
    add_case("index_add", f(6, 4), T(np.array([4, 0, 4])), 0, f(3, 4))
    add_case("index_select", f(6, 4), T(np.array([5, 0, 2])), axis=0)
    add_case("gather", f(6, 4), T(np.array([3, 0, 2])), axis=1, label="axis1")
    add_case("scatter", f(6, 4), T(np.array([3, 0, 5])), f(3, 4))
    add_case("index_put", f(5, 6), (T(np.array([0, 4])), T(np.array([1, 5]))), f(2), accumulate=True)
    add_case("permute", f(5, 6, 7), [2, 0, 1])
    add_case("nonzero", T(np.array([[0.0, 1.5, 0.0], [2.0, 0.0, -1.0]])), grad=False)
    add_case("nonzero", T(np.array([[0.0, 1.5], [2.0, 0.0]])), as_tuple=True, grad=False, label="tuple")
    add_case("masked_select", f(4, 3), T(_rng("m", 0).random((4, 3)) > 0.5))
    add_case("bincount", T(np.array([0, 3, 3, 1, 6])), grad=False)
    add_case("bincount", T(np.array([0, 3, 3, 1])), f(4), minlength=6, grad=False, label="weights")
    add_case("where", T(np.array([[True, False, True], [False, False, True]])), grad=False, label="nonzero")
    add_case("unique", T(np.array([[3, 1, 3], [0, 1, 7]])), return_counts=True, return_inverse=True, grad=False)
    add_case("getitem", f(5, 6), (T(np.array([0, 4])), T(np.array([1, 5]))), label="two-tensor-indices")


def _cases_more():
    for op in ("reciprocal", "log2", "log10", "softplus", "log_sigmoid", "sinh", "cosh", "atan"):
        add_case(op, f(5, 6, lo=0.5))
    for op in ("expm1", "relu6", "hardswish", "mish", "elu", "selu", "softsign", "tanhshrink", "hardsigmoid", "tan",
               "asinh"):
        add_case(op, f(5, 6))
    add_case("asin", T(_rng("u", 1).uniform(-0.9, 0.9, (5, 6))))
    add_case("acos", T(_rng("u", 2).uniform(-0.9, 0.9, (5, 6))))
    add_case("atanh", T(_rng("u", 3).uniform(-0.9, 0.9, (5, 6))))
    add_case("acosh", f(5, 6, lo=1.5))
    for op in ("ceil", "round", "trunc"):
        add_case(op, f(5, 6), grad=False)
    add_case("nan_to_num", T(np.array([[1.0, np.nan, -2.0], [np.inf, 0.5, -np.inf]])), posinf=9.0, neginf=-9.0)
    for op in ("isnan", "isinf", "isfinite"):
        add_case(op, T(np.array([[1.0, np.nan, -2.0], [np.inf, 0.5, -np.inf]])), grad=False)
    add_case("amax", f(5, 6), axis=1)
    add_case("amin", f(5, 6), axis=0, keepdim=True)
    add_case("prod", f(4, 3, lo=0.5), axis=1)
    add_case("any", T(_rng("b", 1).random((5, 3)) > 0.7), axis=0)
    add_case("all", T(_rng("b", 2).random((5, 3)) > 0.2), axis=1, keepdim=True)
    add_case("logsumexp", f(5, 6), axis=-1)
    add_case("norm", f(5, 6), p=2, axis=1)
    add_case("var", f(5, 6), axis=0)
    add_case("std", f(5, 6), axis=1, keepdim=True)
    add_case("mm", f(5, 6), f(6, 3))
    add_case("mul", f(5, 6), f(5, 6))
    add_case("outer", f(5), f(4))
    add_case("swiglu", f(5, 8), label="halves")
    add_case("swiglu", f(5, 4), f(5, 4), label="two")
    add_case("flip", f(5, 6, 2), [0, 2])
    add_case("roll", f(5, 6), 2, axis=1)
    add_case("roll", f(5, 3), 4, label="flat")
    add_case("tile", f(5, 3), [2, 1])
    add_case("tile", f(5, 3), [2, 1, 1], label="new-dim")
    add_case("unbind", f(3, 4, 2), axis=1)
    add_case("diagonal", f(2, 5, 4), offset=1, axis1=1, axis2=2)
    add_case("repeat_interleave", f(5, 3), 2, axis=0)
    add_case("expand_as", f(5, 1), f(5, 4))
    add_case("equal_all", f(5, 3), f(5, 3), grad=False)
    add_case("allclose", f(5, 3), f(5, 3), grad=False)
    add_case("masked_fill", f(5, 3), T(_rng("b", 3).random((5, 3)) > 0.5), 0.25)


def _cases_creation():
    add_case("full_like", f(5, 6), 2.0)
    add_case("zeros_like", f(5, 6))
    add_case("ones_like", f(5, 6), dtype="float32")
    add_case("arange", 7, creation=True, grad=False)
    add_case("arange", 1, 6, 2, creation=True, grad=False, label="step")
    add_case("arange", 0.0, 2.5, 0.5, creation=True, grad=False, label="float")
    add_case("full", [5, 6], 1.5, creation=True, grad=False)
    add_case("zeros", [5, 6], creation=True, grad=False)
    add_case("ones", [7], creation=True, grad=False)
    for op in ("rand", "randn", "uniform"):
        add_case(op, [5, 6], creation=True, grad=False)
    add_case("randint", 0, 9, [5, 6], creation=True, grad=False)


def _cases_optimizer():
    p32 = lambda *s, lo=None: T(f(*s, lo=lo).array.astype(np.float32))  # noqa: E731
    lr = T(np.array([0.1], np.float32), shard=False, grad=False)
    add_case("sgd", T(f(5, 6).array, partial=False, grad=False), T(np.array([0.1]), shard=False, grad=False),
             T(f(5, 6).array, grad=False))
    noP = dict(partial=False, grad=False)
    add_case("adamw", T(p32(5, 6).array, **noP), T(p32(5, 6).array, grad=False), lr,
             T(p32(5, 6).array, **noP), T(p32(5, 6, lo=0.1).array, **noP), None,
             T(np.array([0.9], np.float32), shard=False, grad=False),
             T(np.array([0.999], np.float32), shard=False, grad=False), None, None,
             0.9, 0.999, 1e-8, 1.0, 0.01, True, False, 1000, False, False, False, rtol=1e-5, atol=1e-6,
             samples_2d=16)


if __name__ == "__main__":
    sys.exit(main())
