"""Runs on every rank (2; or 4 with the argument ``vs_paddle_native_programs4``, the program set on 2 x 2 meshes):
the same small user programs written against ``paddle.distributed`` (paddle's own
auto-parallel, dygraph on CPU over gloo) and against ``autoparallel``; reports per program and API the global
values, each explicitly placed tensor's local shard, the output placements, or the error raised.

Each program is a function of an ``Api`` (the module a user imports as ``dist``, plus the accessors a test reads
through: paddle's ``_local_value()`` and a reshard to Replicate, this project's ``.local`` / ``.full()``). The
result, per rank: {program: {"paddle": outcome, "ap": outcome}}, an outcome being {"error": "Type: message"},
{"skipped": why} (paddle not run: it would crash or hang the job) or {name: record}; a record is {"value",
"shape"} for a global value and also {"local", "local_shape", "placements", "explicit"} for a distributed tensor.
``compare`` (used by the test and by tools/check_vs_paddle_native.py) lists the differences of one program; the
tables below name the documented ones (docs/vs_paddle_native.md).
"""
import importlib
import re
import sys
import traceback

import numpy as np
import paddle
import paddle.distributed as pdist

import autoparallel as ap
from autoparallel.testing.launch import write_result
from vs_paddle_native_programs import ORACLES, PROGRAMS

ATOL = RTOL = 1e-6


# paddle 3.3.1 on CPU raises here (gloo has no all_to_all / reduce_scatter kernel; an uneven S(0) -> S(1)
# reshapes by the wrong sizes): ours runs and is checked against numpy
PADDLE_RAISES = {
    **{n: "Unimplemented cpu kernel for all_to_all" for n in (
        "reshard_S0_to_S1", "reshard_S1_to_S0", "reshard_S1_to_S0_uneven", "op_concat0_S0")},
    **{n: "Unimplemented cpu kernel for CReduceScatterOp" for n in (
        "reshard_P_to_S0", "reshard_P_to_S1", "reshard_P_to_S0_uneven", "reshard_P_to_S1_uneven",
        "reshard_Pavg_to_S0", "reshard_PS1_to_S0S1_2x1", "matmul_S0_S1")},
    "reshard_S0_to_S1_uneven": "The 'shape' in ReshapeOp is invalid",
}
# paddle's value is wrong: P(max) zero-filled on rank 1 (max(x, 0)); logsumexp / 2-norm over a split dim taken as
# a Partial sum; the mean / var / mean cross entropy of uneven shards averaged per rank; clip_grad_norm_ of
# tensor-parallel parameters
PADDLE_WRONG = {"shard_tensor_1d_Pavg_Pmax", "reshard_Pmax_to_R", "op_norm_S0", "op_logsumexp_S1", "mean_uneven",
                "clip_grad_norm_by_hand", "cross_entropy_uneven"}


# deliberate differences of ours (docs/vs_paddle_native.md)
OURS_DIFFER = {
    "shard_tensor_inputs": "shard_tensor(tensor, ..., stop_gradient=False) is honoured (paddle keeps the tensor's)",
    "set_get_mesh": "set_mesh / get_mesh are refused by name (AttributeError): pass the mesh to each call",
    "from_local_not_a_layout": "ours raises ValueError on every rank (paddle not run: it hangs)",
    "bad_to_local_other_placements": "dtensor_to_local with placements other than the tensor's raises ValueError "
                                     "(paddle returns the local value as is)",
    "bad_shard_dim_out_of_range": "ours raises ValueError (paddle not run: it segfaults)",
    "parallelize_plan_typo": "a plan key naming no layer raises PlanError (paddle trains every layer replicated)",
    **{n: "a reshard to Partial(avg / max) is that Partial, every rank holding the value (paddle's is Partial(sum), "
          "rank 1 holding zeros); the values agree" for n in ("reshard_R_to_Pavg", "reshard_R_to_Pmax",
                                                               "reshard_S0_to_Pavg")},
    "optimizer_momentum_dp": "paddle's ShardOptimizer refuses Momentum (AssertionError); ours trains it as one "
                             "process does",
}


def program_set(module: str = ""):
    """The programs and their tables: (PROGRAMS, ORACLES, PADDLE_RAISES, PADDLE_WRONG, OURS_DIFFER) of the 2-rank
    set (``module`` empty) or of the module named (``vs_paddle_native_programs4``: the 4-rank set)."""
    if not module:
        return PROGRAMS, ORACLES, PADDLE_RAISES, PADDLE_WRONG, OURS_DIFFER
    m = importlib.import_module(module)
    return m.PROGRAMS, m.ORACLES, m.PADDLE_RAISES, m.PADDLE_WRONG, m.OURS_DIFFER


