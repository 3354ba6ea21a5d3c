"""ap.to_static: capture the training step once, complete every layout over the whole graph, then execute
with those layouts pinned (dispatch asks no rule per step).

    dist_model = ap.to_static(model, loader, loss_fn, optimizer, strategy=s)
    for x, y in loader:
        loss = dist_model.train_step((x, y))          # one optimizer step; returns the global loss
    print(dist_model)                                 # per-op placements and the collectives each inserts
    dist_model.graph                                  # the captured networkx op graph

Shapes come from ``input_spec`` (one ``InputSpec`` / ``(shape, dtype)`` / ``DistSpec`` per batch field) or from
the loader's metadata (``batch_size`` / ``global_batch_size`` and ``dataset[0]``); no batch is drawn from the
loader. A batch is ``(inputs..., label)``: the model takes all fields but the last, ``loss_fn(output, label)``.
With ``gradient_accumulation_steps = k`` a train_step batch holds k micro-batches along dim 0 (or is a list
of k micro-batches); the graph is captured at the micro-batch shape. Without a loss_fn the model takes every
``input_spec`` field; a loader's items are still (inputs..., label), and the label is not fed (paddle's split).

Strategy: ``auto_mode="semi"`` fixes the batch dim of every field sharded over "data" (dp > 1: the first ops
consume the batch as sharded; an ``input_spec`` entry given as a DistSpec is only where that field arrives,
completion may reshard it), the default
tensor-parallel plan's parameter layouts (tp > 1, GPT / LLaMA names or ``tp_plan``) and, with sequence
parallel, sequence-sharded outputs of every norm layer; completion chooses everything else.
``auto_mode="full"``: nothing is fixed but the user's own annotations; the mesh is [data, model] as square as
the world allows. ZeRO stage 1/2/3 shard the optimizer (stage 3 also the parameters, gathered around each layer's
use and released after it, as in eager mode) over "data". Recompute (full or selective) is applied to the model
before the capture: the ops of every recompute region are marked in the graph (``recompute rN`` in the listing)
and the region's re-run in backward replays the pinned layouts of its original forward. Pipeline parallel and AMP
are not supported in this mode yet.
"""
from __future__ import annotations

import contextlib

import numpy as np
import paddle

from autoparallel import layer_state
from autoparallel.api_dist_model import PaddleModes, StateDictForms
from autoparallel.graph.static_mesh import mesh_for
from autoparallel.placement import Replicate, Shard
from autoparallel.spec import DistSpec, input_shape_dtype, normalize_dtype

__all__ = ["to_static", "DistModel", "InputSpecMismatchError"]


class InputSpecMismatchError(ValueError):
    """A batch does not match the input spec the graph was captured with."""


# ---- shapes ------------------------------------------------------------------------------------------
def _spec_of(x, i):
    """(shape, dtype) of one input_spec entry."""
    shape, dtype = input_shape_dtype(x, f"input_spec[{i}]")
    return list(shape), normalize_dtype(dtype or "float32")


