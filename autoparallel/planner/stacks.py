"""A model priced as the sum of its stacks, for models the language-model reading cannot trace (a
vision-language model's vision tower + text decoder, an encoder-decoder's encoder + decoder).

    stacks = read_stacks(model, tp)                     # [Stack], one per outermost LayerList of blocks
    table = price_grid(model, cluster, batch, seq, world, allowed)   # [Priced], cheapest first

A stack is read off its layers, not a trace: its blocks' Linear weights give the matmul FLOPs per token
(2 x weight elements, forward; backward twice that), the default plan at degree ``tp`` (names, then
structure: parallel/tp_structure.py) says which Linears are split, so which parameters divide by ``tp``
and how many all_reduces a step pays (one per row-parallel Linear in the forward, one per column-parallel
Linear in the backward, each of ``tokens x width`` floats). Linears outside the stacks (embedding heads,
mergers, projectors) are priced the same way. Step time of dp x tp:

    3 * 2 * tokens_per_rank * (split / tp + replicated) / (peak * gemm_efficiency)       compute
  + sum of the TP all_reduces over tp ranks                                              tensor parallel
  + one all_reduce of the gradients (split / tp + replicated parameters) over dp ranks   data parallel

with ``tokens_per_rank = batch / dp * seq``: every stack is priced at the sequence length given (a vision
tower's patch count per sample is taken as ``seq`` too: an estimate, said so in the explanation). The
eager runtime's per-op cost is not in this sum (it is the same op count for every dp; tp adds a collective
per split pair, priced above).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

FLOAT_BYTES = 4


@dataclass(frozen=True)
class Stack:
    name: str
    blocks: int
    params: int            # parameters of the blocks
    split_params: int      # of which in Linears the plan splits at this tp
    linear_params: int     # weight elements of the blocks' Linears (FLOPs per token / 2)

    def short(self) -> str:
        return (f"{self.name}: {self.blocks} blocks, {self.params:,} parameters "
                f"({self.split_params:,} split by the plan)")


@dataclass(frozen=True)
class Priced:
    dp: int
    tp: int
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.dp_comm_s

    def short(self) -> str:
        return (f"dp={self.dp} x tp={self.tp}: {self.step_s * 1e3:.3f} ms (compute {self.compute_s * 1e3:.3f}, "
                f"tp all_reduce {self.tp_comm_s * 1e3:.3f}, dp gradients {self.dp_comm_s * 1e3:.3f})")


def _linears(layer):
    from autoparallel.parallel.tp_structure import _linear_shape

    return [(n, l, _linear_shape(l)) for n, l in layer.named_sublayers() if _linear_shape(l) is not None]


def find_stacks(model) -> list:
    """[(name, LayerList)] of the outermost LayerLists whose items all hold a Linear (experts excluded)."""
    import paddle

    out = []
    for name, layer in model.named_sublayers():
        if not isinstance(layer, paddle.nn.LayerList) or not len(layer) or "experts" in name.split("."):
            continue
        if any(name.startswith(n + ".") for n, _ in out):
            continue
        if all(_linears(b) for b in layer):
            out.append((name, layer))
    return out


def read_stacks(model, tp: int, plan: dict = None) -> list:
    """[Stack] of ``model`` with the Linears ``plan`` (default: the default plan at ``tp``) splits."""
    from autoparallel.parallel.tp_plans import default_plan

    plan = default_plan(model, tp) if plan is None else plan
    out = []
    for name, lst in find_stacks(model):
        lins = _linears(lst)
        split = sum(math.prod(s) for n, _, s in lins if f"{name}.{n}" in plan)
        params = sum(math.prod(p.shape) for p in lst.parameters())
        out.append(Stack(name, len(lst), params, split, sum(math.prod(s) for _, _, s in lins)))
    return out


def _comm_widths(model, plan: dict) -> tuple:
    """(sum of widths all-reduced per token by the TP plan in one step, split weight elements, other weight
    elements): a row-parallel Linear reduces its output in the forward, a column-parallel one its input
    gradient in the backward."""
    from autoparallel.parallel.tensor_parallel import RowWiseParallel

    widths, split, rest = 0, 0, 0
    for n, layer, (i, o) in _linears(model):
        style = plan.get(n)
        if style is None:
            rest += i * o
            continue
        split += i * o
        widths += o if isinstance(style, RowWiseParallel) else i
    return widths, split, rest


def price(model, cluster, batch: int, seq: int, dp: int, tp: int, efficiency: float) -> Priced:
    """The step time of dp x tp (module docstring); ``model``'s default plan at ``tp`` decides the split."""
    from autoparallel.parallel.tp_plans import default_plan
    from autoparallel.planner.cost_model import affine_seconds

    plan = default_plan(model, tp) if tp > 1 else {}
    widths, split, rest = _comm_widths(model, plan)
    tokens = batch // dp * seq
    others = sum(math.prod(p.shape) for p in model.parameters()) - split - rest
    rate = cluster.device.flops("float32") * efficiency
    compute = 6.0 * tokens * (split / tp + rest) / rate
    tp_comm = 0.0
    if tp > 1:
        lat, per_byte = affine_seconds(cluster, "all_reduce", tp, range(tp))
        calls = sum(1 for s in plan.values() if s is not None)
        tp_comm = calls * lat + widths * tokens * FLOAT_BYTES * per_byte
    dp_comm = 0.0
    if dp > 1:
        lat, per_byte = affine_seconds(cluster, "all_reduce", dp, range(0, dp * tp, tp))
        dp_comm = lat + (split / tp + rest + others) * FLOAT_BYTES * per_byte
    return Priced(dp, tp, compute, tp_comm, dp_comm)


def price_grid(model, cluster, batch: int, seq: int, world: int, allowed: dict, efficiency: float) -> list:
    """[Priced] of every dp x tp = world with ``batch % dp == 0`` and ``allowed[tp] is None``, cheapest first
    (ties: the larger dp)."""
    out = [price(model, cluster, batch, seq, world // tp, tp, efficiency) for tp, why in allowed.items()
           if why is None and batch % (world // tp) == 0]
    return sorted(out, key=lambda p: (p.step_s, -p.dp))


__all__ = ["Stack", "Priced", "find_stacks", "read_stacks", "price", "price_grid"]