def documented(name: str, module: str = "") -> str:
    """Why program ``name`` may differ from paddle (empty: it must be equal)."""
    programs, _, raises, wrong, differ = program_set(module)
    if name in raises:
        return f"paddle raises on CPU ({raises[name]}); ours checked against numpy"
    if name in wrong:
        return "paddle's value is wrong; ours checked against numpy"
    skip = getattr(next(p for p in programs if p.__name__ == name), "paddle_skip", None)
    if skip and name not in differ:
        return f"paddle not run ({skip}); ours checked against numpy"
    return differ.get(name, "")


class Api:
    """What a program calls as ``dist`` and how the result is read back."""

    def __init__(self, name):
        self.name = name
        self.D = pdist if name == "paddle" else ap
        if name == "paddle":
            from paddle.distributed.auto_parallel import api as papi
            self.from_local, self.to_local = papi.dtensor_from_local, papi.dtensor_to_local
        else:
            self.from_local, self.to_local = ap.dtensor_from_local, ap.dtensor_to_local

    def is_dist(self, t):
        return bool(t.is_dist()) if self.name == "paddle" else ap.is_dist(t)

    def local(self, t):
        if self.name == "paddle":
            return t._local_value()
        return t.local if isinstance(t, ap.DistTensor) else t      # a DistParameter's data is its shard

    def grad(self, p):
        """A parameter's gradient as a distributed tensor: paddle's ``p.grad``; a ``DistParameter``'s ``p.grad`` is
        its local shard's gradient (a plain tensor, by design: docs/api_call_forms.md), laid out as ``p``."""
        if self.name == "paddle" or p.grad is None or not ap.is_dist(p):
            return p.grad
        return ap.dtensor_from_local(p.grad, p.mesh, p.placements, global_shape=p.global_shape)

    def full(self, t):
        if self.name == "paddle":
            return pdist.reshard(t, t.process_mesh, [pdist.Replicate()] * len(t.placements))._local_value()
        return t.full()


def placements_text(ps) -> str:
    """``S(0)``, ``R``, ``P(sum)``: paddle's placements and ours written alike."""
    out = []
    for p in ps:
        if p.is_shard():          # (paddle's co-shard of [S(0), S(0)] prints as "Shard(dim=0, shard_order=0)")
            dim = p.get_dim() if hasattr(p, "get_dim") else re.search(r"dim=(-?\d+)", str(p)).group(1)
            out.append(f"S({dim})")
        elif p.is_replicated():
            out.append("R")
        else:
            rt = p.reduce_type
            rt = rt() if callable(rt) else rt
            out.append(f"P({str(rt).split('.')[-1].replace('kRed', '').lower()})")
    return "[" + ",".join(out) + "]"


def record(api, t, explicit=False):
    if t is None:
        return {"value": None}
    if isinstance(t, (int, float, bool, list, tuple)):
        return {"value": np.asarray(t, dtype="float64").tolist(), "shape": list(np.shape(t))}
    if not api.is_dist(t):
        v = t.numpy()
        v = v.reshape(list(t.shape)) if v.size == int(np.prod(t.shape)) else v
        return {"value": v.tolist(), "shape": list(v.shape)}
    full, loc = api.full(t).numpy(), api.local(t).numpy()
    shape = list(t.global_shape if isinstance(t, ap.DistParameter) else t.shape)    # a DistParameter's is local
    if full.size == int(np.prod(shape)):
        full = full.reshape(shape)                  # paddle reshards a 0-d Partial to a [1] tensor
    return {"value": full.tolist(), "shape": shape, "local": loc.tolist(), "local_shape": list(loc.shape),
            "placements": placements_text(t.placements), "explicit": bool(explicit)}


def run_one(program, name):
    api = Api(name)
    paddle.seed(2024)
    np.random.seed(2024)
    try:
        got = program(api)
        return {k: record(api, *(v if isinstance(v, tuple) else (v,))) for k, v in got.items()}
    except Exception as e:                                  # noqa: BLE001  (reported per program)
        return {"error": f"{type(e).__name__}: {str(e)[:400]}", "trace": traceback.format_exc()[-1200:]}


def run_both(prog):
    """Both APIs' outcomes; a program paddle cannot run on 2 CPU ranks without crashing or hanging the job
    (``prog.paddle_skip``: why) runs ours only."""
    skip = getattr(prog, "paddle_skip", None)
    return {"paddle": {"skipped": skip} if skip else run_one(prog, "paddle"), "ap": run_one(prog, "ap")}


