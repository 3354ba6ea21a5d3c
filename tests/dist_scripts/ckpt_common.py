"""Ground truth shared by the checkpoint tests and workers: full tensors, layouts, and checks.

A layout maps each tensor name to its placements string on a given mesh; ``build_state`` shards the full
tensors (or zeros, for a load target) accordingly and ``check_state`` compares every held shard with the
slice of the full tensor the rank must hold (for Partial(sum): the value on coordinate 0, zeros elsewhere).
"""
import numpy as np
import paddle

import autoparallel as ap
from autoparallel.placement import parse_placements
from autoparallel.testing.check import expected_local

SHAPES = {"w": ((8, 6), "float32"), "v": ((7, 5), "float32"), "u": ((5, 3), "float64"),
          "p": ((4, 4), "float32"), "e": ((3, 2), "float32"), "ids": ((5, 2), "int64"),
          "bias": ((6,), "float32")}
PARAMS = {"bias"}                  # built as DistParameters

# saved under DP2 x TP2 on mesh [[0, 1], [2, 3]]
DP2_TP2 = {"w": "R,S(1)", "v": "S(0),S(0)", "u": "S(1),S(0)", "p": "P(sum),R", "e": "S(0),R",
           "ids": "S(0),R", "bias": "R,S(0)"}
TP2 = {"w": "S(0)", "v": "R", "u": "S(1)", "p": "P(sum)", "e": "S(0)", "ids": "R", "bias": "S(0)"}
DP4 = {"w": "S(0)", "v": "S(1)", "u": "R", "p": "S(0)", "e": "S(0)", "ids": "S(1)", "bias": "S(0)"}
MESH_2X4 = {"w": "S(0),S(1)", "v": "S(1),S(0)", "u": "R,S(0)", "p": "S(1),P(sum)", "e": "S(1),S(1)",
            "ids": "S(0),S(0)", "bias": "S(0),R"}


def full_tensors(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, dtype) in SHAPES.items():
        if dtype.startswith("int"):
            out[name] = rng.integers(-1000, 1000, size=shape).astype(dtype)
        else:
            out[name] = rng.standard_normal(shape).astype(dtype)
    return out


def build_state(mesh, layout: dict, full: dict = None, extras: bool = True) -> dict:
    """Tensors of ``layout`` on ``mesh`` holding ``full`` (zeros when None), plus plain entries."""
    model = {}
    for name, placements in layout.items():
        shape, dtype = SHAPES[name]
        value = full[name] if full is not None else np.zeros(shape, dtype)
        pl = list(parse_placements(placements))
        if name in PARAMS:
            t = paddle.create_parameter(list(shape), dtype)
            t.set_value(value)
        else:
            t = paddle.to_tensor(value)
        model[name] = ap.shard_tensor(t, mesh, pl)
    state = {"model": model}
    if extras:
        state["plain"] = paddle.to_tensor(full["w"] if full is not None else np.zeros((8, 6), "float32"))
        state["host"] = {"array": np.arange(5.0) if full is not None else np.zeros(5)}
        state["loader"] = {"epoch": 2 if full is not None else 0, "index": 640 if full is not None else 0}
    return state


def check_state(state: dict, full: dict) -> list:
    """Mismatches between every held shard of ``state`` and the full ground truth (empty: all equal)."""
    bad = []
    for name, t in state["model"].items():
        spec = t.spec
        for rank, local in t.locals.items():
            coords = spec.mesh.coords_of(rank)
            want = expected_local(full[name], spec, coords)
            if any(p.is_partial() and coords[i] != 0 for i, p in enumerate(spec.placements)):
                want = np.zeros_like(want)          # Partial(sum): the value on coordinate 0, zeros elsewhere
            if local.numpy().shape != want.shape or not np.array_equal(local.numpy(), want):
                bad.append(f"{name} on rank {rank} ({spec})")
    if "plain" in state and not np.array_equal(state["plain"].numpy(), full["w"]):
        bad.append("plain")
    if "host" in state and not np.array_equal(state["host"]["array"], np.arange(5.0)):
        bad.append("host/array")
    if "loader" in state and state["loader"] != {"epoch": 2, "index": 640}:
        bad.append(f"loader {state['loader']}")
    return bad
