"""Chains of ops on distributed tensors against the same chain on full tensors.

    python -m spmd_rules.validation.chains --n 2000 --seed 0        # a table of outcomes by cause

A chain (``build_chain(seed)``) is 2-6 calls of ``chain_ops.OPS`` (views, slicing and split, broadcasting
binaries, reductions then elementwise with the input, joins, in-place, where, matmul, expand, gather) on
random shapes (uneven sizes included), every input placed at random (R or S(d) per mesh dim) on a 1-d mesh
of 4 or a 2x2 mesh. ``run_chain`` runs it once on full tensors in one process and once on DistTensors
under ``ap.simulate(world_size=4)``, then compares the output (every rank's local, assembled, replicas
checked) and the gradient of every float input under the backward of a random weighted sum of the output.
Outcomes: ``ok``, ``refused`` (a typed error naming what is unsupported), ``wrong value``, ``wrong grad``,
``crash`` (any other exception where the full-tensor chain runs)."""
from __future__ import annotations

import dataclasses
import traceback

import numpy as np
import paddle

from .chain_ops import OPS

MESHES = ([4], [2, 2])
MAX_NUMEL = 2048


@dataclasses.dataclass
class Step:
    op: str
    params: dict
    extras: list            # [(name, array, placements)]


@dataclasses.dataclass
class Chain:
    seed: int
    mesh_shape: list
    x: np.ndarray
    x_placements: tuple
    steps: list

    def describe(self) -> str:
        s = [f"x{list(self.x.shape)}{_pstr(self.x_placements)}"]
        for st in self.steps:
            ex = ", ".join(f"{n}{list(a.shape)}{_pstr(p)}" for n, a, p in st.extras)
            s.append(f"{st.op}({st.params}{'; ' + ex if ex else ''})")
        return f"seed {self.seed} mesh {self.mesh_shape}: " + " -> ".join(s)


def _pstr(pl) -> str:
    return "[" + ",".join("R" if p is None else "P(sum)" if p == "P" else f"S({p})" for p in pl) + "]"


def _rand_shape(rng) -> list:
    return [int(rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 9])) for _ in range(int(rng.integers(1, 4)))]


def _rand_placements(rng, shape, ndim_mesh, integer=False) -> tuple:
    """One entry per mesh dim: None (R), "P" (Partial(sum): the value on coordinate 0, zeros elsewhere) or
    the tensor dim sharded (any size, uneven included)."""
    if integer:
        return tuple(0 if shape and rng.random() < 0.5 else None for _ in range(ndim_mesh))
    out = []
    for _ in range(ndim_mesh):
        u = rng.random()
        out.append(int(rng.integers(len(shape))) if shape and u < 0.6 else "P" if u > 0.9 else None)
    return tuple(out)


def build_chain(seed: int) -> Chain:
    rng = np.random.default_rng(seed)
    mesh_shape = list(MESHES[int(rng.integers(len(MESHES)))])
    x = rng.standard_normal(_rand_shape(rng)).astype("float32")
    chain = Chain(seed, mesh_shape, x, _rand_placements(rng, x.shape, len(mesh_shape)), [])
    cur = paddle.to_tensor(x)
    names = sorted(OPS)
    target, tries = int(rng.integers(2, 7)), 0
    while len(chain.steps) < target and tries < 60:
        tries += 1
        op = names[int(rng.integers(len(names)))]
        g = OPS[op][0](rng, list(cur.shape))
        if g is None:
            continue
        params, extras = g
        try:
            with paddle.no_grad():
                out = OPS[op][1](cur, [paddle.to_tensor(a) for _, a in extras], **params)
        except Exception:       # noqa: BLE001 - a call paddle itself refuses is not generated
            continue
        if out.size > MAX_NUMEL or out.dtype != paddle.float32:
            continue
        ex = [(n, a, _rand_placements(rng, a.shape, len(mesh_shape), a.dtype.kind == "i")) for n, a in extras]
        chain.steps.append(Step(op, params, ex))
        cur = out
    return chain


def _forward(chain: Chain, make):
    """Run the chain with ``make(array, placements, grad)`` building each input; (output, float inputs)."""
    x = make(chain.x, chain.x_placements, True)
    leaves, cur = [x], x
    for st in chain.steps:
        ex = [make(a, p, a.dtype.kind == "f") for _, a, p in st.extras]
        leaves += [e for (_, a, _), e in zip(st.extras, ex) if a.dtype.kind == "f"]
        cur = OPS[st.op][1](cur, ex, **st.params)
    return cur, leaves


def _weights(chain: Chain, shape):
    return np.random.default_rng(chain.seed + 7).standard_normal(shape).astype(chain.x.dtype)