def oracle(name: str, rank: int, oracles=None) -> dict:
    """numpy's values of program ``name`` on ``rank`` where paddle's cannot be compared (ORACLES)."""
    fn = (ORACLES if oracles is None else oracles)[name]
    return fn(rank) if fn.__code__.co_argcount else fn()


def oracle_diffs(name: str, ours: dict, rank: int, oracles=None) -> list:
    """Ours against numpy (empty: equal)."""
    if "error" in ours:
        return [f"autoparallel raised {ours['error']}"]
    return [f"{k}: differs from numpy" for k, v in oracle(name, rank, oracles).items()
            if not _close(ours[k]["value"], v)]


def layout_local(a, placements: str, mesh_shape, rank: int, mesh_ids=None):
    """The local shard of global ``a`` on ``rank`` of a mesh of ``mesh_shape`` (ranks in row-major order, or as
    ``mesh_ids`` lays them out) in the layout ``"[S(0),R]"``: ceil-division chunks (mesh dims sharding one tensor
    dim split it in mesh-dim order), a Partial held whole by the first rank of its mesh dim."""
    from autoparallel.core.placement import chunk_range

    a = np.asarray(a)
    coords = np.unravel_index(rank, mesh_shape) if mesh_ids is None else np.argwhere(np.asarray(mesh_ids) == rank)[0]
    for i, p in enumerate(placements.strip("[]").split(",")):
        if p.startswith("S("):
            d = int(p[2:-1])
            lo, hi = chunk_range(a.shape[d], mesh_shape[i], coords[i])
            a = np.take(a, range(lo, hi), axis=d)
        elif p.startswith("P") and coords[i] != 0:
            a = np.zeros_like(a)
    return a


def run_all(names=None, module: str = ""):
    """{program: both outcomes} of the program set ``module`` (program_set); paddle's global mesh (its
    ``set_mesh``, also set by its ``parallelize``) is put back afterwards, so the jobs after this one in a shared
    launch do not inherit it."""
    out, mesh = {}, pdist.auto_parallel.get_mesh()
    try:
        for prog in program_set(module)[0]:
            if not names or prog.__name__ in names:
                out[prog.__name__] = run_both(prog)
    finally:
        pdist.auto_parallel.set_mesh(mesh)
    return out


def _close(a, b):
    a, b = np.asarray(a, dtype="float64"), np.asarray(b, dtype="float64")
    return a.shape == b.shape and np.allclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)


def compare(outcome: dict) -> list:
    """The differences between paddle's and our outcome of one program on one rank (empty: equal)."""
    p, o = outcome["paddle"], outcome["ap"]
    if "skipped" in p:
        return []
    if "error" in p or "error" in o:
        if "error" in p and "error" in o:
            return []
        return [f"paddle: {p.get('error', 'ran')}; autoparallel: {o.get('error', 'ran')}"]
    diffs = [f"{k}: missing in {'autoparallel' if k in p else 'paddle'}" for k in sorted(set(p) ^ set(o))]
    for k in sorted(set(p) & set(o)):
        a, b = p[k], o[k]
        if a["value"] is None or b["value"] is None:
            if (a["value"] is None) != (b["value"] is None):
                diffs.append(f"{k}: None on one side only (paddle {a['value'] is None}, ours {b['value'] is None})")
            continue
        if not _close(a["value"], b["value"]):
            diffs.append(f"{k}: global value differs (paddle shape {a['shape']}, ours {b['shape']})")
        if a.get("explicit") and "local" in b and not _close(a["local"], b["local"]):
            diffs.append(f"{k}: local shard differs (paddle {a['local_shape']} {a['placements']}, "
                         f"ours {b['local_shape']} {b['placements']})")
        elif a.get("explicit") and "local" not in b:
            diffs.append(f"{k}: paddle gives a distributed tensor {a['placements']}, ours a plain tensor")
    return diffs


def summary(outcome: dict) -> str:
    """One table cell per API: the error type or ``ok`` with the output placements."""
    def cell(x):
        if "skipped" in x:
            return "not run"
        if "error" in x:
            return x["error"].split(":")[0]
        return "ok " + " ".join(v["placements"] for v in x.values() if "placements" in v)[:60]
    return cell(outcome["paddle"]), cell(outcome["ap"])


if __name__ == "__main__":               # argv: the program set's module (none: the 2-rank set)
    ap.init_parallel_env()
    write_result(run_all(module=sys.argv[1] if len(sys.argv) > 1 else ""))
