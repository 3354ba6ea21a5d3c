"""DistTensor: local shards + a DistSpec; shard_tensor, reshard, dtensor_from_local, full().

A ``DistTensor`` (activations) holds {rank: local paddle.Tensor} for the ranks this process runs: one in
a real job, all of them in the simulated world. Its ``.shape`` is the GLOBAL shape (``b, t, d = x.shape`` works
unchanged). A ``DistParameter`` is a real paddle Parameter holding the local shard (``.shape`` local) and the spec.

Gradient convention: a rank's local gradient is the slice of the true gradient for a Shard placement and
the whole true gradient for Replicate and Partial placements (comm/collectives.py keeps it).
"""
from __future__ import annotations

import numpy as np
import paddle

from autoparallel import backward_start, cross_mesh_grad, dispatch_handle, param_carry, redistribute, view_alias
from autoparallel import dist_tensor_forms as _forms
from autoparallel.comm import agreement
from autoparallel.comm.collectives import pick_replicated
from autoparallel.comm.world import current_world
from autoparallel.compat import EagerParamBase, expected_place
from autoparallel.context import async_allreduce
from autoparallel.context import state as _ctx
from autoparallel.dist_tensor_meta import GlobalSize, MetaForms
from autoparallel.dist_tensor_ops import OpMethods
from autoparallel.local_parts import _local_from_full  # noqa: F401  (also imported from here)
from autoparallel.mesh import ProcessMesh
from autoparallel.param_detach import param_detach
from autoparallel.placement import BlockShard, Partial, Replicate, Shard
from autoparallel.spec import DistSpec, normalize_dtype
from reshard import cache as reshard_cache


