"""What paddle code reads or writes on a tensor besides its ops, for a DistTensor (an activation laid out by
autoparallel). They were refused as "not an op": metadata (``itemsize``, ``is_cuda``, ``get_device()``,
``stride()`` / ``strides``, ``is_tensor()``, ``is_dense()``, ``persistable``, ``is_same_shape``), the ``data``
view, in-place writes (``copy_``, ``set_value``, ``apply_``, ``random_``, ``data = value``) and ``apply``.

Each answers from the layout (global shape, dtype, the device the shards live on) without communicating, or
writes through the routed ``x[...] = value`` (each rank keeps its part of the global value).
"""
from __future__ import annotations

import numpy as np
import paddle


class GlobalSize(int):
    """A tensor's ``size`` as paddle 3.3 gives it: the element count (an int) that, called, is the shape
    (``x.size()``) or one dim (``x.size(0)``, ``x.size(-1)``), as torch-style code reads it."""

    def __new__(cls, shape):
        out = super().__new__(cls, int(np.prod(shape, dtype=np.int64)))
        out.shape = list(shape)
        return out

    def __call__(self, dim=None):
        shape = paddle.Size(self.shape)
        return shape if dim is None else shape[dim]


def _contiguous_strides(shape) -> list:
    out, step = [], 1
    for n in reversed(list(shape)):
        out.append(step)
        step *= max(int(n), 1)
    return out[::-1]


def _write(x, value, what: str = "the value"):
    """``x`` takes ``value`` (a tensor or numpy array of x's global shape, or broadcastable to it) in place."""
    if isinstance(value, np.ndarray):
        value = paddle.to_tensor(value)
    if not paddle.is_tensor(value):
        raise TypeError(f"{what} must be a tensor or a numpy array (as paddle takes it), got {type(value).__name__}")
    x[...] = value
    return x


class MetaForms:
    """Mixed into DistTensor: paddle's tensor metadata and in-place writes, on the global tensor."""
    __slots__ = ()

    # ---- metadata ------------------------------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return self.element_size()

    @property
    def is_cuda(self) -> bool:
        return self.place.is_gpu_place()

    def get_device(self) -> int:
        """paddle's device id of the tensor: -1 on CPU, the GPU's id where this process's shards live."""
        place = self.place
        return place.gpu_device_id() if place.is_gpu_place() else -1

    @property
    def strides(self) -> list:
        """The strides of the global tensor, contiguous (dispatch makes every shard contiguous)."""
        return _contiguous_strides(self.shape)

    def get_strides(self) -> list:
        return self.strides

    def stride(self, dim: int | None = None):
        strides = self.strides
        if dim is None:
            return strides
        if not -len(strides) <= dim < max(len(strides), 1):
            raise IndexError(f"stride(dim): dim must be in [{-len(strides)}, {len(strides)}), got {dim}")
        return strides[dim]

    def is_tensor(self) -> bool:
        return True

    def is_dense(self) -> bool:
        return True

    def is_sparse(self) -> bool:
        return False

    is_sparse_coo = is_sparse_csr = is_selected_rows = is_sparse

    @property
    def persistable(self) -> bool:
        """An activation is not persistable (a distributed parameter is a paddle Parameter, which is)."""
        return False

    def cuda(self, device_id=None, blocking: bool = True):
        """The tensor itself when its shards are on this rank's GPU (a training loop's ``x.cuda()``); moving shards
        between devices is not supported."""
        place = self.place
        if not place.is_gpu_place() or (device_id is not None and int(device_id) != place.gpu_device_id()):
            raise NotImplementedError(f"cuda({'' if device_id is None else device_id}): the shards of this distributed "
                                      f"tensor are on {place}; moving them to another device is not supported "
                                      f"(shards live where their ranks run)")
        return self

    def pin_memory(self, blocking: bool = True):
        raise NotImplementedError("pin_memory(): the shards of a distributed tensor live where their ranks run; pin "
                                  "the plain tensor before laying it out")

    def tolist(self) -> list:
        return self.numpy().tolist()

    def is_same_shape(self, y) -> bool:
        return list(self.shape) == list(y.shape)

    def _first_shard(self, what: str):
        for t in self._locals.values():
            return t
        raise ValueError(f"{what}: this process holds no shard of the tensor (mesh {self.mesh.mesh.tolist()})")

    # the same on every shard: read from this process's first one
    name = property(lambda self: self._first_shard("name").name)
    type = property(lambda self: self._first_shard("type").type)
    layout = property(lambda self: self._first_shard("layout").layout)
    grad_fn = property(lambda self: self._first_shard("grad_fn").grad_fn)
    inplace_version = property(lambda self: self._first_shard("inplace_version").inplace_version)

    # ---- the data view and in-place writes -------------------------------------------------------------
    @property
    def data(self):
        """paddle's ``x.data``: the same storage, outside the autograd graph."""
        return type(self)._own({r: t.detach() for r, t in self._locals.items()}, self._spec)

    @data.setter
    def data(self, value) -> None:
        _write(self, value)

    def copy_(self, src, blocking: bool = True):
        if list(getattr(src, "shape", ())) != list(self.shape):
            raise ValueError(f"copy_: the source must have the destination's global shape {list(self.shape)}, "
                             f"got {list(getattr(src, 'shape', ()))}")
        return _write(self, src)

    def set_value(self, value):
        if not (isinstance(value, np.ndarray) or paddle.is_tensor(value)):
            raise TypeError(f"set_value: the value must be a tensor or a numpy array (as paddle takes it), got "
                            f"{type(value).__name__}")
        shape = list(value.shape)
        if shape != list(self.shape):
            raise ValueError(f"set_value: the value must have the tensor's global shape {list(self.shape)}, "
                             f"got {shape}")
        _write(self, value)

    def apply(self, func):
        """paddle's ``apply(func)``: ``func(x)`` on a tensor that needs no gradient (the ops in ``func`` are
        routed like any other)."""
        if not self.stop_gradient:
            raise RuntimeError("Cannot apply function on a tensor that required gradient.")
        return func(self)

    def apply_(self, func):
        if not self.stop_gradient:
            raise RuntimeError("Cannot apply function on a tensor that required gradient.")
        return _write(self, func(self))

    def random_(self, from_: int = 0, to: int | None = None, *, generator=None):
        """One draw at the global shape by paddle's own ``random_`` (the random stream advances as one process's
        does: the values equal a single process's under the same seed), written into the tensor."""
        with paddle.no_grad():
            value = paddle.empty(list(self.shape), dtype=str(self.dtype).replace("paddle.", ""))
            value.random_(from_, to, generator=generator)
        return _write(self, value)
