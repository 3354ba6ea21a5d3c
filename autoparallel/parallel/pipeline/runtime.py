"""Pipeline runtime: every rank executes its schedule's action list on its stage modules.

    pipe = apply_pp(model, strategy, tp_plan=None)        # stages, sub-meshes, process groups
    opt = pipe.wrap_optimizer(paddle.optimizer.AdamW(parameters=model.parameters()))
    loss = pipe.train_batch(ids, labels)                  # or: pipe(ids, labels=labels).backward() (called.py)
    opt.step(); opt.clear_grad()

``train_batch`` cuts the global batch into ``micro_batches`` equal micro-batches and runs this rank's actions in
order: ``F`` runs the stage forward (the first stage embeds the micro-batch, the last computes ``loss_fn(logits,
labels) / micro_batches``), ``SEND_F`` / ``RECV_F`` move activations to the next stage, ``B`` runs the backward with
the received output gradient (the last stage from its loss), ``SEND_B`` / ``RECV_B`` move input gradients back, ``W``
computes the deferred Linear weight gradients (ZB-H1). Gradients accumulate over micro-batches, so after
``train_batch`` every parameter holds the gradient of the mean loss over the global batch: the same as one big batch
in a single process. Parameters shared by stages on different ranks (a tied embedding / LM head) then get the step's
gradients all-reduced between those ranks (shared_params.py). Data-parallel partial gradients are reduced by the
optimizer wrapper (``shard_optimizer``).

A stage with data or tensor parallelism inside runs on its own ``[data, model]`` sub-mesh with
DistTensors; activations cross stages in the boundary layout (``Shard(0)`` on ``data``, replicated on
``model``), each rank exchanging its local shard with the rank of the same coordinates in the next stage.

In a world of one process ``apply_pp`` builds every stage here and runs all action lists interleaved (a transfer
is a hand-off): the same code path, for debugging and fast tests. In the simulated world the same happens with every
stage on its own ``[data, model]`` sub-mesh holding every rank's shard, so data and tensor parallelism inside stages
run too: a transfer hands every rank's shard to the rank of the same coordinates in the next stage.

Each executed action is recorded as ``Record(rank, kind, stage, microbatch, start, end)`` (pipeline rank,
``time.perf_counter`` seconds) in ``pipe.records``; ``timeline.plot_timeline(pipe.records)`` draws them.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import paddle

from . import batch as batch_mod
from .amp import batch_loss_scale
from .call_forms import detect as detect_call_forms, missing_attribute
from .shared_params import reduced_after_step, sum_tied
from .shards import _Shards, _backprop, _input_grad, _local  # noqa: F401
from .simulate import PipelineDeadlock, Record
from .wiring import (DATA, MODEL, PIPE, _check_composable, _model_info, _p2p_pairs, _shard_stage,  # noqa: F401
                     _shared_parameters, _simulated, _simulated_stage_meshes, _stage_meshes, _world, _world_loss,
                     bind_optimizer, pipeline_ranks, zero_config)
from .zero_bubble import WeightGradStore


class _StepState:
    def __init__(self, inputs, labels):
        self.inputs, self.labels = inputs, labels
        self.saved = {}          # (stage, mb) -> (stage input (local, grad-requiring) or None, output or loss)
        self.inbox_f = {}        # (stage, mb) -> received activation
        self.inbox_b = {}        # (stage, mb) -> received gradient of the stage output
        self.input_grads = {}    # (stage, mb) -> gradient of the stage input, to send back
        self.sent_headers = set()    # forward channels whose shape header went out this step
        self.shapes = {}             # forward channel -> (shape, dtype) from its header this step
        self.loss = 0.0
        self.weights = None          # factor of each micro-batch's loss (batch.loss_weights)
        self.outputs = []            # eval_batch without labels: the last stage's output per micro-batch
        self.scale = 1.0             # the last stage's backward runs on loss x scale (AMP loss scaling)
        self.external = False        # loss_fn(model(x), y): the last stage keeps its output for a given gradient
        self.records = []


class PipelineModule:
    """Executes a ``PipelinePlan`` on the stages of the pipeline ranks this process holds.

    ``stages``: every ``PipelineStage`` (only the held ones run); ``held``: pipeline ranks run here (one in
    a real job, all of them in a single process); ``transport``: ``p2p.RankTransport`` or
    ``p2p.LocalTransport``; ``meshes``: {stage: [data, model] ProcessMesh} for stages running on
    DistTensors (empty: plain tensors); ``tied``: [(parameter, group)] all-reduced after each step;
    ``sync_loss``: callable(local loss or None) -> the loss every rank returns."""

    def __init__(self, plan, stages, held, transport, meshes=None, loss_fn=None, tied=(), sync_loss=None,
                 zero_bubble: bool = False):
        self.plan, self.stages, self.held = plan, list(stages), sorted(held)
        self.transport = transport
        self.meshes = dict(meshes or {})
        self.loss_fn = loss_fn if loss_fn is not None else _cross_entropy
        self.tied = list(tied)
        self._sync_loss = sync_loss
        self.zero_bubble = zero_bubble
        self.weight_grads = WeightGradStore()
        self.held_stages = sorted(s for r in self.held for s in plan.stages_of(r))
        self.records: list = []
        self.original_names: dict = {}       # id(parameter as the model built it) -> model name
        self.pp_rank = self.held[0] if len(self.held) == 1 else None    # set by apply_pp on real ranks
        self.rank, self.coords, self.ranks = 0, (0, 0), None
        self.loss_scaler = None              # strategy.amp: the last stage's backward runs on the scaled loss
        self.zero = None                     # strategy.sharding: (stage, degree, offload) for wrap_optimizer (zero.py)
        self.failed = None                   # real ranks: what made a step fail (no further step runs)

    def no_sync(self):
        """paddle.DataParallel's accumulation context has no meaning here: ``train_batch`` runs the micro-batches."""
        raise NotImplementedError("no_sync() on a pipeline-parallel model: train_batch(...) already accumulates "
                                  "the micro-batches and reduces once; set strategy.pipeline_parallel.micro_batches "
                                  "instead of calling backward under no_sync")

    def __call__(self, *args, **kwargs):
        """The model's call: in training a whole schedule step whose loss backward() applies (called.py)."""
        from .called import call
        return call(self, args, kwargs)

    forward = __call__
    __name__ = "PipelineModule"         # paddle.jit.to_static(pipe) copies it (the call then runs in dygraph mode)
    __getattr__ = missing_attribute     # the model's other methods (generate, state_dict): AttributeError saying why

    # ---- what this process holds --------------------------------------------------------------------------
    @property
    def schedule(self):
        return self.plan.schedule

    @property
    def holds_first(self) -> bool:
        return 0 in self.held_stages

    @property
    def holds_last(self) -> bool:
        return self.plan.num_stages - 1 in self.held_stages

    def named_parameters(self):
        """(model name, parameter) of the held stages, each parameter once."""
        seen = set()
        for s in self.held_stages:
            for name, p in self.stages[s].named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def parameters(self) -> list:
        return [p for _, p in self.named_parameters()]

    training = property(lambda self: any(self.stages[s].training for s in self.held_stages))

    def train(self):
        return self._mode(True)

    def eval(self):
        return self._mode(False)

    def _mode(self, training: bool):
        """Every held stage, and the model the stages run: a stage calls the model's own ``embed`` / ``head``
        and its parameter-free layers, which read the model's ``training`` (dropout stayed on under ``eval()``)."""
        models = {id(st.pieces.model): st.pieces.model for st in self.stages if hasattr(st, "pieces")}
        for layer in [self.stages[s] for s in self.held_stages] + list(models.values()):
            layer.train() if training else layer.eval()
        return self

    def wrap_optimizer(self, optimizer):
        """Point a paddle optimizer (built over the model's parameters or over ``parameters()``) at this
        rank's stage parameters and wrap it with ``shard_optimizer``; returns the wrapper."""
        return bind_optimizer(optimizer, self)

    def checkpoint_state(self, optimizer=None) -> dict:
        """This rank's stage parameters and optimizer states under the model's (un-pipelined) names, other
        stages' entries marked as held elsewhere (``ap.training_state``; checkpoint/pipeline_state.py)."""
        from autoparallel.checkpoint.pipeline_state import pipeline_training_state

        return pipeline_training_state(self, optimizer)

    # ---- one step -----------------------------------------------------------------------------------------
    def train_batch(self, inputs, labels=None, scaler=None) -> float | None:
        """Forward and backward of one global batch through the pipeline (gradients accumulate; call the
        optimizer afterwards). Every rank passes the same batch (for a model with embed()/head(), ranks that
        hold neither the first nor the last stage may pass None). Returns the mean loss (on every rank when ``sync_loss`` is set, else on
        the last stage's ranks and None elsewhere). ``scaler``: a ``paddle.amp.GradScaler`` whose scale the
        backward runs on (then ``scaler.step(opt); scaler.update()``); under ``strategy.amp`` the pipeline
        scales its loss itself (amp.py)."""
        st = self._step_state(*batch_mod.labels_from_inputs(inputs, labels, "train_batch"))
        st.scale = batch_loss_scale(self, scaler)
        self.weight_grads.pending.clear()                 # nothing carries over from a failed step
        handlers = {"F": self._forward, "B": self._backward, "W": self._weight, "SEND_F": self._send_f,
                    "RECV_F": self._recv_f, "SEND_B": self._send_b, "RECV_B": self._recv_b}
        clock = time.perf_counter
        with self._step_guard(), reduced_after_step(self):          # the step's own tied gradients summed
            for rank, a in self._program():
                start = clock()
                self._run(handlers[a.kind], a, st)
                st.records.append(Record(rank, a.kind, a.stage, a.microbatch, start, clock()))
        leftovers = {k: len(v) for k, v in (("saved", st.saved), ("inbox_f", st.inbox_f), ("inbox_b", st.inbox_b),
                                            ("input_grads", st.input_grads)) if v}
        if leftovers or len(self.weight_grads) or self.transport.pending():
            raise RuntimeError(f"pipeline step ended with unconsumed state {leftovers}; the action lists are "
                               f"inconsistent")
        self.records = st.records
        loss = st.loss if self.holds_last else None
        return self._sync_loss(loss) if self._sync_loss is not None else loss

    @contextlib.contextmanager
    def _step_guard(self):
        """A step after a failed one: in one process the mailbox is emptied; on real ranks transfers of the failed
        step may still be in flight to or from the peers, which would pair with the next step's: refused."""
        if self.failed is not None:
            raise RuntimeError(f"a previous pipeline step failed on this rank ({self.failed}); its transfers may "
                               f"still be pending with the other pipeline ranks, so no further step can run in step "
                               f"with them: restart the job (resume from the last checkpoint)")
        self.transport.reset()
        try:
            yield
        except BaseException as e:
            if self.ranks is not None:
                self.failed = f"{type(e).__name__}: {str(e)[:200]}"
            raise

    def _run(self, handler, a, st) -> None:
        """One action; a failed transfer on real ranks names the peer, which has most likely raised first."""
        try:
            handler(a, st)
        except Exception as e:
            if not a.is_comm or self.ranks is None:
                raise
            raise RuntimeError(f"pipeline rank {self.pp_rank} (global rank {self.rank}): {a.kind} of micro-batch "
                               f"{a.microbatch} with pipeline rank {a.peer_rank} failed ({type(e).__name__}: "
                               f"{str(e)[:200]}); the peer has most likely raised first: see its log") from e

    def _step_state(self, inputs, labels, need_labels: bool = True) -> _StepState:
        """The step's micro-batches; every rank checks the labels it is given (not only the last stage's), so a bad
        batch fails on every rank before any transfer."""
        batch_mod.refuse_guard("a pipeline")         # on every rank: the pipeline cuts its batches itself
        every = self.plan.pieces.generic             # a model split at its blocks: every stage needs the inputs
        keep = self.holds_last and need_labels
        cut = self._micro(labels, "labels") if keep or labels is not None else None
        st = _StepState(self._micro(inputs, "inputs") if self.holds_first or every else None, cut if keep else None)
        if not every and any(isinstance(b, dict) for b in st.inputs or ()):
            raise TypeError(f"train_batch inputs: a dict of model keyword inputs needs a model split at its blocks "
                            f"(it runs model(**inputs)); {type(self.plan.pieces.model).__name__} runs through its "
                            f"embed(ids) method, which takes the ids tensor")
        if cut is not None and st.inputs is not None:
            batch_mod.check_samples(st.inputs, cut)
        if st.labels is not None:
            st.weights = batch_mod.loss_weights(st.labels, self.loss_fn is _cross_entropy)
        return st

    def eval_batch(self, inputs, labels=None, compute_loss=None):
        """Forward only (no gradient, no backward) of one global batch: the mean loss with labels, else the last
        stage's output (evaluate.py)."""
        from .evaluate import eval_batch

        return eval_batch(self, inputs, labels, compute_loss)

    def clear_gradients(self, set_to_zero: bool = True) -> None:
        """Clear the gradients of this rank's stage parameters (``paddle.nn.Layer.clear_gradients``)."""
        for s in self.held_stages:
            self.stages[s].clear_gradients(set_to_zero)

    def _program(self, keep=None, schedule=None):
        """(pipeline rank, action) in execution order: the rank's own list, or with several ranks held,
        all lists interleaved, each advancing while its next receive has its message. ``keep``: the action
        kinds to run (a sub-list of every rank's list keeps the one global order, so it cannot deadlock);
        ``schedule``: another schedule of the plan's stages (external_loss.py)."""
        lists = {r: [a for a in (schedule or self.schedule)[r] if keep is None or a.kind in keep] for r in self.held}
        if len(lists) == 1:
            (r, acts), = lists.items()
            yield from ((r, a) for a in acts)
            return
        ptr = {r: 0 for r in lists}
        while any(ptr[r] < len(acts) for r, acts in lists.items()):
            progress = False
            for r, acts in lists.items():
                while ptr[r] < len(acts) and self.transport.ready(acts[ptr[r]]):
                    ptr[r] += 1
                    progress = True
                    yield r, acts[ptr[r] - 1]
            if not progress:
                stuck = [f"rank {r} at {acts[ptr[r]]}" for r, acts in lists.items() if ptr[r] < len(acts)]
                raise PipelineDeadlock("pipeline deadlock in one process: " + "; ".join(stuck))

    def _micro(self, batch, what: str) -> list:
        return batch_mod.split(batch, self.plan.micro_batches, self._dp(), what)

    def _dp(self) -> int:
        mesh = next(iter(self.meshes.values()), None)
        return mesh.get_dim_size("data") if mesh is not None and "data" in mesh.dim_names else 1

    # ---- layouts ------------------------------------------------------------------------------------------
    def _boundary(self, mesh):
        from autoparallel.placement import Replicate, Shard

        return [Shard(0) if n == "data" else Replicate() for n in mesh.dim_names]

    def _place(self, t, stage: int):
        """A model input / label micro-batch (the same on every rank) on the stage's mesh."""
        mesh = self.meshes.get(stage)
        if mesh is None:
            return t
        from autoparallel.dist_tensor import shard_tensor

        if isinstance(t, dict):                 # model keyword inputs: cut over the data ranks, broadcast ones whole
            return batch_mod.place_dict(t, mesh, self._boundary(mesh))
        return shard_tensor(t, mesh, self._boundary(mesh))

    def _side(self, t, stage: int):
        """Model inputs of a later stage of a model split at its blocks (they recompute its side inputs)."""
        return t

    def _wrap(self, local, stage: int):
        mesh = self.meshes.get(stage)
        if mesh is None:
            return local
        from autoparallel.dist_tensor import dtensor_from_local

        shards = list(local.tensors) if isinstance(local, _Shards) else local
        return dtensor_from_local(shards, mesh, self._boundary(mesh))

    def _to_boundary(self, out, stage: int):
        from autoparallel.dist_tensor import DistTensor, reshard

        mesh = self.meshes.get(stage)
        if mesh is None or not isinstance(out, DistTensor):
            return out
        want = self._boundary(mesh)
        return out if list(out.placements) == want else reshard(out, mesh, want)

    # ---- compute ------------------------------------------------------------------------------------------
    def _forward(self, a, st):
        s, i = a.stage, a.microbatch
        stage = self.stages[s]
        if s == 0:
            x_local, x = None, self._place(st.inputs[i], s)
        else:
            x_local = st.inbox_f.pop((s, i), None)
            if x_local is None:                                   # previous stage on this rank
                x_local = _local(st.saved[(s - 1, i)][1]).detach()
            x_local.stop_gradient = False
            x = self._wrap(x_local, s)
        from . import external_loss
        kw = {"whole": True} if st.external and stage.is_last and stage.pieces.generic and self.ranks is None else {}
        out = stage(x, **kw) if s == 0 or not stage.pieces.generic else stage(x, inputs=self._side(st.inputs[i], s), **kw)
        if stage.is_last and st.labels is None:               # eval_batch without labels: keep the logits
            st.outputs.append(out)
            st.saved[(s, i)] = (x_local, external_loss.saved(out, st.inputs and st.inputs[i]) if st.external else None)
        elif stage.is_last:
            batch_mod.check_labels(out.shape, st.labels[i].shape, self.loss_fn is _cross_entropy)
            fn = batch_mod.summed_cross_entropy if self.loss_fn is _cross_entropy else self.loss_fn
            loss = fn(out, self._place(st.labels[i], s)) * st.weights[i]
            st.loss += float(loss)
            st.saved[(s, i)] = (x_local, loss * st.scale if st.scale != 1.0 else loss)
        else:
            st.saved[(s, i)] = (x_local, self._to_boundary(out, s))

    def _backward(self, a, st):
        s, i = a.stage, a.microbatch
        x_local, out = st.saved.pop((s, i))
        capture = self.weight_grads.capture((s, i)) if self.zero_bubble else contextlib.nullcontext()
        with capture:
            if self.stages[s].is_last and not st.external:
                out.backward()
            else:
                g = st.inbox_b.pop((s, i), None)
                if g is None:                                     # next stage on this rank
                    g = st.input_grads.pop((s + 1, i))
                _backprop(_local(out), g)
        if x_local is not None:
            st.input_grads[(s, i)] = _input_grad(x_local)

    def _weight(self, a, st):
        self.weight_grads.flush((a.stage, a.microbatch))

    # ---- transfers ----------------------------------------------------------------------------------------
    def _send_f(self, a, st):
        channel = (a.stage, a.peer)
        self.transport.send(a, _local(st.saved[(a.stage, a.microbatch)][1]), header=channel not in st.sent_headers)
        st.sent_headers.add(channel)

    def _recv_f(self, a, st):
        channel = (a.peer, a.stage)
        known = st.shapes.get(channel)
        t = self.transport.recv(a, *known) if known else self.transport.recv(a)
        st.shapes.setdefault(channel, (list(t.shape), t.dtype))
        st.inbox_f[(a.stage, a.microbatch)] = t

    def _send_b(self, a, st):
        self.transport.send(a, st.input_grads.pop((a.stage, a.microbatch)))

    def _recv_b(self, a, st):
        out = _local(st.saved[(a.stage, a.microbatch)][1])
        st.inbox_b[(a.stage, a.microbatch)] = self.transport.recv(a, list(out.shape), out.dtype)

    # ---- after the schedule -------------------------------------------------------------------------------
    def _reduce_tied(self):
        sum_tied(self.tied)


