"""Data-parallel gradient reduction in fused buckets.

A parameter replicated on a mesh dim but used by ops split on it (data parallel: every rank sees other
samples) ends backward with a partial-sum gradient there; dispatch records those dims on the parameter
(``_ap_partial_dims``). Its gradient is all-reduced over them in fused buckets: parameters grouped by
(mesh, dims), flattened into float32 buffers of at most ``bucket_bytes``, in reverse registration order
(the order backward produces them). Bucket sizes count the largest local shard, so every rank computes
the same buckets. Where the backend overlaps (NCCL) a bucket can be launched with ``sync_op=False`` and
written back when waited for; gloo blocks, so on CPU it is launched synchronously.

    ap.reduce_gradients(params)                  # everything now, at step time
    sync = GradientSync(lambda: params)          # the optimizer's: at step time until the partial
    sync.flush()                                 #   parameters are known, then from backward hooks
"""
from __future__ import annotations


import weakref
from dataclasses import dataclass, field

import paddle

from autoparallel.comm import collectives as C
from autoparallel.comm.capabilities import capabilities
from autoparallel.comm.sizes import numel
from autoparallel.comm.world import current_world
from autoparallel.dist_tensor import DistParameter
from autoparallel.local_mode import local_mode

BUCKET_BYTES = 25 * 2**20


