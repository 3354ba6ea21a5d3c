"""``loss_fn(model(x), y)`` on a pipeline-parallel model: the logits of a training call, and their backward.

    logits = model(x)                       # training mode, gradients on, no labels
    loss = loss_fn(logits, y)               # any loss the project's dispatch runs: F.cross_entropy, slices, extra
    loss.backward()                         # terms, a Layer criterion, loss * 0.5, a GradScaler's scale(loss) ...
    opt.step(); opt.clear_grad()

The call runs the forward of every micro-batch through the pipeline (the forward actions of an FThenB
schedule), keeping each micro-batch's graph on each stage, and returns the logits as a distributed tensor on the
last stage's mesh (a one-rank mesh of the last stage when the stages hold plain tensors), in the placements the
last stage computed them in. To make the logits of the whole batch a plain concatenation of the micro-batches'
shards, the batch rows are permuted before the micro-batch split: data-parallel rank ``d`` gets the
``d``-th contiguous slice of the global batch, cut into its micro-batches (as one process's data-parallel
training cuts a batch), so its logits shard is its micro-batches' outputs concatenated. The model's forward treats
samples independently, so every logit equals one process's. A last stage that holds the batch dim whole (not
sharded over the data ranks) gets its rows put back in order by a local gather.

Each held rank's shard of the logits is a fresh leaf. The tensor names a ``PipelineBackward`` record in its
cross-mesh ancestry (cross_mesh_grad.py), so ``loss.backward()`` (``DistTensor.backward`` ->
backward_start.backward -> cross_mesh_grad.backward) first runs the user's loss graph down to the leaves, then the
record: each leaf's gradient is cut into the micro-batches' gradients and the backward actions of the FThenB
schedule run (the last stage from those gradients, stage-to-stage gradient transfers as in ``train_batch``),
leaving every stage parameter's gradient in ``.grad`` as one process would (accumulating across calls; the
data-parallel reduction at ``opt.step()`` as after ``train_batch``; tied parameters summed between their ranks).

Schedules: every forward runs before any backward, so this form is FThenB (its order and its memory). A strategy
whose schedule is FThenB runs it; a schedule left at its default runs FThenB for this form (``pipe.records``
shows the actions that ran, ``str(strategy)`` says so); a schedule chosen explicitly (1F1B, VPP, ZB-H1)
raises ``TypeError`` naming both remedies.

Launched ranks: every rank runs the same program. The ranks of other stages get the logits' layout (placements,
global shape, dtype) from the last stage's first rank by one sum over the world, and hold a ``DistTensor`` without
a shard, as ranks outside a mesh do (docs/cross_mesh.md); the user's loss plans and runs nothing there, and its
``backward()`` runs their stages' backward actions. At ``loss.backward()`` the value of every one-element root
computed from the logits (and of the one-element tensors it was computed from: ``loss`` of ``(loss / accum)``)
reaches every rank (one exchange over the world) and is kept on the tensor
(value_cache.py): ``float(loss)`` / ``loss.item()`` / ``numpy()`` / ``format`` after backward are local on any rank
alone. A read before backward is an exchange every rank makes (and keeps the value); made on some ranks only it
raises ``LossReadOnSomeRanksError`` on every rank (loss_sync.py).

A model split at its blocks (one process, the simulated world) hands back its whole output: every per-sample tensor
of a tuple / dict (two heads) is such a distributed tensor, all sharing one backward record (``heads``); other values
are withheld. On launched ranks one without a logits field is refused (``HEADS_LAUNCHED``).

Refused by name: ``strategy.amp`` (its loss scale belongs to ``train_batch``'s loss), low-precision parameters, a
second backward with ``retain_graph=True`` through the pipeline.
"""
from __future__ import annotations

import paddle

from autoparallel import cross_mesh_grad

FORWARD = ("F", "SEND_F", "RECV_F")
BACKWARD = ("B", "SEND_B", "RECV_B", "W")


def explicit_schedule_error(name: str) -> TypeError:
    return TypeError(f"loss_fn(model(x), y) on a pipeline-parallel model runs every micro-batch's forward before "
                     f"any backward (the FThenB order and memory), but strategy.pipeline_parallel.schedule was set "
                     f"to {name!r}: call model(x, labels=y) (or model.train_batch(x, y)) to train with the "
                     f"{name} schedule and the pipeline's loss_fn, or set strategy.pipeline_parallel.schedule = "
                     f"\"FThenB\" for loss_fn(model(x), y)")