def _cross_entropy(logits, labels):
    import paddle.nn.functional as F

    return F.cross_entropy(logits, labels)


# ---- apply_pp: plan, meshes, process groups, sharding (the helpers: wiring.py) ----------------------------------
def apply_pp(model, strategy=None, *, mesh=None, tp_plan: dict | None = None, loss_fn=None, cost: str = "flops",
             seq_len: int | None = None, layers_name: str | None = None, sync_loss: bool = True) -> PipelineModule:
    """Split ``model`` into pipeline stages and set up this rank's part of the pipeline.

    ``strategy``: an ``ap.Strategy`` with ``pipeline_parallel.degree >= 2`` (micro_batches, schedule,
    vpp_degree, split_points) and optionally data / tensor parallel degrees; world = dp x tp x pp.
    ``mesh``: a ProcessMesh with dims named from ``("pipe", "data", "model")`` ("pipe" required; default:
    ranks 0..world-1 as ``[pipe, data, model]``, model fastest); stage k runs on the ``[data, model]``
    sub-mesh at ``pipe = k``. ``tp_plan``: {layer pattern: style} applied inside every stage when tp > 1
    (patterns matching no layer of a stage are skipped there). ``loss_fn(logits, labels)``: default
    mean cross-entropy. ``cost``: "flops" (``ap.trace``) or "params" for the balanced split.

    Every rank must build the same model (same seed) and call this with the same arguments. All input
    checks run before any process-group work; the groups (stage sub-meshes, one 2-rank group per pair
    of neighbouring ranks, one per set of ranks sharing a tied parameter) are created in one fixed
    order on every rank. In a world of one process every stage runs here (see the module docstring)."""
    from autoparallel.strategy import Strategy
    from . import amp, zero_bubble
    from .p2p import LocalTransport, P2P, RankTransport, create_groups, create_pair_groups
    from .stage import apply_recompute, build_stages, plan_pipeline

    if not isinstance(model, paddle.nn.Layer):
        raise TypeError(f"apply_pp expects the model as a paddle.nn.Layer, got {type(model).__name__}")
    strategy = Strategy() if strategy is None else strategy
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be an ap.Strategy, got {type(strategy).__name__}")
    world, rank = _world()
    sim = _simulated()
    degrees = strategy.validate(world_size=None if world == 1 else world, model_info=_model_info(model))
    _check_composable(strategy, degrees)
    pp, dp, tp = degrees.pp, degrees.dp, degrees.tp
    if world == 1 and dp * tp > 1 and not sim:
        raise ValueError(f"one process runs every pipeline stage but not data or tensor parallelism inside them; "
                         f"got data_parallel.degree={dp}, tensor_parallel.degree={tp}: launch dp x tp x pp = "
                         f"{dp * tp * pp} ranks")
    if tp > 1 and not tp_plan:
        raise ValueError(f"tensor_parallel.degree={tp} inside pipeline stages needs a tp_plan "
                         f"({{layer pattern: style}}), got {tp_plan!r}")
    c = strategy.pipeline_parallel
    plan = plan_pipeline(model, pp, degrees.num_micro_batches, c.schedule, degrees.vpp, list(c.split_points) or None,
                         cost, seq_len, layers_name)
    plan.pieces.call_forms = detect_call_forms(model, plan.pieces)      # before any sharding (call_forms.py)
    ranks = pipeline_ranks(pp, dp, tp, mesh)
    if world > 1 and ranks.size != world:
        raise ValueError(f"the pipeline mesh has {ranks.size} ranks, expected the world size {world}")
    stages = build_stages(plan.pieces, plan.bounds)
    if strategy.recompute.enable:
        apply_recompute(stages, strategy.recompute.granularity, strategy.recompute.checkpoint_every_n_layers)
    zb = plan.schedule.name == "ZB-H1"
    names = {id(p): n for st in stages for n, p in st.named_parameters()}
    if world == 1 or sim:                                  # every stage in this process
        meshes = _simulated_stage_meshes(stages, ranks, tp_plan if tp > 1 else None) if dp * tp > 1 else {}
        for st in stages:
            if zb:
                zero_bubble.install(st)
        pipe = PipelineModule(plan, stages, range(pp), LocalTransport(), meshes=meshes, loss_fn=loss_fn,
                              zero_bubble=zb)
        pipe.original_names, pipe.zero, pipe.schedule_chosen = names, zero_config(strategy), c.schedule_chosen()
        if strategy.amp.enable:
            amp.install(pipe, model, strategy.amp)
        return pipe

    pp_rank, d, t = (int(x) for x in np.argwhere(ranks == rank)[0])
    # process groups: the same calls in the same order on every rank
    stage_meshes = _stage_meshes(ranks) if dp * tp > 1 else None
    p2p_groups = create_pair_groups(_p2p_pairs(plan.schedule, ranks))
    shared = _shared_parameters(stages, pp)
    tie_sets = sorted({ranks_ for ranks_, _ in shared})
    tie_lists = [[int(ranks[r, dd, tt]) for r in rs] for rs in tie_sets for dd in range(dp) for tt in range(tp)]
    tie_groups = dict(zip([(rs, dd, tt) for rs in tie_sets for dd in range(dp) for tt in range(tp)],
                          create_groups(tie_lists)))
    # this rank's stages
    held = plan.stages_of(pp_rank)
    meshes = {}
    for s in held:
        if stage_meshes is not None:
            meshes[s] = stage_meshes[pp_rank]
            _shard_stage(stages[s], meshes[s], tp_plan if tp > 1 else None)
        if zb:
            zero_bubble.install(stages[s])
    tied = []
    for rs, stage_names in shared:
        if pp_rank in rs:
            s = next(k for k in held if k in stage_names)
            tied.append((dict(stages[s].named_parameters())[stage_names[s]], tie_groups[(rs, d, t)]))
    transport = RankTransport(P2P(rank, p2p_groups), lambda r: int(ranks[r, d, t]))
    reporter = pp_rank == (plan.num_stages - 1) % pp and d == 0 and t == 0
    pipe = PipelineModule(plan, stages, [pp_rank], transport, meshes=meshes, loss_fn=loss_fn, tied=tied,
                          sync_loss=_world_loss(reporter) if sync_loss else None, zero_bubble=zb)
    pipe.original_names, pipe.zero, pipe.schedule_chosen = names, zero_config(strategy), c.schedule_chosen()
    pipe.ranks, pipe.rank, pipe.pp_rank, pipe.coords = ranks, rank, pp_rank, (d, t)
    if strategy.amp.enable:
        amp.install(pipe, model, strategy.amp)
    return pipe