def _micro(spec, k, i):
    shape, dtype = spec
    if not shape or shape[0] % k:
        raise ValueError(f"batch field {i}: the batch dim {shape[:1]} must be divisible by "
                         f"gradient_accumulation_steps={k}")
    return [shape[0] // k] + shape[1:], dtype


# ---- strategy ----------------------------------------------------------------------------------------
def _check_knobs(s):
    knobs = [(s.pipeline_parallel.degree > 1, f"pipeline_parallel.degree={s.pipeline_parallel.degree}"),
             (s.amp.enable, f"amp ({s.amp.dtype})")]
    for on, what in knobs:
        if on:
            raise NotImplementedError(f"{what} is not supported by ap.to_static yet (supported: data, tensor and "
                                      f"sequence parallel, ZeRO stage 1, 2 and 3, recompute full and selective, "
                                      f"gradient accumulation, auto_mode 'full')")


def _apply_recompute(model, rc):
    """Recompute regions in the model's blocks, once per model (the capture marks their ops)."""
    from autoparallel.parallel.recompute import apply_ac

    want = (rc.granularity, rc.checkpoint_every_n_layers)
    have = layer_state.get(model, "recompute")
    if have is None:
        apply_ac(model, *want)
        layer_state.put(model, "recompute", want)
    elif have != want:
        raise ValueError(f"the model already recomputes {have[0]} every {have[1]} layers (an earlier "
                         f"ap.to_static); build a fresh model to recompute {want[0]} every {want[1]} layers")


def _check_tp_plan(tp_plan, mesh, full: bool) -> None:
    """A ``tp_plan`` acts only in auto_mode 'semi' over a 'model' dim of size > 1; otherwise it would be ignored."""
    if not tp_plan:
        return
    tp = mesh.shape[mesh.dim_index("model")] if "model" in mesh.dim_names else 1
    if full or tp == 1:
        why = "auto_mode='full' lays out every tensor itself" if full else "the mesh's 'model' dim has size 1"
        raise ValueError(f"ap.to_static: tp_plan={{{', '.join(map(repr, tp_plan))}}} would be ignored ({why}); "
                         f"expected auto_mode='semi' with tensor_parallel.degree > 1, or drop tp_plan (annotations= "
                         f"fixes layouts in either mode)")


def _semi_annotations(model, mesh, strategy, tp_plan):
    """Parameter and layer-output annotations implied by the strategy (semi mode)."""
    from autoparallel.parallel.model_families import resolve_tp_plan

    ann = {}
    tp = mesh.shape[mesh.dim_index("model")] if "model" in mesh.dim_names else 1
    if tp > 1:
        try:
            ann.update(resolve_tp_plan(model, tp, tp_plan))
        except ValueError:
            if tp_plan is not None:
                raise          # no template knows this model: completion lays out the model dim itself
    if strategy.sequence_parallel.enable and tp > 1:
        norms = [name for name, layer in model.named_sublayers() if name and type(layer).__name__.endswith("Norm")]
        if not norms:                  # sequence parallelism here is the norms' outputs on sequence shards
            raise NotImplementedError(f"ap.to_static: strategy.sequence_parallel.enable=True runs the model's norm "
                                      f"layers on sequence shards, but {type(model).__name__} has no *Norm sublayer, "
                                      f"so it would change nothing; drop it (or use ap.parallelize, whose row-parallel "
                                      f"layers reduce-scatter)")
        for name in norms:
            pl = [Shard(0) if n == "data" and mesh.shape[i] > 1 else Replicate() for i, n in enumerate(mesh.dim_names)]
            pl[mesh.dim_index("model")] = Shard(1)
            ann[name] = pl
    return ann


def _batch_layout(mesh, ndim):
    return [Shard(0) if n == "data" and mesh.shape[i] > 1 and ndim > 0 else Replicate()
            for i, n in enumerate(mesh.dim_names)]


# ---- the model ---------------------------------------------------------------------------------------
class DistModel(PaddleModes, StateDictForms):
    """A model, loss and optimizer whose layouts were completed over the captured training graph. paddle's call
    form (``dist_model.train()`` then ``dist_model(x, y)``) comes from ``PaddleModes`` (api_dist_model.py)."""

    def __init__(self, model, loss_fn, optimizer, plan, mesh, specs, k):
        self.network, self.loss_fn, self.plan, self.mesh = model, loss_fn, plan, mesh
        self._specs, self._k = specs, k
        self._n_inputs = plan.graph.graph["n_model_inputs"]
        self.optimizer = self._distribute(optimizer)

    # ---- layouts applied to the real parameters ---------------------------------------------------
    def _distribute(self, optimizer):
        from autoparallel.dist_tensor import is_dist, shard_tensor

        layouts = self.plan.param_layouts
        replaced = {}
        for prefix, sub in self.network.named_sublayers(include_self=True):
            for pname, p in list(sub._parameters.items()):
                if p is None:
                    continue
                if id(p) in replaced:
                    sub._parameters[pname] = replaced[id(p)]
                    continue
                name = f"{prefix}.{pname}" if prefix else pname
                want = layouts.get(name) or layouts.get(_name_of(self.network, p))
                if is_dist(p):
                    continue
                new = shard_tensor(p, self.mesh, list(want or [Replicate()] * self.mesh.ndim))
                replaced[id(p)] = new
                sub._parameters[pname] = new
        if optimizer is None:
            return None
        from autoparallel.parallel.accumulation import wrap_optimizer

        return wrap_optimizer(optimizer, replaced, self._k, "ap.to_static")

    # ---- batches ----------------------------------------------------------------------------------
    def _micro_batches(self, batch, k):
        n = len(self._specs)
        if isinstance(batch, list) and batch and isinstance(batch[0], (tuple, list)):
            if len(batch) != k:
                raise InputSpecMismatchError(f"expected {k} micro-batches (gradient_accumulation_steps), got "
                                             f"{len(batch)}")
            return [tuple(b) for b in batch]
        fields = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        if len(fields) != n:
            raise InputSpecMismatchError(f"expected a batch of {n} fields (inputs..., label) as in the input "
                                         f"spec, got {len(fields)}")
        if k == 1:
            return [fields]
        parts = []
        for i, f in enumerate(fields):
            shape = _shape_of(f)
            want = self._specs[i][0][0] * k
            if not shape or shape[0] != want:
                raise InputSpecMismatchError(f"batch field {i}: expected {k} micro-batches of "
                                             f"{self._specs[i][0][0]} along dim 0 ({want} rows), got shape {shape}")
            parts.append(_split0(f, k))
        return [tuple(p[j] for p in parts) for j in range(k)]

    def _place(self, x, i):
        from autoparallel.dist_tensor import DistTensor, reshard, shard_tensor

        shape, dtype = self._specs[i]
        layout = self.plan.input_layouts[i]
        if isinstance(x, np.ndarray):
            x = paddle.to_tensor(x)
        if not isinstance(x, (paddle.Tensor, DistTensor)):
            raise InputSpecMismatchError(f"batch field {i}: expected a tensor or ndarray of shape {shape} {dtype}, "
                                         f"got {type(x).__name__}")
        got_shape = list(x.shape)
        got_dtype = normalize_dtype(x.dtype)
        if got_shape != shape or got_dtype != dtype:
            hint = ("; the graph is captured at one batch size: drop a loader's last partial batch "
                    "(DataLoader(..., drop_last=True)) or capture another DistModel for it"
                    if got_dtype == dtype and got_shape[1:] == shape[1:] else "")
            raise InputSpecMismatchError(f"batch field {i}: expected shape {shape} {dtype} (the input spec the "
                                         f"graph was captured with), got {got_shape} {got_dtype}{hint}")
        if isinstance(x, DistTensor):
            if x.mesh != self.mesh:
                from autoparallel.dist_tensor_forms import same_ranks_view

                moved = same_ranks_view(x, self.mesh)
                if moved is None:
                    raise InputSpecMismatchError(
                        f"batch field {i} lives on mesh {x.mesh.short()} (ranks {x.mesh.mesh.tolist()}), the model "
                        f"on {self.mesh.short()} (ranks {self.mesh.mesh.tolist()}); lay the batches out on the "
                        f"model's mesh (shard_dataloader(meshes=...) or to_static(..., mesh=...))")
                x = moved
            return reshard(x, self.mesh, layout)
        return shard_tensor(x, self.mesh, list(layout), stop_gradient=True)

    def _forward(self, fields, with_loss=True):
        from autoparallel.dispatch import pinned

        xs = [self._place(f, i) for i, f in enumerate(fields)]
        n = self._n_inputs
        with pinned(self.plan.ops[:self._n_ops(with_loss)], self.plan.ordered_results(not with_loss)):
            out = self.network(*xs[:n])
            return self.loss_fn(out, *xs[n:]) if with_loss else out

    def _n_ops(self, with_loss):
        g = self.plan.graph
        return g.number_of_nodes() if with_loss else g.graph["n_model_ops"]

    # ---- steps ------------------------------------------------------------------------------------
    def train_step(self, batch) -> float:
        """One optimizer step on ``batch`` (its k micro-batches); returns the mean global loss."""
        if self.loss_fn is None or self.optimizer is None:
            raise TypeError("train_step needs a loss_fn and an optimizer: pass them to ap.to_static")
        self.network.train()
        total = 0.0
        micro = self._micro_batches(batch, self._k)
        for fields in micro:
            loss = self._forward(fields)
            loss.backward()
            total += float(loss)
        self.optimizer.step()
        self.optimizer.clear_grad()
        return total / len(micro)

    def eval_step(self, batch) -> float:
        """The mean global loss on ``batch`` without updating anything."""
        if self.loss_fn is None:
            raise TypeError("eval_step needs a loss_fn: pass it to ap.to_static")
        self.network.eval()
        with paddle.no_grad():
            micro = self._micro_batches(batch, self._k)
            total = sum(float(self._forward(f)) for f in micro)
        self.network.train()
        return total / len(micro)

    def _predict(self, inputs):
        """The model's output (a DistTensor; ``.full()`` gathers it) for one micro-batch of inputs."""
        fields = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        if len(fields) != self._n_inputs:
            raise InputSpecMismatchError(f"predict expects the {self._n_inputs} model input field(s), got "
                                         f"{len(fields)}")
        self.network.eval()
        with paddle.no_grad():
            out = self._forward(fields, with_loss=False)
        self.network.train()
        return out

    # ---- inspection -------------------------------------------------------------------------------
    @property
    def graph(self):
        """The captured op graph (networkx DiGraph; nodes carry op, layouts, sources, layer)."""
        return self.plan.graph

    def listing(self) -> str:
        """Per op: layer, rule, input and output placements, collectives inserted forward and backward
        (recomputed ops marked), then how the optimizer is sharded."""
        from autoparallel.parallel.sharding import ZeroOptimizer

        text = self.plan.listing()
        z = self.optimizer
        if isinstance(z, ZeroOptimizer):
            text += (f"\nsharding: ZeRO stage {z.stage} over mesh dim {z.groups.dp_dim!r} in groups of "
                     f"{z.groups.degree} ranks"
                     + ("; parameters gathered before each layer's forward and backward, released after"
                        if z.stage == 3 else ""))
        return text

    def __str__(self) -> str:
        return self.listing()

    __repr__ = __str__

    def state_dict(self, full: bool = False, split_fusion: bool = True, *, mode=None) -> dict:
        """{name: parameter or buffer}: distributed parameters (each with ``.placements`` and ``.full()``; under
        ZeRO the optimizer's checkpoint leaves for the parameters it shards, for ap.save_state_dict /
        ap.load_state_dict), or with ``full=True`` the gathered values as numpy arrays (every rank takes part). paddle's ``mode`` ("param", "opt", "all"; positional or ``mode=``): api_dist_model.py."""
        from autoparallel.api_dist_model import state_dict_mode

        if mode is not None:
            if full is not False:
                raise TypeError("DistModel.state_dict: give paddle's mode= or this project's full=, not both")
            full = mode
        full = state_dict_mode(full, split_fusion)
        if isinstance(full, str):
            return self._paddle_state_dict(full)
        if not full:
            return self._param_entries()
        sd = self.network.state_dict()
        from autoparallel.dist_tensor import is_dist

        with self.whole_parameters():
            return {k: (v.full().numpy() if is_dist(v) else v.numpy()) for k, v in sd.items()}

    @contextlib.contextmanager
    def whole_parameters(self):
        """``with dm.whole_parameters():`` every parameter holds its local data (ZeRO stage 3 gathers them on
        entry and releases them on exit; other stages: nothing to do). Every rank takes part."""
        from autoparallel.parallel.sharding import ZeroOptimizer

        zopt = self.optimizer if isinstance(self.optimizer, ZeroOptimizer) and self.optimizer.stage == 3 else None
        if zopt is None:
            yield
            return
        zopt.gather(zopt.params)
        try:
            yield
        finally:
            zopt.free(zopt.params)

    def parameters(self):
        return self.network.parameters()


def _name_of(model, p):
    for n, q in model.named_parameters():
        if q is p:
            return n
    return None


def _shape_of(x):
    return list(x.shape) if hasattr(x, "shape") else None


def _split0(x, k):
    from autoparallel.dist_tensor import DistTensor

    if isinstance(x, DistTensor):
        raise InputSpecMismatchError("a DistTensor batch cannot be split into micro-batches here; pass a list of "
                                     "k micro-batches instead")
    x = paddle.to_tensor(x) if isinstance(x, np.ndarray) else x
    n = x.shape[0] // k
    return [x[j * n:(j + 1) * n] for j in range(k)]


def _routed(fn):
    """``fn`` itself, or its routed form when it is a paddle function taken before dispatch was installed
    (``loss_fn=F.cross_entropy`` evaluated before the first autoparallel call)."""
    from autoparallel import dispatch

    dispatch.install()
    return dispatch.routed_form(fn)


def to_static(model, loader=None, loss_fn=None, optimizer=None, strategy=None, input_spec=None, *, mesh=None,
              annotations=None, tp_plan=None, cluster=None, method: str = "auto") -> DistModel:
    """Capture ``loss_fn(model(inputs), label)`` once, complete its layouts and return a ``DistModel``.

    ``annotations``: {parameter name | sublayer name: placements} fixed on top of the strategy's.
    ``cluster``: prices the plan (default: the runtime's planning cluster); ``method``: the solver.
    """
    from autoparallel.comm.world import current_world
    from autoparallel.graph.completion import complete
    from autoparallel.strategy import Strategy

    import paddle

    if not isinstance(model, paddle.nn.Layer):
        raise TypeError(f"to_static expects a paddle.nn.Layer, got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"to_static: loss_fn must be a callable (output, label) -> loss, got {type(loss_fn).__name__}")
    loss_fn = _routed(loss_fn) if loss_fn is not None else None
    strategy = Strategy() if strategy is None else strategy
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be an ap.Strategy, got {type(strategy).__name__}")
    from autoparallel.entry_points import check_to_static

    check_to_static(strategy, optimizer)              # every Strategy field: effective or refused
    _check_knobs(strategy)
    from autoparallel.parallel.accumulation import check_optimizer_params

    check_optimizer_params(model, optimizer, "ap.to_static")   # an optimizer over another model's parameters
    if input_spec is not None:
        if isinstance(input_spec, (str, bytes)) or not isinstance(input_spec, (list, tuple)):
            raise TypeError(f"to_static: input_spec must be a list of (shape, dtype) pairs or InputSpecs, one per "
                            f"batch field, got {type(input_spec).__name__} {input_spec!r:.80}")
        specs = [_spec_of(x, i) for i, x in enumerate(input_spec)]
    elif loader is not None:
        from autoparallel.graph.static_loader import loader_specs

        specs = loader_specs(loader)
        if loss_fn is None and len(specs) > 1:     # paddle's (inputs, labels) item: no loss, no label fed
            specs = specs[:-1]
    else:
        raise TypeError("to_static needs the batch shapes: pass input_spec=[(shape, dtype), ...] or a loader "
                        "with batch_size and dataset")
    if loss_fn is not None and len(specs) < 2:
        raise ValueError(f"with a loss_fn a batch is (inputs..., label): expected at least 2 fields, the input "
                         f"spec has {len(specs)}")
    k = strategy.gradient_accumulation_steps
    micro = [_micro(s, k, i) for i, s in enumerate(specs)]
    mesh, degrees = mesh_for(strategy, current_world().world_size, mesh)
    from autoparallel.parallel.model_families import check_built_split, check_declared_degrees

    check_built_split(model, "ap.to_static")                  # a model config's own parallel flags
    check_declared_degrees(model, strategy, degrees, "ap.to_static")
    full = strategy.auto_mode == "full"
    _check_tp_plan(tp_plan, mesh, full)
    ann = {} if full else _semi_annotations(model, mesh, strategy, tp_plan)
    ann.update(annotations or {})
    given = list(input_spec) if input_spec is not None else [None] * len(specs)
    in_specs, hard = [], []
    for i, (shape, dtype) in enumerate(micro):
        g = given[i]
        if isinstance(g, DistSpec):                 # where the data arrives: completion may reshard it
            in_specs.append(DistSpec(mesh, g.placements, tuple(shape), dtype))
            hard.append(False)
        else:                                       # the strategy's data parallelism: consumed as sharded
            in_specs.append(DistSpec(mesh, tuple(_batch_layout(mesh, len(shape))), tuple(shape), dtype))
            hard.append(not full)
    if strategy.recompute.enable:
        _apply_recompute(model, strategy.recompute)
    plan = complete(model, *in_specs, loss_fn=loss_fn, annotations=ann, mesh=mesh,
                    n_model_inputs=len(in_specs) - (1 if loss_fn is not None else 0),
                    auto_mode=strategy.auto_mode, cluster=cluster, method=method, hard_inputs=hard)
    dm = DistModel(model, loss_fn, optimizer, plan, mesh, micro, k)
    if strategy.sharding.enable and dm.optimizer is not None and "data" in mesh.dim_names:
        from autoparallel.parallel.sharding import apply_zero      # optimizer states (and grads) over "data"

        dm.optimizer = apply_zero(model, dm.optimizer, mesh, strategy.sharding.stage, dp_dim="data",
                                  degree=strategy.sharding.degree or None, offload=strategy.sharding.offload,
                                  gradient_accumulation_steps=k)
    return dm