class DistTensor(MetaForms, OpMethods):
    __slots__ = ("_locals", "_spec", "__weakref__")

    def __init__(self, locals_: dict, spec: DistSpec):
        self._locals = dict(locals_)
        self._spec = spec

    @classmethod
    def _own(cls, locals_: dict, spec: DistSpec) -> "DistTensor":
        """A DistTensor taking ``locals_`` as is (no copy): for dicts nobody else holds."""
        t = cls.__new__(cls)
        t._locals = locals_
        t._spec = spec
        return t

    # ---- layout ---------------------------------------------------------------------------------
    @property
    def spec(self) -> DistSpec:
        return self._spec

    @property
    def mesh(self) -> ProcessMesh:
        return self._spec.mesh

    @property
    def placements(self) -> list:
        return list(self._spec.placements)

    @property
    def process_mesh(self) -> ProcessMesh:
        """paddle's name of ``mesh``."""
        return self._spec.mesh

    def is_dist(self) -> bool:
        """paddle's ``Tensor.is_dist()``: True for a distributed tensor."""
        return True

    def _local_value(self) -> paddle.Tensor:
        """paddle's accessor of this rank's shard (``local``)."""
        return self.local

    @property
    def shape(self) -> list:
        return list(self._spec.shape)

    global_shape = shape

    @property
    def ndim(self) -> int:
        return self._spec.ndim

    @property
    def dtype(self):
        return getattr(paddle, self._spec.dtype)

    # ---- metadata paddle code reads: answered from the spec, never by communicating ------------------
    @property
    def place(self):
        """Where this process's shards live (every held shard is on the same device)."""
        for t in self._locals.values():
            return t.place
        return expected_place()           # none held: where this process puts new tensors (its own GPU)

    def dim(self) -> int:
        return self._spec.ndim

    ndimension = dim

    def numel(self) -> paddle.Tensor:
        """The GLOBAL element count, as the 0-d int64 tensor paddle's ``numel()`` returns."""
        return paddle.to_tensor(int(np.prod(self._spec.shape, dtype=np.int64)), dtype="int64")

    @property
    def size(self) -> int:
        """The global element count (paddle's ``Tensor.size``), callable for the shape or a dim as paddle's."""
        return GlobalSize(self._spec.shape)

    def element_size(self) -> int:
        return np.dtype("float16" if self._spec.dtype == "bfloat16" else self._spec.dtype).itemsize

    def contiguous(self) -> "DistTensor":
        """Shards made by dispatch are contiguous: the tensor itself."""
        return self

    def is_contiguous(self) -> bool:
        return True

    @property
    def is_leaf(self) -> bool:
        return all(t.is_leaf for t in self._locals.values())

    def zero_(self) -> "DistTensor":
        """Zeros in place (every shard; a Partial becomes Replicate: zeros on every rank sum to zero)."""
        return self.fill_(0.0)

    def fill_(self, value) -> "DistTensor":
        """``value`` everywhere in place; the tensor becomes replicated on its Partial mesh dims. A view's write
        reaches its base (view_alias), as paddle's shared storage carries it."""
        with _forms.local_mode():
            for t in self._locals.values():
                t.fill_(value)
        self._spec = self._spec.with_placements(_grad_placements(self._spec.placements))
        view_alias.written("paddle.Tensor.fill_", self)
        return _forms.forget_value(self)

    cpu = _forms.dist_cpu

    def __index__(self) -> int:
        if self._spec.dtype not in ("int64", "int32", "int16", "int8", "uint8"):
            raise TypeError(f"only integer tensors can be used as an index, got {self._spec.dtype}")
        return int(self)

    def __len__(self) -> int:
        if not self._spec.shape:
            raise TypeError("len() of a 0-d tensor")
        return self._spec.shape[0]

    def __iter__(self):
        """Rows over the global dim 0, as a paddle tensor iterates; each row is ``self[i]`` through the
        getitem rule, computed only when reached (a row of a dim sharded over a mesh dim is a Partial on it:
        no communication)."""
        if not self._spec.shape:
            raise TypeError("iteration over a 0-d tensor")
        for i in range(self._spec.shape[0]):
            yield self[i]

    # ---- local data -------------------------------------------------------------------------------
    @property
    def locals(self) -> dict:
        """{rank: local tensor} for the ranks this process holds."""
        return dict(self._locals)

    @property
    def local(self) -> paddle.Tensor:
        """This rank's shard (the current world rank's in the simulated world); a complete gradient joins it."""
        return _forms.complete_gradient(self).local_of(current_world().rank)

    def local_of(self, rank: int) -> paddle.Tensor:
        if rank not in self._locals:
            if not self.mesh.contains(rank):
                raise ValueError(f"rank {rank} is not in the mesh {self.mesh.mesh.tolist()} of this tensor")
            raise ValueError(f"rank {rank}'s shard is not held by this process (it holds {sorted(self._locals)})")
        return self._locals[rank]

    # ---- autograd ---------------------------------------------------------------------------------
    @property
    def stop_gradient(self) -> bool:
        return all(t.stop_gradient for t in self._locals.values())

    @stop_gradient.setter
    def stop_gradient(self, value: bool) -> None:
        for t in self._locals.values():
            t.stop_gradient = value

    def backward(self, grad=None, retain_graph: bool = False, use_async_allreduce: bool | None = None) -> None:
        """``use_async_allreduce`` (the article's flag): True launches the data-parallel gradient reductions
        from backward as asynchronous collectives overlapping the rest of backward where the backend
        overlaps (NCCL; the default there); on gloo it is accepted and does nothing, because gloo's
        collectives block. False keeps every reduction synchronous."""
        with async_allreduce(use_async_allreduce), agreement.typed_in_backward():
            self._backward(grad, retain_graph)

    def _backward(self, grad, retain_graph) -> None:
        ranks = sorted(self._locals)
        ts = [self._locals[r] for r in ranks]
        if grad is None:
            gs = [paddle.ones_like(t) for t in ts]
        elif isinstance(grad, (DistTensor, paddle.Tensor)):
            gs = _forms.backward_seeds(self, grad, ranks, reshard, shard_tensor)
        else:
            raise TypeError(f"backward(grad) expects None, a tensor or a DistTensor, got {type(grad).__name__}")
        backward_start.backward(ts, gs, retain_graph, (self,))

    @property
    def grad(self):
        gs = _forms.local_grads(self._locals)
        if not gs or any(g is None for g in gs.values()):
            return None
        return DistTensor(gs, self._spec.with_placements(_grad_placements(self._spec.placements)))

    register_hook = _forms.dist_register_hook
    clear_gradient = clear_grad = _forms.dist_clear_gradient
    __array__ = _forms.dist_array

    def detach(self) -> "DistTensor":
        return _forms.detached(self, DistTensor({r: t.detach() for r, t in self._locals.items()}, self._spec))

    # ---- whole-tensor views -------------------------------------------------------------------------
    def full(self) -> paddle.Tensor:
        """The global tensor (gathered; differentiable)."""
        rep = reshard(_forms.complete_gradient(_forms.fresh(self)), self.mesh, [Replicate()] * self.mesh.ndim)
        if not rep._locals:
            raise ValueError(f"this rank holds no shard of a tensor on mesh {self.mesh.mesh.tolist()}")
        return pick_replicated(rep._locals) if current_world().is_simulated else rep.local   # grads reach every copy

    def numpy(self) -> np.ndarray:
        return _forms.kept_numpy(self) if cross_mesh_grad.LIVE[0] else self.full().numpy()

    def item(self, *args):
        """paddle's ``item(*args)``: the one element, or the element at a flat index / a full index."""
        if args:
            return self.full().item(*args)
        synced = cross_mesh_grad.synced_item(self) if cross_mesh_grad.LIVE[0] else None
        if synced is not None:                  # a loss of a pipeline's logits: the same on every rank
            return synced
        if not self._locals:
            if _ctx.tracer is not None:
                raise NotImplementedError("reading a tensor's value (item(), bool(), int(), python control flow on "
                                          "it) cannot be traced: graph tracing computes shapes, not values; give "
                                          "the degrees yourself (auto_mode='semi', which runs eagerly)")
        return self.full().item()

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __bool__(self) -> bool:
        """Python control flow on a value (``if t <= 0.1:``): the one element, gathered when sharded."""
        if int(np.prod(self._spec.shape, dtype=np.int64)) != 1:
            raise ValueError(f"the truth value of a tensor with {list(self._spec.shape)} elements is ambiguous")
        return bool(self.item())

    __repr__ = _forms.dist_repr
    __format__ = _forms.dist_format             # f"{loss:.4f}": a one-element tensor formats its value


