"""Sample calls of the rule validator: tensor arguments (``T``), calls (``Case``) and their registry."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import numpy as np

from .local_arrays import _rng


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
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, p in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, p)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


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
