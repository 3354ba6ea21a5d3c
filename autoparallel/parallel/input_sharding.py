"""Model inputs of a parallelized model: plain tensors are sharded on their batch dim over the data dims
(``parallel_guard(dims)`` names other dims); a DistTensor must already live on the model's mesh."""
from __future__ import annotations

import contextlib

from autoparallel import layer_state
from autoparallel.context import state as _ctx
from autoparallel.dist_tensor import DistTensor, shard_tensor
from autoparallel.parallel.mesh_dims import DATA, MODEL
from autoparallel.placement import Replicate, Shard


def parallel_guard(dims=(DATA,)):
    """Inside, plain tensors entering a parallelized model are sharded on their batch dim over the mesh dims
    named in ``dims`` and replicated over the others (``parallel_guard([])`` replicates them). The names are
    those of ``ap.parallelize``'s mesh: ``'data'`` and ``'model'``."""
    if isinstance(dims, str) or not isinstance(dims, (list, tuple)) or not all(isinstance(d, str) for d in dims):
        raise TypeError(f"parallel_guard expects a list of mesh dim names (of {[DATA, MODEL]}), got "
                        f"{type(dims).__name__} {dims!r:.80}")
    unknown = [d for d in dims if d not in (DATA, MODEL)]
    if unknown:
        raise ValueError(f"parallel_guard: unknown mesh dim names {unknown}; ap.parallelize's mesh has dims "
                         f"{[DATA, MODEL]}, got dims={list(dims)}")
    if len(set(dims)) != len(dims):
        raise ValueError(f"parallel_guard: each mesh dim may be named once, got dims={list(dims)}")
    return _guarded(list(dims))


@contextlib.contextmanager
def _guarded(dims: list):
    stack = _ctx.guard_stack
    if stack is None:
        stack = _ctx.guard_stack = []
    stack.append(dims)
    try:
        yield
    finally:
        stack.pop()


def refuse_guard(where: str) -> None:
    """NotImplementedError when a ``parallel_guard`` other than the default ``["data"]`` is active: ``where``
    places its inputs itself (a pipeline cuts micro-batches over the data ranks of each stage), so the guard
    would be ignored."""
    dims = _ctx.guard_stack[-1] if _ctx.guard_stack else [DATA]
    if dims != [DATA]:
        raise NotImplementedError(f"ap.parallel_guard({dims}) around {where} is not supported: it cuts every batch "
                                  f"over the data ranks of each stage (the default ['data']); leave the guard out")


def _input_dims():
    stack = _ctx.guard_stack
    return stack[-1] if stack else [DATA]


def shard_inputs(model, mesh) -> None:
    """A forward pre-hook distributing the model's tensor inputs, positional and keyword alike (see the module
    docstring)."""
    import paddle

    def place(x):
        if isinstance(x, DistTensor):
            if x.mesh != mesh:
                from autoparallel.dist_tensor_forms import same_ranks_view

                seen = same_ranks_view(x, mesh)       # the same ranks by other dim names (a loader's ["dp", "mp"])
                if seen is not None:
                    return seen
                raise ValueError(f"{type(model).__name__} runs on mesh {mesh} but got a DistTensor on mesh "
                                 f"{x.mesh}; reshard it onto the model's mesh (ap.reshard(x, ap.mesh_of(model), "
                                 f"placements)) or pass the plain tensor")
            return x
        if not isinstance(x, (paddle.Tensor, paddle.pir.Value)) or x.ndim == 0:      # Value: jit.to_static
            return x
        dims = _input_dims()
        unknown = [d for d in dims if d not in mesh.dim_names]
        if unknown:
            raise ValueError(f"parallel_guard names mesh dims {unknown}; the model's mesh has {mesh.dim_names}")
        placements = [Shard(0) if n in dims else Replicate() for n in mesh.dim_names]
        if isinstance(x, paddle.Tensor) and not x.stop_gradient:     # its gradient is asked for: keep the path
            from autoparallel.input_grad import shard_input
            return shard_input(x, mesh, placements)
        return shard_tensor(x, mesh, placements)

    def pre(_layer, args, kwargs):                 # keyword inputs (model(input_ids=..., labels=...)) too
        return tuple(place(x) for x in args), {k: place(v) for k, v in kwargs.items()}

    model.register_forward_pre_hook(pre, with_kwargs=True)
    layer_state.put(model, "mesh", mesh)