def partial_params(params) -> list:
    return [p for p in params if isinstance(p, DistParameter) and getattr(p, "_ap_partial_dims", None)]


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients are all-reduced together over the mesh dims ``dims``."""
    params: list
    mesh: object
    dims: tuple
    buffers: dict = field(default_factory=dict, repr=False)   # rank -> _Flat, kept between steps

    def nbytes(self) -> int:
        return sum(p.spec.local_nbytes() for p in self.params)


def check_bucket_bytes(bucket_bytes) -> int:
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    return bucket_bytes


def plan_buckets(params, bucket_bytes: int = BUCKET_BYTES, dims_of=None) -> list:
    """Buckets of the partial parameters among ``params``, in launch order (backward order).

    Walking the parameters in reverse registration order, each (mesh, dims) group fills its open bucket
    until the next parameter would exceed ``bucket_bytes`` (a larger parameter gets a bucket of its own);
    buckets are ordered by the position of their last parameter, i.e. by when backward completes them.
    ``dims_of(p)`` overrides the recorded dims. A frozen parameter (``stop_gradient``) gets no slot."""
    check_bucket_bytes(bucket_bytes)
    dims_of = dims_of or (lambda p: p._ap_partial_dims)
    open_, done = {}, []
    for pos, p in enumerate(reversed([p for p in partial_params(params) if not p.stop_gradient])):
        key = (p.mesh, tuple(sorted(dims_of(p))))
        n = p.spec.local_nbytes()
        cur = open_.get(key)
        if cur is not None and cur[1] + n > bucket_bytes:
            done.append(cur)
            cur = None
        if cur is None:
            cur = open_[key] = [0, 0, Bucket([], *key)]
        cur[0], cur[1] = pos, cur[1] + n
        cur[2].params.append(p)
    done.extend(open_.values())
    return [b for _, _, b in sorted(done, key=lambda c: c[0])]


def reduce_gradients(params, bucket_bytes: int = BUCKET_BYTES) -> int:
    """All-reduce partial gradients over their recorded mesh dims now; returns the number of buckets."""
    if isinstance(params, (paddle.nn.Layer, paddle.Tensor)) or not hasattr(params, "__iter__"):
        raise TypeError(f"reduce_gradients expects an iterable of parameters (e.g. model.parameters()), got "
                        f"{type(params).__name__}")
    buckets = plan_buckets(list(params), bucket_bytes)
    for b in buckets:
        reduce_bucket(b)
    return len(buckets)


# ---- one bucket -------------------------------------------------------------------------------------------
def reduce_bucket(bucket: Bucket, async_op: bool = False):
    """All-reduce the bucket's gradients; returns None when done, or (``async_op`` on a real backend, one
    mesh dim) a handle whose ``wait()`` finishes the collective and writes the gradients back."""
    held = current_world().local_ranks(bucket.mesh.process_ids)
    if not held:
        return None
    with local_mode(), paddle.no_grad():
        keep = _keeps_buffer(bucket, held)
        flat = {r: _pack(bucket.params, r, _flat(bucket, r) if keep else None) for r in held}
        if async_op and not current_world().is_simulated and len(bucket.dims) == 1:
            task = _start_all_reduce(flat, bucket.mesh, bucket.dims[0])
            if task is not None:
                return Pending(task, lambda: _unpack(bucket.params, flat, bucket.buffers))
        if not _reduce_in_place(flat, bucket):
            for d in bucket.dims:
                flat = C.mesh_groups_apply(flat, bucket.mesh, d, lambda xs, ranks: C._reduce_raw(xs, ranks, "sum"))
        _unpack(bucket.params, flat, bucket.buffers)
    return None


def _reduce_in_place(flat, bucket) -> bool:
    """A real rank's float32 bucket is summed in its own buffer, dim after dim (the buffer is ours: the
    functional collective's defensive copy in and out is not needed). False: the caller reduces it -- also
    when ``transport_for`` hands out anything but the plain real transport (a view that reports calls)."""
    from autoparallel.comm.transport import RealTransport, transport_for

    world = current_world()
    if world.is_simulated or len(flat) != 1:
        return False
    transport = transport_for(world)
    if type(transport) is not RealTransport or transport.caps.reduce_dtype("float32") != "float32":
        return False
    (rank, buf), = flat.items()
    if buf.dtype != paddle.float32:
        return False
    if numel(buf) == 0:
        return True
    for d in bucket.dims:
        ranks = bucket.mesh.group_ranks(d, rank)
        if len(ranks) > 1:
            transport.all_reduce_(buf, ranks)
    return True


def _keeps_buffer(bucket, held) -> bool:
    """A real rank's bucket of several gradients is packed into a float32 buffer of its own, allocated once
    and reused every step: a fresh multi-megabyte buffer per step costs ~0.6 ms per MB of page faults on
    this machine's allocator (10 ms for the GPT's 17 MB), a copy into a warm one ~0.06 ms per MB. The
    simulated world keeps the functional path (its transport returns new tensors)."""
    return len(bucket.params) > 1 and len(held) == 1 and not current_world().is_simulated


class _Flat:
    """One rank's persistent bucket buffer and its per-parameter views (in the parameter's local shape)."""

    __slots__ = ("buf", "numels", "shaped_views")

    def __init__(self, locals_):
        self.numels = [numel(t) for t in locals_]
        self.buf = paddle.zeros([sum(self.numels)], dtype=_bucket_dtype(locals_))
        self.shaped_views, off = [], 0
        for t, n in zip(locals_, self.numels):
            self.shaped_views.append(self.buf[off:off + n].reshape(t.shape))
            off += n


def _flat(bucket, r) -> _Flat:
    """``bucket``'s buffer on rank ``r``, made anew when a parameter's local size changed."""
    locals_ = [p.locals[r] for p in bucket.params]
    f = bucket.buffers.get(r)
    if f is None or f.numels != [numel(t) for t in locals_]:
        f = bucket.buffers[r] = _Flat(locals_)
    return f


def _bucket_dtype(tensors) -> str:
    """float32, or float64 when a parameter is float64 (its gradient must not lose precision in the sum)."""
    return "float64" if any(t.dtype == paddle.float64 for t in tensors) else "float32"


def _pack(params, r, flat=None):
    """Rank ``r``'s gradients of ``params`` as one float32 vector: copied into ``flat``'s buffer when given
    (returned as that buffer), else concatenated into a new one."""
    if flat is not None:
        for p, view in zip(params, flat.shaped_views):
            g = p.locals[r].grad
            if g is None:
                view.zero_()
            else:
                view.copy_(g if g.dtype == view.dtype else g.astype(view.dtype), False)
        return flat.buf
    parts, dtype = [], _bucket_dtype([p.locals[r] for p in params])
    for p in params:
        g = p.locals[r].grad
        parts.append(g.reshape([-1]).astype(dtype) if g is not None
                     else paddle.zeros([numel(p.locals[r])], dtype=dtype))
    return parts[0] if len(parts) == 1 else paddle.concat(parts)     # one float32 gradient: a view of it


def _unpack(params, flat, bufs=None) -> None:
    """Writes the reduced ``flat`` {rank: vector} back into the gradients (through the persistent views of
    ``bufs`` {rank: _Flat} where the vector is that buffer)."""
    with local_mode(), paddle.no_grad():
        for r, buf in flat.items():
            f = bufs.get(r) if bufs else None
            if f is not None and f.buf is buf:
                for p, view in zip(params, f.shaped_views):
                    g = p.locals[r].grad
                    if g is not None:
                        g.copy_(view if g.dtype == view.dtype else view.astype(g.dtype), False)
                continue
            off = 0
            for p in params:
                t = p.locals[r]
                n = numel(t)
                g = t.grad
                if g is not None and not (len(params) == 1 and buf.data_ptr() == g.data_ptr()):
                    g.set_value(buf[off:off + n].reshape(t.shape).astype(t.dtype))
                off += n


def _start_all_reduce(flat, mesh, dim):
    """``dist.all_reduce(sync_op=False)`` of this rank's buffer in place, through the transport (noted, agreed and
    counted as every collective); None if there is nothing to do."""
    from autoparallel.comm.transport import transport_for

    (rank, buf), = flat.items()
    ranks = mesh.group_ranks(dim, rank)
    if len(ranks) == 1 or numel(buf) == 0:
        return None
    return transport_for(current_world()).start_all_reduce_(buf, ranks)


class Pending:
    """An in-flight bucket: ``wait()`` completes the collective, then runs ``then`` (once)."""

    def __init__(self, task, then):
        self.task, self.then = task, then

    def wait(self) -> None:
        if self.task is None:
            return
        task, self.task = self.task, None
        task.wait()
        self.then()


from autoparallel.context import state as _state  # noqa: E402


from autoparallel.context import async_allreduce  # noqa: E402,F401  (re-exported)


def launch_async() -> bool:
    """Whether a reduction launched from backward runs asynchronously."""
    flag = _state.async_allreduce
    return overlaps() and flag is not False


def overlaps() -> bool:
    """Whether this world's backend overlaps ``sync_op=False`` collectives with compute (NCCL; not gloo)."""
    world = current_world()
    return not world.is_simulated and capabilities(world.backend).overlap