def schedule_for(pipe):
    """The schedule this form runs: the plan's FThenB, FThenB for a schedule left at its default, else TypeError."""
    from .schedules import fthenb

    sched = pipe.plan.schedule
    if sched.name == "FThenB":
        return sched
    if getattr(pipe, "schedule_chosen", True):
        raise explicit_schedule_error(sched.name)
    return fthenb(pipe.plan.pp, pipe.plan.micro_batches)


def _refusals(pipe) -> None:
    if pipe.loss_scaler is not None:
        raise NotImplementedError("loss_fn(model(x), y) on a pipeline-parallel model under strategy.amp: the "
                                  "strategy's loss scale applies to the pipeline's own loss; call model(x, labels=y) "
                                  "or model.train_batch(x, y), or scale the loss with a paddle.amp.GradScaler")
    low = sorted({str(p.dtype).replace("paddle.", "") for p in pipe.parameters()} & {"float16", "bfloat16"})
    if low:
        raise NotImplementedError(f"loss_fn(model(x), y) on a pipeline-parallel model with {'/'.join(low)} "
                                  f"parameters: keep fp32 parameters with strategy.amp and call model(x, labels=y)")


def interleave(batch, m: int, dp: int):
    """The global batch with its rows permuted so that micro-batch ``i``'s shard on data rank ``d`` is rows
    ``d * B/dp + i * B/(m dp) ...`` of the original (module docstring); a dict: every tensor value alike."""
    from .batch import _checked, _is_array, _tensor, broadcast_keys

    if dp == 1 or m == 1 or batch is None:
        return batch
    if isinstance(batch, dict):
        whole = broadcast_keys(batch)
        return {k: interleave(v, m, dp) if _is_array(v) and k not in whole else v for k, v in batch.items()}
    t = _checked(_tensor(batch), m, dp, "inputs", call="model(x)")
    n = int(t.shape[0])
    return paddle.index_select(t, paddle.to_tensor(order(n, m, dp)), axis=0)