def _grad_placements(placements):
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


class DistParameter(EagerParamBase):
    """A paddle Parameter whose data is this rank's shard and which carries its DistSpec."""
    _ap_locals = property(_forms.param_locals, _forms.param_set_locals)      # {rank: local} (no self-reference)

    def _attach(self, spec: DistSpec, locals_: dict):
        self._ap_spec = spec
        self._ap_locals = locals_
        return self

    @property
    def spec(self) -> DistSpec:
        return self._ap_spec

    @property
    def mesh(self):
        return self._ap_spec.mesh

    @property
    def placements(self):
        return list(self._ap_spec.placements)

    @property
    def global_shape(self):
        return list(self._ap_spec.shape)

    @property
    def locals(self) -> dict:
        return dict(self._ap_locals)

    stop_gradient = property(_forms.param_stop_gradient, _forms.param_set_stop_gradient)
    grad = property(_forms.param_grad, _forms.param_set_grad)

    def as_dist(self) -> DistTensor:
        """A DistTensor view sharing this parameter's storage (differentiable w.r.t. it)."""
        return DistTensor(self._ap_locals, self._ap_spec)

    full = _forms.param_full
    detach = param_detach
    numpy = _forms.param_numpy
    set_value = _forms.param_set_value
    register_hook = _forms.param_register_hook
    zero_ = _forms.param_zero_
    clear_gradient = clear_grad = _forms.param_clear_gradient
    fill_ = _forms.param_fill_
    copy_ = _forms.param_copy_


for _name, _fill in _forms.PARAM_RANDOM_FILLS.items():      # uniform_, normal_, ...: drawn at the global shape
    setattr(DistParameter, _name, _fill)


def is_dist(x) -> bool:
    return isinstance(x, (DistTensor, DistParameter)) and (not isinstance(x, DistParameter) or hasattr(x, "_ap_spec"))


def as_dist(x) -> DistTensor:
    return x.as_dist() if isinstance(x, DistParameter) else x


# ---- constructors --------------------------------------------------------------------------------
def _spec_for(tensor_shape, dtype, mesh, placements) -> DistSpec:
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"expected a ProcessMesh, got {type(mesh).__name__}")
    if isinstance(tensor_shape, (str, bytes)) or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool)
                                                          for s in tensor_shape):
        raise TypeError(f"a global shape must be a sequence of ints, got {tensor_shape!r}")
    if any(s < 0 for s in tensor_shape):
        raise ValueError(f"a global shape needs sizes >= 0, got {list(tensor_shape)}")
    return DistSpec(mesh, tuple(placements), tuple(int(s) for s in tensor_shape), normalize_dtype(dtype))


