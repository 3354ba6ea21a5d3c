"""paddle's copying entry points given a distributed tensor: ``paddle.to_tensor(d, dtype, place,
stop_gradient)`` (a new leaf with the same layout, as paddle copies a tensor) and ``paddle.assign(x, output)``
(a differentiable copy; with ``output`` a distributed tensor, written into it in its own layout)."""
from __future__ import annotations

import paddle

from autoparallel.dist_tensor import DistTensor, as_dist, is_dist, reshard, shard_tensor
from autoparallel.local_mode import local_mode
from autoparallel.spec import normalize_dtype


def to_tensor(data, dtype=None, place=None, stop_gradient=True):
    if not is_dist(data) and isinstance(data, (list, tuple)):     # [0-d tensors]: a new tensor of their values
        from autoparallel.dispatch_values import nested_values

        values = nested_values(data)
        with local_mode():
            return paddle.to_tensor(values, dtype=dtype, place=place, stop_gradient=stop_gradient)
    if not is_dist(data):
        raise TypeError(f"paddle.to_tensor: only the data may be distributed, got {type(data).__name__} data")
    d = as_dist(data)
    _check_place(d, place)
    with local_mode(), paddle.no_grad():
        locals_ = {r: t.detach().clone() for r, t in d.locals.items()}
        if dtype is not None and normalize_dtype(dtype) != d.spec.dtype:
            locals_ = {r: t.astype(normalize_dtype(dtype)) for r, t in locals_.items()}
    for t in locals_.values():
        t.stop_gradient = bool(stop_gradient)
    spec = d.spec if dtype is None else type(d.spec)(d.mesh, d.spec.placements, d.spec.shape,
                                                    normalize_dtype(dtype))
    return DistTensor(locals_, spec)


def as_tensor(data, dtype=None, device=None, requires_grad=False, pin_memory=False):
    """paddle's ``as_tensor`` of a distributed tensor: a copy in the same layout (paddle copies a tensor too)."""
    if pin_memory:
        raise NotImplementedError("paddle.as_tensor(pin_memory=True) of a distributed tensor: its shards stay where "
                                  "their ranks run")
    return to_tensor(data, dtype, device, stop_gradient=not requires_grad)


def asarray(obj, *, dtype=None, device=None, copy=None, requires_grad=False):
    """paddle's ``asarray`` of a distributed tensor: a copy in the same layout (paddle 3.3 copies a tensor even
    with ``copy=False``)."""
    return to_tensor(obj, dtype, device, stop_gradient=not requires_grad)


def _check_place(d, place) -> None:
    if place is None:
        return
    want = paddle.CPUPlace() if place == "cpu" else place
    if isinstance(want, str) or type(want) is not type(d.place):
        raise NotImplementedError(f"paddle.to_tensor of a distributed tensor to place={place!r}: its shards stay "
                                  f"where their ranks run ({d.place})")


def assign(x, output=None):
    if output is None:
        d = as_dist(x)
        return d * 1.0 if d.spec.dtype not in _INTS else _int_copy(d)      # differentiable for floats
    if not is_dist(output):
        raise NotImplementedError("paddle.assign of a distributed tensor into a plain output: gather it with "
                                  ".full() first, or give a distributed output")
    out = as_dist(output)
    src = as_dist(x) if is_dist(x) else shard_tensor(paddle.to_tensor(x), out.mesh, out.placements)
    if list(src.shape) != list(out.shape):
        raise ValueError(f"paddle.assign: the value has shape {list(src.shape)}, the output {list(out.shape)}")
    if paddle.is_grad_enabled() and type(output) is DistTensor and not (src.stop_gradient and out.stop_gradient):
        # paddle's assign_out_ is differentiable: the output's gradient flows to the value (a body such as
        # multigammaln_'s ``paddle.assign(f(x), x)``); the no_grad write below kept the output's old graph, whose
        # gradient is the identity (1.0 where paddle gives digamma sums)
        output[...] = src.astype(out.dtype) if src.dtype != out.dtype else src
        return output
    src = reshard(src, out.mesh, out.placements)
    from autoparallel.dist_tensor_forms import _writing

    with _writing(output), local_mode(), paddle.no_grad():   # a ZeRO parameter: its master chunks follow,
        for r, t in out.locals.items():                      # a released ZeRO-3 one is gathered for the write
            t.set_value(src.local_of(r).astype(t.dtype))
    return output


_INTS = ("int64", "int32", "int16", "int8", "uint8", "bool")


def _int_copy(d):
    with local_mode():
        return DistTensor({r: t.clone() for r, t in d.locals.items()}, d.spec)


# ---- a plain tensor given a distributed value: ``buf.set_value(d)`` / ``buf.copy_(d)`` -----------------------------------
def _global_value(value):
    """The whole value of a distributed ``value`` (gathered on every rank; a Partial reduced), detached."""
    with paddle.no_grad():
        return as_dist(value).full().detach()


_WRAPPERS: set = set()        # the wrappers install() put on paddle.Tensor (its idempotence check)


def install() -> None:
    """``plain.set_value(d)`` and ``plain.copy_(d)`` write the distributed value's global value into the plain tensor
    (a buffer updated in the forward with a batch statistic: ``self.running.set_value(0.9 * self.running + 0.1 *
    h.mean(0))``), as ``plain[:] = d`` does; paddle raised an AssertionError / "must be Tensor, but got
    DistTensor". Idempotent; a distributed parameter keeps its own forms (dist_tensor_forms)."""
    set_value, copy_ = paddle.Tensor.set_value, paddle.Tensor.copy_
    if set_value in _WRAPPERS:
        return

    def plain_set_value(self, value):
        return set_value(self, _global_value(value) if is_dist(value) and not is_dist(self) else value)

    def plain_copy_(self, value, *args, **kwargs):
        return copy_(self, _global_value(value) if is_dist(value) and not is_dist(self) else value, *args, **kwargs)

    for fn, orig in ((plain_set_value, set_value), (plain_copy_, copy_)):
        _WRAPPERS.add(fn)
        fn.__doc__ = orig.__doc__
    from autoparallel import patches

    patches.patch(paddle.Tensor, "set_value", plain_set_value)
    patches.patch(paddle.Tensor, "copy_", plain_copy_)