def in_float64(chain: Chain) -> Chain:
    """The same chain on float64 inputs: a float32 mismatch that vanishes here is rounding (an ill-conditioned
    chain, e.g. layer_norm of values scaled by their own sum), not a layout bug."""
    steps = [Step(st.op, st.params, [(n, a.astype("float64") if a.dtype.kind == "f" else a, p)
                                     for n, a, p in st.extras]) for st in chain.steps]
    return dataclasses.replace(chain, x=chain.x.astype("float64"), steps=steps)


def reference(chain: Chain):
    def make(a, p, grad):
        t = paddle.to_tensor(a)
        t.stop_gradient = not grad
        return t
    out, leaves = _forward(chain, make)
    w = paddle.to_tensor(_weights(chain, out.shape))
    (out * w).sum().backward()
    return out.numpy(), [None if t.grad is None else t.grad.numpy() for t in leaves]


def distributed(chain: Chain):
    import autoparallel as ap
    from autoparallel.mesh import mesh_from_shape
    from autoparallel.testing.check import assemble

    with ap.simulate(world_size=4):
        mesh = mesh_from_shape(chain.mesh_shape, ["a", "b"][:len(chain.mesh_shape)])

        def make(a, p, grad):
            pl = [ap.Replicate() if d is None else ap.Partial("sum") if d == "P" else ap.Shard(d) for d in p]
            t = ap.shard_tensor(paddle.to_tensor(a), mesh, pl)
            t.stop_gradient = not grad
            return t
        out, leaves = _forward(chain, make)
        value = assemble(out.locals, out.spec) if hasattr(out, "locals") else out.numpy()
        w = paddle.to_tensor(_weights(chain, value.shape))
        (out * w).sum().backward()
        grads = [None if t.grad is None else assemble(t.grad.locals, t.grad.spec) for t in leaves]
        return value, grads


def _close(a, b) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and np.allclose(a, b, rtol=2e-4, atol=2e-4 * (1 + np.abs(b).max(initial=0)))


def _crash(e) -> tuple:
    tb = traceback.extract_tb(e.__traceback__)[-1]
    return "crash", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''} " \
                    f"@ {tb.filename.split('/')[-1]}:{tb.lineno}"


def run_chain(chain: Chain) -> tuple:
    """(outcome, detail): outcome one of ok / refused / wrong value / wrong grad / crash / artefact."""
    try:
        ref_out, ref_grads = reference(chain)
    except Exception as e:      # noqa: BLE001
        return "artefact", f"full-tensor chain fails: {type(e).__name__}: {e}"
    if not all(np.isfinite(a).all() for a in [ref_out] + [g for g in ref_grads if g is not None]):
        return "artefact", "the full-tensor chain gives inf/nan"
    try:
        out, grads = distributed(chain)
    except NotImplementedError as e:
        return "refused", f"NotImplementedError: {str(e).splitlines()[0][:200]}"
    except AssertionError as e:
        if "replicas disagree" in str(e) or "do not cover" in str(e):
            return "wrong value", f"layout broken: {e}"
        return _crash(e)
    except Exception as e:      # noqa: BLE001
        return _crash(e)
    if any(st.op == "inplace" and st.params["form"] == "view_write" for st in chain.steps):
        grads = ref_grads = []          # paddle 3.3's gradient through an in-place write on a view misses the write
    outcome = _compare(out, grads, ref_out, ref_grads)
    if outcome[0] != "ok" and chain.x.dtype == np.float32 and "missing" not in outcome[1]:
        c64 = in_float64(chain)
        if _compare(*distributed(c64), *reference(c64))[0] == "ok":
            return "artefact", f"float32 rounding ({outcome[0]}: {outcome[1]}); float64 agrees"
    return outcome


def _compare(out, grads, ref_out, ref_grads) -> tuple:
    if not _close(out, ref_out):
        return "wrong value", f"shape {np.shape(out)} vs {np.shape(ref_out)}"
    for i, (g, rg) in enumerate(zip(grads, ref_grads)):
        if (g is None) != (rg is None) or (g is not None and not _close(g, rg)):
            return "wrong grad", f"input {i}: {'missing' if g is None else 'differs'}"
    return "ok", ""


def main(argv=None) -> int:
    import argparse
    import collections

    from tqdm import tqdm

    ap_ = argparse.ArgumentParser(description="chains of ops on DistTensors vs full tensors")
    ap_.add_argument("--n", type=int, default=500)
    ap_.add_argument("--seed", type=int, default=0)
    args = ap_.parse_args(argv)
    counts, first = collections.Counter(), {}
    for s in tqdm(range(args.seed, args.seed + args.n), desc="chains"):
        chain = build_chain(s)
        outcome, detail = run_chain(chain)
        counts[outcome] += 1
        if outcome != "ok":
            first.setdefault((outcome, detail[:90]), chain.describe())
    for (outcome, detail), desc in sorted(first.items()):
        print(f"{outcome}: {detail}\n    first: {desc}")
    print(" | ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return int(any(k in ("wrong value", "wrong grad", "crash") for k in counts))


if __name__ == "__main__":
    raise SystemExit(main())