def shard_tensor(data, mesh: ProcessMesh, placements, dtype=None, stop_gradient=None):
    """Distribute a full tensor (the same on every rank) over ``mesh`` with ``placements``.

    A Parameter becomes a DistParameter (a Parameter holding the local shard). Partial(sum) keeps the
    value on coordinate 0 of that mesh dim and zeros elsewhere; avg/max/min keep it everywhere.
    ``None`` (an absent optional weight, e.g. ``CrossEntropyLoss(weight=None).weight`` reached by a shard_fn
    that tests ``hasattr(layer, "weight")``) stays ``None``.
    """
    if data is None:
        return None
    dispatch_handle.install()
    if isinstance(data, EagerParamBase) and _is_lazy(data, dtype):
        from autoparallel.lazy_init.params import shard_lazy

        return shard_lazy(data, mesh, placements)     # built under paddle.LazyGuard: lay out, allocate later
    if isinstance(data, DistTensor) or is_dist(data):
        return _forms.shard_dist(data, reshard(data, mesh, placements), dtype, stop_gradient, _make_param)
    if not paddle.in_dynamic_mode():                   # inside paddle.jit.to_static (graph/jit.py)
        from autoparallel.graph.jit import shard_value
        return shard_value(data, mesh, placements, dtype, stop_gradient)
    is_param = isinstance(data, EagerParamBase)
    if not isinstance(data, (paddle.Tensor, np.ndarray, list, tuple, int, float, bool, np.number)):
        raise TypeError(f"shard_tensor expects a paddle.Tensor (or a numpy array / nested list of numbers), got "
                        f"{type(data).__name__} {data!r:.60}")
    t = data if isinstance(data, paddle.Tensor) else paddle.to_tensor(np.asarray(data), dtype=dtype)
    if dtype is not None and normalize_dtype(t.dtype) != normalize_dtype(dtype):
        t = t.astype(normalize_dtype(dtype))
    if is_param:                                       # one initial value on every rank (per-rank seeds)
        from autoparallel.rng_agree import agreed_value
        t = agreed_value(t, mesh)
    spec = _spec_for(t.shape, t.dtype, mesh, placements)
    world, sg = current_world(), (t.stop_gradient if stop_gradient is None else stop_gradient)
    with paddle.no_grad():      # contiguous copies: a strided view of the full tensor slows every later local op
        locals_ = {r: _local_from_full(t, spec, r).detach().contiguous() for r in world.local_ranks(mesh.process_ids)}
    for v in locals_.values():
        v.stop_gradient = sg
    return _make_param(locals_, spec, data) if is_param else DistTensor(locals_, spec)


def _is_lazy(param, dtype=None) -> bool:
    from autoparallel.lazy_init.params import is_lazy

    if not is_lazy(param):
        return False
    if dtype is not None and normalize_dtype(dtype) != normalize_dtype(param.dtype):
        raise NotImplementedError(f"shard_tensor of the lazily created parameter {param.name} keeps its dtype "
                                  f"{normalize_dtype(param.dtype)}; got dtype={normalize_dtype(dtype)}")
    return True


def _make_param(locals_: dict, spec: DistSpec, like=None) -> DistParameter:
    """A DistParameter for this rank (the lowest held rank in the simulated world)."""
    ranks = sorted(locals_)
    kw = {}
    if like is not None:
        kw = {"trainable": like.trainable}
    base = locals_[ranks[0]] if ranks else paddle.zeros([0], dtype=spec.dtype)
    param = DistParameter.from_tensor(base, **kw)
    if like is not None:
        param.stop_gradient = like.stop_gradient
        if getattr(like, "optimize_attr", None) is not None:
            param.optimize_attr = like.optimize_attr
        param.need_clip = getattr(like, "need_clip", True)
        param.regularizer = getattr(like, "regularizer", None)      # ParamAttr(regularizer=...)
        param.name = like.name
    held = dict(locals_)
    if ranks:
        held[ranks[0]] = param
        for r in ranks[1:]:
            held[r].stop_gradient = param.stop_gradient
    return param_carry.carried(like, param._attach(spec, held))     # the user's hooks and attributes


