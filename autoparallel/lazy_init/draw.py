"""What a parameter's initialiser draws, found without drawing it.

Paddle's own initialiser runs once against the full-size lazy parameter while the few ops an
initialiser issues (``gaussian``, ``uniform``, ``truncated_gaussian_random``, ``full``, ``full_``,
``assign_value_``, ``cast``) are recorded instead of executed. The result is the op and its arguments
exactly as paddle computed them from the full shape (fan-in / fan-out, gain, fp16 handling), so the
values can then be produced in chunks by replaying that op over pieces of the flattened tensor.

An initialiser that issues anything else (Orthogonal, Dirac, Bilinear), or one with its own fixed
``seed`` (its op restarts its own engine on every call, so chunks would not continue one stream), yields
``FullDraw``: the whole parameter is initialised at once and sliced.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import numpy as np
import paddle

from autoparallel import patches
from autoparallel.compat import C_OPS as _C_ops
from autoparallel.compat import EagerParamBase

RANDOM_OPS = ("gaussian", "uniform", "truncated_gaussian_random")
_SEED_ARG = {"gaussian": 2, "uniform": 3, "truncated_gaussian_random": 2}     # index after the shape
_RECORDED = RANDOM_OPS + ("full", "full_", "assign_value_", "cast")


@dataclass
class RandomDraw:
    """A random op whose CPU kernel continues the global generator's stream call after call."""
    op: str
    args: tuple              # the op's arguments after the shape
    cast: object = None      # dtype the values are cast to afterwards (fp16 / bf16 parameters)

    def values(self, n: int):
        out = getattr(_C_ops, self.op)([n], *self.args)
        return _C_ops.cast(out, self.cast) if self.cast is not None else out


@dataclass
class ConstantDraw:
    value: float
    dtype: object

    def fill(self, n: int):
        return paddle.full([n], self.value, dtype=self.dtype)


@dataclass
class ArrayDraw:
    """Assign / NumpyArrayInitializer: the values are given (already in host memory)."""
    array: np.ndarray
    dtype: object
    cast: object = None

    def values_at(self, index):
        out = paddle.to_tensor(self.array[index].reshape([-1]), dtype=self.dtype)
        return _C_ops.cast(out, self.cast) if self.cast is not None else out


@dataclass
class FullDraw:
    """Fallback: run the initialiser on a full-size tensor."""
    reason: str


class _Pending:
    """Stands in for an op's output while recording."""

    def __init__(self, log, draw):
        self._log, self.draw = log, draw

    def _share_underline_tensor_to(self, _var):
        self._log.shared = True


class _Log:
    def __init__(self, var):
        self.var, self.draw, self.shared, self.unexpected = var, None, False, None

    def record(self, op, args):
        if op == "cast":
            x, dtype = args[0], args[1]
            src = x.draw if isinstance(x, _Pending) else (self.draw if x is self.var else None)
            if not isinstance(src, (RandomDraw, ArrayDraw)):
                self.unexpected = "a cast of a value that is not a recorded draw"
                return _Pending(self, None)
            src.cast = dtype
            return _Pending(self, src)
        if self.draw is not None:
            self.unexpected = f"a second op ({op})"
            return _Pending(self, None)
        if op in RANDOM_OPS:
            self.draw = RandomDraw(op, tuple(args[1:]))
            return _Pending(self, self.draw)
        if op == "full":                     # full(shape, value, dtype, place)
            self.draw = ConstantDraw(float(args[1]), args[2])
            return _Pending(self, self.draw)
        if op == "full_":                    # full_(var, shape, value, dtype, place): in place on var
            self.draw, self.shared = ConstantDraw(float(args[2]), args[3]), True
            return None
        # assign_value_(var, shape, dtype, values, place): in place on var
        shape, dtype, values = args[1], args[2], args[3]
        self.draw = ArrayDraw(np.asarray(values).reshape(shape), dtype)
        self.shared = True
        return None


@contextlib.contextmanager
def _recording(log: _Log):
    me = threading.get_ident()
    saved = {name: getattr(_C_ops, name) for name in _RECORDED}

    def recorder(name):
        real = saved[name]

        def op(*args, **kwargs):
            if threading.get_ident() != me:
                return real(*args, **kwargs)
            return log.record(name, args)
        return op

    with patches.swapped(_C_ops, {name: recorder(name) for name in _RECORDED}):
        yield


def record(origin: EagerParamBase):
    """The draw that ``origin``'s recorded initialiser (``origin._init_func``) would make."""
    init = origin._init_func
    if init is None:
        raise ValueError(f"parameter {origin.name} has no recorded initializer: it was not created under "
                         f"paddle.LazyGuard or it was initialised already")
    stand_in = EagerParamBase(list(origin.shape), origin.dtype, name=origin.name)
    log = _Log(stand_in)
    try:
        with _recording(log), paddle.no_grad():
            init(stand_in, None)
    except Exception as e:      # an initialiser that computes on its draw (QR, eye, ...): use it whole
        return FullDraw(f"{type(e).__name__} while recording: {e}")
    if log.unexpected or log.draw is None or not log.shared:
        return FullDraw(log.unexpected or "no recognised initialisation op")
    d = log.draw
    if isinstance(d, RandomDraw) and int(d.args[_SEED_ARG[d.op]]) != 0:
        return FullDraw(f"{d.op} with a fixed seed {d.args[_SEED_ARG[d.op]]}")
    return d


def run_full(origin: EagerParamBase):
    """The whole initial value of ``origin`` (the fallback; allocates the full tensor)."""
    tmp = EagerParamBase(list(origin.shape), origin.dtype, name=origin.name)
    with paddle.no_grad():
        origin._init_func(tmp, None)
    return tmp
