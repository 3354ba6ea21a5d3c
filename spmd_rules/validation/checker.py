"""One sample call checked on one mesh and layout: forward values, local shapes and input gradients."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

import spmd_rules
from autoparallel.placement import BlockShard, Replicate
from autoparallel.spec import DistSpec
from spmd_rules.registry import flatten_specs, replace_specs

from .case import T
from .local_arrays import _close, _np, _outputs, _paddle, _rng, _to_paddle, assemble, local_input
from .reference_ops import LOCAL_OPS


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