def dtensor_from_local(local, mesh: ProcessMesh, placements, global_shape=None, dtype=None) -> DistTensor:
    """Wrap this rank's shard (a {rank: tensor} dict or a list in mesh order in the simulated world).

    ``global_shape`` defaults to the local shape times the shard counts (even shards); given shapes and
    dtypes are validated against every local.
    """
    dispatch_handle.install()
    world = current_world()
    held = world.local_ranks(mesh.process_ids)
    if isinstance(local, dict):
        locals_ = dict(local)
    elif isinstance(local, (list, tuple)):
        if len(local) != len(held):
            raise ValueError(f"expected {len(held)} local tensors (one per held rank {held}), got {len(local)}")
        locals_ = dict(zip(held, local))
    elif isinstance(local, paddle.Tensor):
        if world.is_simulated:
            raise TypeError("in the simulated world pass every rank's shard: a {rank: tensor} dict or a list")
        if not mesh.contains(world.rank):
            raise ValueError(f"rank {world.rank} is not in the mesh {mesh.mesh.tolist()}: it has no local shard")
        locals_ = {world.rank: local}
    else:
        raise TypeError(f"expected a paddle.Tensor (or dict/list of them), got {type(local).__name__}")
    missing = sorted(set(held) - set(locals_))
    extra = sorted(set(locals_) - set(held))
    if missing or extra:
        raise ValueError(f"locals must cover exactly the held ranks {held}; missing {missing}, unexpected {extra}")
    first = locals_[held[0]] if held else None
    ddt = normalize_dtype(first.dtype) if first is not None else normalize_dtype(dtype or "float32")
    if dtype is not None and normalize_dtype(dtype) != ddt:
        raise ValueError(f"dtype mismatch: the spec says {normalize_dtype(dtype)}, the local tensor is {ddt}")
    placements = tuple(placements)
    if global_shape is None:
        if first is None:
            raise ValueError("global_shape is required when this rank holds no shard")
        global_shape = list(first.shape)
        for p, n in zip(placements, mesh.shape):     # a wrong count is named by _spec_for's check
            if isinstance(p, (Shard, BlockShard)):
                if not 0 <= p.dim < len(global_shape):
                    raise ValueError(f"{p} is out of range for a tensor of rank {len(global_shape)}")
                global_shape[p.dim] *= n
    spec = _spec_for(global_shape, ddt, mesh, placements)
    for r, t in locals_.items():
        want = spec.local_shape(mesh.coords_of(r))
        if tuple(t.shape) != tuple(want):
            raise ValueError(f"rank {r}: local shape {list(t.shape)} disagrees with the spec: expected {list(want)} "
                             f"for global shape {list(spec.shape)}, placements [{', '.join(map(str, spec.placements))}]"
                             f" (shards of unequal sizes: pass the global shape, global_shape=[...])")
        if normalize_dtype(t.dtype) != ddt:
            raise ValueError(f"rank {r}: local dtype {normalize_dtype(t.dtype)} disagrees with {ddt}")
    return DistTensor(locals_, spec)


def reshard(x, mesh: ProcessMesh, placements) -> DistTensor:
    """Redistribute to ``placements`` on ``mesh`` along the cheapest plan (differentiable)."""
    src = as_dist(_forms.fresh(x, "reshard"))
    if not isinstance(src, DistTensor):
        raise TypeError(f"reshard expects a DistTensor or DistParameter, got {type(x).__name__}")
    return cross_mesh_grad.follow(src, _reshard, mesh, placements)


def _reshard(src, mesh, placements) -> DistTensor:
    try:        # a repeated reshard reuses its target spec and plan (the planning cluster named by its epoch)
        key = ("target", src._spec, mesh, tuple(placements), current_world().backend, reshard_cache.cluster_epoch())
        placements, hit = key[3], reshard_cache.get(key)
    except TypeError:                   # no placements or unhashable ones: validated (and rejected) below
        key = hit = None
    if hit is not None:
        dst, plan = hit
        return src if plan is None else DistTensor(redistribute.execute(src._locals, plan), dst)
    from reshard import plan_reshard

    from autoparallel.comm.world import planning_cluster

    dst = _spec_for(src.spec.shape, src.spec.dtype, mesh, placements)
    if dst == src.spec:
        if key is not None:
            reshard_cache.put(key, (src.spec, None))
        return src
    if mesh == src.mesh:
        plan = plan_reshard(src.spec.shape, src.spec.dtype, mesh, src.spec.placements, dst.placements,
                            cluster=planning_cluster())
    else:
        from reshard import plan_cross_mesh

        current_world().local_ranks(mesh.process_ids)      # a mesh outside the simulated world is refused
        plan = plan_cross_mesh(src.spec.shape, src.spec.dtype, src.mesh, src.spec.placements, mesh,
                               dst.placements, cluster=planning_cluster())
    if key is not None:
        reshard_cache.put(key, (dst, plan))
    return DistTensor(redistribute.execute(src._locals, plan), dst)