def order(n: int, m: int, dp: int) -> list:
    """Original row of each permuted row (``interleave``)."""
    per = n // (m * dp)
    return [d * (n // dp) + i * per + k for i in range(m) for d in range(dp) for k in range(per)]


def call(pipe, inputs):
    """The logits of a training call without labels (module docstring)."""
    _refusals(pipe)
    sched = schedule_for(pipe)
    m, dp = pipe.plan.micro_batches, pipe._dp()
    if pipe.ranks is not None:          # before any transfer: meets a read some ranks made alone (loss_sync.py)
        from .loss_sync import exchange

        exchange("forward", [])
    st = pipe._step_state(interleave(inputs, m, dp), None, need_labels=False)
    st.external = True
    handlers = {"F": pipe._forward, "SEND_F": pipe._send_f, "RECV_F": pipe._recv_f}
    _run(pipe, st, sched, FORWARD, handlers)
    if pipe.transport.pending():
        raise RuntimeError("the forward of a pipeline called without labels ended with undelivered transfers")
    if st.outputs and not _is_tensor(st.outputs[0]):         # a model of several heads: its whole output
        return _heads_output(pipe, st, sched, m, dp)
    logits, leaves_ = assemble(pipe, st.outputs, m, dp)
    rec = PipelineBackward(pipe, st, sched, leaves_)
    cross_mesh_grad.LIVE[0] = True
    cross_mesh_grad._ANCESTRY.set(logits, frozenset([rec]))
    return logits


# ---- a model of several heads (a tuple / dict output) ----------------------------------------------------------
HEADS_LAUNCHED = ("loss_fn(model(x), y) with a model returning several outputs without a logits field, on launched "
                  "ranks: return the logits alone (a tensor, or a dict / ModelOutput with 'logits'), or run it in "
                  "one process or ap.simulate")


def _is_tensor(v) -> bool:
    from autoparallel.dist_tensor import is_dist

    return isinstance(v, paddle.Tensor) or is_dist(v)


def _rows(inputs):
    """The number of samples of one micro-batch's model inputs (a tensor or a dict of them)."""
    if isinstance(inputs, dict):
        return max(int(v.shape[0]) for v in inputs.values() if _is_tensor(v) and len(v.shape))
    return int(inputs.shape[0])


def heads(out, inputs) -> list:
    """The keys of a whole model output (tuple / list / dict) whose value is a per-sample tensor (its first dim the
    micro-batch's samples): the outputs ``loss_fn(model(x), y)`` gets as distributed tensors."""
    items = out.items() if isinstance(out, dict) else enumerate(out) if isinstance(out, (tuple, list)) else ()
    n = _rows(inputs)
    return [k for k, v in items if _is_tensor(v) and len(v.shape) >= 1 and int(v.shape[0]) == n]


def saved(out, inputs):
    """What the last stage keeps of a micro-batch's output for the backward: the tensor, or the list of heads (the
    whole output where the last stage holds no inputs: launched ranks, whose several heads are refused by name)."""
    if _is_tensor(out) or inputs is None:
        return out
    return [out[k] for k in heads(out, inputs)]


def _heads_output(pipe, st, sched, m: int, dp: int):
    """The model's own output (a tuple / list / dict, its class kept) with every per-sample head a distributed tensor
    of the whole batch sharing one backward record; None stays None; any other value (a per-batch tensor such as a
    summed auxiliary loss, a cache) is withheld: its use raises NotImplementedError."""
    from .call_forms import Withheld

    if pipe.ranks is not None:
        raise NotImplementedError(HEADS_LAUNCHED)
    first = st.outputs[0]
    keys = heads(first, st.inputs[0])
    dts, leaves_ = {}, []
    for k in keys:
        dts[k], lv = assemble(pipe, [o[k] for o in st.outputs], m, dp)
        leaves_.append(lv)
    rec = PipelineBackward(pipe, st, sched, leaves_)
    cross_mesh_grad.LIVE[0] = True
    for dt in dts.values():
        cross_mesh_grad._ANCESTRY.set(dt, frozenset([rec]))
    why = ("an output of a pipeline's training call that is not a per-sample tensor (its first dim is not the "
           "batch's samples) is computed micro-batch by micro-batch and has no whole-batch value; return it per "
           "sample, or compute it from the per-sample outputs")
    items = first.items() if isinstance(first, dict) else enumerate(first)
    filled = [(k, dts[k] if k in dts else None if v is None else Withheld(f"output field {k!r}", why))
              for k, v in items]
    if isinstance(first, dict):
        return type(first)(**dict(filled)) if type(first) is not dict else dict(filled)
    return type(first)(v for _, v in filled)


def _run(pipe, st, sched, kinds, handlers) -> None:
    import time

    from .simulate import Record

    with pipe._step_guard():
        for rank, a in pipe._program(keep=kinds, schedule=sched):
            start = time.perf_counter()
            pipe._run(handlers[a.kind], a, st)
            st.records.append(Record(rank, a.kind, a.stage, a.microbatch, start, time.perf_counter()))


# ---- the logits ------------------------------------------------------------------------------------------------
def last_mesh(pipe):
    """The last stage's mesh: its [data, model] sub-mesh, or a one-rank mesh when the stages hold plain tensors."""
    mesh = pipe.meshes.get(pipe.plan.num_stages - 1)
    if mesh is not None:
        return mesh
    if getattr(pipe, "_external_mesh", None) is None:       # made on every rank at the same call: same groups
        from autoparallel.comm.world import current_world
        from autoparallel.mesh import ProcessMesh

        last = (pipe.plan.num_stages - 1) % pipe.plan.pp
        if pipe.ranks is not None:                             # launched ranks: the last stage's ranks
            pipe._external_mesh = ProcessMesh(pipe.ranks[last].tolist(), ["data", "model"])
        else:
            pipe._external_mesh = ProcessMesh([[last if current_world().is_simulated else 0]], ["data", "model"])
    return pipe._external_mesh


def assemble(pipe, outs: list, m: int, dp: int):
    """(the logits DistTensor, {rank: leaf}) from the last stage's micro-batch outputs."""
    from autoparallel.dist_tensor import dtensor_from_local, is_dist
    from autoparallel.placement import Replicate, Shard

    mesh = last_mesh(pipe)
    if not outs:                                               # a launched rank of another stage
        placements, shape, dtype = meta(pipe, mesh, None)
        per_rank = {}
    elif is_dist(outs[0]):
        placements = list(outs[0].placements)
        per_rank = {r: [o.local_of(r) for o in outs] for r in outs[0].locals}
        shape, dtype = list(outs[0].shape), outs[0].dtype
    else:
        placements = [Replicate()] * mesh.ndim
        per_rank = {mesh.process_ids[0] if pipe.ranks is None else pipe.rank: list(outs)}
        shape, dtype = list(outs[0].shape), outs[0].dtype
    if outs:
        shape[0] *= m                                          # the whole batch's logits
        if pipe.ranks is not None:
            meta(pipe, mesh, (placements, shape, dtype))
    rows = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    data = mesh.dim_names.index("data") if "data" in mesh.dim_names else None
    if rows not in ([], [data]) or (rows == [] and dp > 1 and data is not None and mesh.shape[data] != dp):
        raise NotImplementedError(f"loss_fn(model(x), y): the last pipeline stage's output has placements "
                                  f"{[str(p) for p in placements]}; its batch dim must be whole or sharded over the "
                                  f"data ranks alone")
    leaves_, locals_ = {}, {}
    back = None if rows or dp == 1 or not per_rank else _inverse(shape[0], m, dp)
    for r, parts in per_rank.items():
        leaf = paddle.concat([p.detach() for p in parts], axis=0)
        leaf.stop_gradient = False
        leaves_[r] = leaf
        locals_[r] = leaf if back is None else paddle.index_select(leaf, back, axis=0)
    return dtensor_from_local(locals_, mesh, placements, global_shape=shape, dtype=dtype), leaves_


_DTYPES = ("float32", "float64", "float16", "bfloat16")
_WIDTH = 12                                                    # ndim, 8 dims, dtype, 2 placements


def meta(pipe, mesh, known):
    """Launched ranks: the logits' (placements, global shape, dtype) on every rank, from the last stage's first rank
    (``known`` there, None elsewhere) by one sum over the world (loss_sync.py); every rank calls it at the same
    point."""
    from autoparallel.core.spec import normalize_dtype
    from autoparallel.placement import Partial, Replicate, Shard

    from .loss_sync import exchange

    v = [0] * _WIDTH
    if known is not None and pipe.rank == mesh.process_ids[0]:
        placements, shape, dtype = known
        if len(shape) > 8 or mesh.ndim > 2:
            raise NotImplementedError(f"loss_fn(model(x), y): logits of shape {shape} on a {mesh.ndim}-d mesh")
        v[0], v[1:1 + len(shape)] = len(shape), [int(n) for n in shape]
        v[9] = 1 + _DTYPES.index(normalize_dtype(dtype))
        for k, p in enumerate(placements):
            v[10 + k] = 0 if isinstance(p, Replicate) else p.dim + 1 if isinstance(p, Shard) else -1
    v = [int(round(x)) for x in exchange("forward", v)]
    if known is not None:
        return known
    placements = [Replicate() if c == 0 else Shard(c - 1) if c > 0 else Partial("sum") for c in v[10:10 + mesh.ndim]]
    return placements, v[1:1 + v[0]], _DTYPES[v[9] - 1]


def _inverse(n: int, m: int, dp: int):
    pos = [0] * n
    for j, src in enumerate(order(n, m, dp)):
        pos[src] = j
    return paddle.to_tensor(pos, dtype="int64")


# ---- the backward ----------------------------------------------------------------------------------------------
class PipelineBackward:
    """A record in the logits' cross-mesh ancestry: ``resume`` runs the pipeline's backward once the user's loss
    graph has given the logits leaves their gradients (cross_mesh_grad.backward)."""

    def __init__(self, pipe, st, sched, leaves_: dict):
        self.seq = next(cross_mesh_grad._SEQ)
        self.back, self.why, self.sent, self.buf, self.done = (), None, None, None, False
        self.pipe, self.st, self.sched, self.leaves = pipe, st, sched, leaves_
        self.retain_why = ("loss.backward(retain_graph=True) through the logits of a pipeline-parallel model called "
                           "without labels: the pipeline's backward runs each micro-batch's graph once (its "
                           "collectives cannot run twice); sum the losses and call backward once")

    def synced_item(self, t):
        return synced_item(t)

    def sync_values(self, roots) -> None:
        sync_values(roots)

    def resume(self) -> None:
        from .amp import USER_BACKWARD
        from .shared_params import reduced_after_step

        if self.st is None:
            raise RuntimeError("the pipeline's backward of these logits already ran (backward twice)")
        pipe, st, m = self.pipe, self.st, self.pipe.plan.micro_batches
        self.st = None
        last = pipe.plan.num_stages - 1
        if pipe.holds_last:
            out0 = st.saved[(last, 0)][1]
            if isinstance(self.leaves, list):                # several heads: one gradient per head
                per = [_micro_inbox(lv, o, m) for lv, o in zip(self.leaves, out0)]
                for i in range(m):
                    st.inbox_b[(last, i)] = [p[i] for p in per]
            else:
                for i, g in enumerate(_micro_inbox(self.leaves, out0, m)):
                    st.inbox_b[(last, i)] = g
        handlers = {"B": pipe._backward, "W": pipe._weight, "SEND_B": pipe._send_b, "RECV_B": pipe._recv_b}
        with reduced_after_step(pipe):
            _run(pipe, st, self.sched, BACKWARD, handlers)
        leftovers = {k: len(v) for k, v in (("saved", st.saved), ("inbox_b", st.inbox_b),
                                            ("input_grads", st.input_grads)) if v}
        if leftovers or pipe.transport.pending():
            raise RuntimeError(f"the pipeline's backward ended with unconsumed state {leftovers}")
        pipe.records = st.records
        for leaves_ in self.leaves if isinstance(self.leaves, list) else [self.leaves]:
            for leaf in leaves_.values():
                leaf.clear_gradient(False)
        if getattr(pipe, "grads_scaled_by", None) is None:
            pipe.grads_scaled_by = USER_BACKWARD


def _micro_inbox(leaves_: dict, out0, m: int) -> list:
    """Per micro-batch, the last stage's gradient of one output from its logits leaves (every rank's shards in the
    simulated world)."""
    from .shards import _Shards, _local

    grads = {r: micro_grads(_grad(leaf), m) for r, leaf in leaves_.items()}
    if isinstance(_local(out0), _Shards):
        return [_Shards([grads[r][i] for r in out0.mesh.process_ids]) for i in range(m)]
    return [next(iter(grads.values()))[i] for i in range(m)]


def micro_grads(g, m: int) -> list:
    """A rank's gradient of its logits shard, cut into its ``m`` micro-batches' gradients."""
    return paddle.split(g, m, axis=0)


def _grad(leaf):
    return leaf.grad.detach() if leaf.grad is not None else paddle.zeros_like(leaf)



# ---- the loss's value on every rank ----------------------------------------------------------------------------
def synced_item(t):
    """``t.item()`` of a one-element tensor computed from a pipeline's logits, kept on the tensor (value_cache.py):
    on launched ranks the last stage's first rank reports it by one exchange over the world (loss_sync.py: every
    rank calls it; a read on some ranks only raises ``LossReadOnSomeRanksError`` on every rank); in one process
    and the simulated world the gathered value. None for a tensor of more elements in one process
    (``DistTensor.item`` as before)."""
    import numpy as np

    from autoparallel import value_cache
    from autoparallel.comm.world import current_world

    from .loss_sync import exchange

    world = current_world()
    one = int(np.prod(t.shape, dtype=np.int64)) == 1
    local = world.is_simulated or world.world_size == 1
    if not one:
        if local:
            return None
        raise ValueError(f"item() of a tensor with {list(t.shape)} elements: only one-element tensors have a value")
    value = _value(t, world) if local else as_dtype(t, exchange("item", [_value(t, world)])[0])
    value_cache.keep(t, value)
    return value


def _value(t, world):
    """``t``'s value on the rank that reports it (the first of its mesh, or any in one process), 0.0 elsewhere;
    every rank of ``t``'s mesh gathers it (a collective of that mesh)."""
    local = world.is_simulated or world.world_size == 1
    if not (local or t.mesh.contains(world.rank)):
        return 0.0
    with paddle.no_grad():
        value = t.full().item()
    return value if local or world.rank == t.mesh.process_ids[0] else 0.0


def as_dtype(t, value: float):
    """An exchanged float as ``item()`` gives it for ``t``'s dtype."""
    dt = str(t.dtype).replace("paddle.", "")
    return bool(value) if dt == "bool" else int(round(value)) if "int" in dt else value


def sync_values(roots) -> None:
    """At ``loss.backward()`` (every rank, the same records): the value of every one-element root computed from a
    pipeline's logits, and of the one-element tensors it was computed from (``loss`` of ``(loss / accum)``),
    reaches every rank by one exchange (twelve values each) and is kept on the tensor, so a later ``float(loss)``
    on any one rank is local. Always one exchange on launched ranks, none of them
    one-element or not: a read made before on some ranks only meets it and fails on every rank."""
    from autoparallel import value_cache
    from autoparallel.comm.world import current_world

    from .loss_sync import PAYLOAD, exchange

    world = current_world()
    ts = [t for t in cross_mesh_grad.one_element_sources(roots)
          if any(getattr(r, "synced_item", None) is not None for r in cross_mesh_grad.ancestry(t))]
    values = [_value(t, world) for t in ts]
    if not (world.is_simulated or world.world_size == 1):
        values = [v for k in range(0, max(len(ts), 1), PAYLOAD)
                  for v in exchange("backward", values[k:k + PAYLOAD])[:len(ts[k:k + PAYLOAD])]]
    for t, v in zip(ts, values):
        value_cache.keep(t, as_dtype(t, v))