# ---- the optimizer's reduction ------------------------------------------------------------------------------
_SYNCS: "weakref.WeakSet" = weakref.WeakSet()     # every live GradientSync


def _one() -> float:
    return 1.0


def owners_of(params) -> list:
    """The live reductions (not retired) whose parameters include any of ``params``."""
    ids = {id(p) for p in params}
    return [s for s in list(_SYNCS) if not s.retired and any(id(p) in ids for p in _params_of(s))]


def _params_of(sync) -> list:
    """A reduction's parameters; none for one whose optimizer changed class under it (``reconfigure``: a wrapper
    that became a ZeRO optimizer, which reduces its gradients itself, keeps its old reduction's object)."""
    try:
        return sync.params_fn()
    except AttributeError:
        return []


class GradientSync:
    """Data-parallel reduction of the partial gradients among ``params_fn()``.

    ``flush()`` (the optimizer step) reduces what is not reduced yet. With ``overlap`` the buckets are fixed
    and a Reducer installed as the first backward starts (the partial dims are known once a forward ran;
    else at the first flush, which reduces everything): each bucket is launched by backward hooks as soon as its gradients are complete
    on the final accumulation micro-step (``accumulation_steps`` backward passes per step); non-final
    micro-steps reduce nothing. A parameter that gains partial dims later is reduced over them at the
    flush and the buckets are planned again."""

    def __init__(self, params_fn, bucket_bytes: int = BUCKET_BYTES, accumulation_steps: int = 1,
                 overlap: bool = True, async_op: bool | None = None):
        self.params_fn, self.bucket_bytes = params_fn, check_bucket_bytes(bucket_bytes)
        self.accumulation_steps, self.overlap, self.async_op = accumulation_steps, overlap, async_op
        self.buckets: list = []
        self.reducer = None
        self._dims: dict = {}           # id(param) -> mesh dims its gradient is reduced over by the buckets
        self.retired = False            # another optimizer (ZeRO) reduces these gradients instead
        self.step_divisor = _one        # what the owner's step still divides the gradients by (hand_clip.py)
        self._flushed: set = set()      # without overlap: ids a flush before the step reduced (a hand clip's)
        _SYNCS.add(self)
        if overlap:
            from autoparallel import backward_start

            backward_start.wait(self)

    def before_backward(self, tensors=()) -> bool:
        """A backward starts: plan the buckets now if no step did (the first backward then reduces from its
        hooks). True when planned (nothing more to do here)."""
        if self.reducer is not None:
            return True
        if not self.overlap:                # every reduction at step time (may be turned on later)
            return False
        params = self.params_fn()
        if not partial_params(params):
            return False
        self._plan(params, reduced=False)
        return True

    def flush(self, final: bool = True) -> int:
        """Reduce every gradient not reduced yet; returns the number of buckets launched here. ``final``: the
        step's flush (ends the window); else one before it (a clip by hand), whose reductions the step keeps."""
        n = self.reducer.flush() if self.reducer is not None else 0
        params = self.params_fn()
        late = [p for p in partial_params(params) if self._unplanned(p) and not p.stop_gradient
                and id(p) not in self._flushed]
        extra = plan_buckets(late, self.bucket_bytes, self._unplanned)
        for b in extra:
            reduce_bucket(b)
        n += len(extra)
        if not self.overlap:            # without hooks nothing marks them reduced: the step's flush skips them
            self._flushed = set() if final else self._flushed | {id(p) for b in extra for p in b.params}
        frozen = any(p.stop_gradient for b in self.buckets for p in b.params)   # frozen since the plan: no slot
        if self.overlap and (extra or frozen):
            self._plan(params)
        return n

    def _unplanned(self, p) -> set:
        """Mesh dims ``p``'s gradient is partial over that the buckets do not reduce (all before the first plan)."""
        return set(p._ap_partial_dims) - self._dims.get(id(p), set())

    def reset(self) -> None:
        """Gradients were cleared: a new accumulation window."""
        self._flushed.clear()
        if self.reducer is not None:
            self.reducer.reset()

    def _plan(self, params, reduced: bool = True) -> None:
        from autoparallel.parallel.reducer import Reducer

        self.buckets = plan_buckets(params, self.bucket_bytes)
        self._dims = {id(p): set(b.dims) for b in self.buckets for p in b.params}
        old = self.reducer
        self.reducer = Reducer([b.params for b in self.buckets], self._launch, self._to_partial,
                               expected=self.accumulation_steps)
        if old is not None:
            self.reducer.expected.update({k: v for k, v in old.expected.items() if k in self.reducer.expected})
            old.detach()
        if reduced:
            self.reducer.mark_reduced()     # the gradients now hold reduced values

    # ---- Reducer callbacks -------------------------------------------------------------------------------
    def _launch(self, i, params):
        if i is None:                       # a subset of buckets: reduce them now
            for b in plan_buckets(params, self.bucket_bytes, lambda p: self._dims[id(p)]):
                reduce_bucket(b)
            return None
        return reduce_bucket(self.buckets[i], launch_async() if self.async_op is None else self.async_op)

    def _to_partial(self, p) -> None:
        """A gradient arrives for ``p`` after its reduction: turn the reduced value back into partial sums
        (kept at coordinate 0 of the reduced dims, zero elsewhere) so that the next reduction adds it once
        and in-place changes before it (loss-scale, cross-stage sums) apply to it as to the rest."""
        dims = self._dims[id(p)]
        for r, t in p.locals.items():
            if t.grad is not None and any(p.mesh.coords_of(r)[d] for d in dims):
                t.grad.set_value(paddle.zeros_like(t.grad))
