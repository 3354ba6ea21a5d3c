"""Pipeline stages: a model cut into contiguous stage modules (embedding + ``layers[a:b]`` + head).

A model takes part in pipeline parallelism through three pieces (the example GPT and LLaMA have them):

* ``model.embed(ids)``: the input embedding, run by the first stage;
* a ``paddle.nn.LayerList`` of repeated layers, ``model.blocks`` or ``model.layers``;
* ``model.head(x)``: the output head (final norm + LM head), run by the last stage.

Layers that need extra inputs get them from ``layer_args(model, x)``: by default ``model.rotary(seq_len)``
when the model has a ``rotary`` method (LLaMA's rotary tables), else nothing.

``describe_model`` finds the pieces and which top-level sublayers the embedding and the head use (a dry
run on one token: the parameters that receive a gradient, plus the sublayers that are called), so a tied
LM head that reads ``wte.weight`` directly puts ``wte`` on the last stage too. ``plan_stages`` cuts the
layers into ``pp * vpp`` stages, at user split points (``split_at``) or balanced by per-layer cost
(``balanced_split``; forward FLOPs from ``ap.trace`` by default, parameter counts on request), with the
embedding's cost added to the first layer and the head's to the last. ``PipelineStage`` is one stage: its
sublayers keep the model's names (``blocks.4.attn.qkv``), so tensor-parallel plans, split points and
checkpoints use the same names as the unsplit model.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import paddle
from paddle import nn

from .split import balanced_split, split_at

LAYER_LIST_NAMES = ("blocks", "layers")
COSTS = ("flops", "params")


@dataclass
class ModelPieces:
    """How to run a model stage by stage (see the module docstring)."""
    model: nn.Layer
    layers_name: str                        # attribute holding the LayerList
    embed_layers: tuple                     # top-level sublayer names the embedding uses
    head_layers: tuple                      # top-level sublayer names the head uses
    layer_args: Callable = field(default=None, repr=False)    # (model, x) -> extra positional args per layer
    generic: bool = False                   # no embed()/head(): stages run the model's forward (auto_split.py);
                                            # embed_layers / head_layers then name parameters, not sublayers
    block_forms: tuple = ()                 # generic: what each block returns (auto_split.block_forms)
    call_forms: dict = field(default_factory=dict, repr=False)   # what pipe(...) returns (call_forms.py)

    @property
    def layers(self) -> nn.LayerList:
        from .auto_split import resolve

        return resolve(self.model, self.layers_name)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_names(self) -> list:
        return [f"{self.layers_name}.{i}" for i in range(self.num_layers)]

    def extra_args(self, x) -> tuple:
        return tuple(self.layer_args(self.model, x)) if self.layer_args is not None else ()


def _default_layer_args(model) -> Optional[Callable]:
    if callable(getattr(model, "rotary", None)):
        return lambda m, x: m.rotary(x.shape[1])
    return None


def describe_model(model, layers_name: Optional[str] = None, layer_args: Optional[Callable] = None) -> ModelPieces:
    """The pipeline pieces of ``model``; TypeError naming what is missing when it has none."""
    if not isinstance(model, nn.Layer):
        raise TypeError(f"pipeline parallelism expects a paddle.nn.Layer, got {type(model).__name__}")
    missing = [m for m in ("embed", "head") if not callable(getattr(model, m, None))]
    candidates = [layers_name] if layers_name is not None else list(LAYER_LIST_NAMES)
    found = next((n for n in candidates if isinstance(getattr(model, n, None), nn.LayerList)), None)
    if missing or found is None:                 # no embed()/head(): split at the repeated blocks
        return describe_generic(model, layers_name)
    if missing or found is None:
        what = ([f"method(s) {', '.join(missing)}"] if missing else []) + \
               ([f"a paddle.nn.LayerList attribute named {' or '.join(repr(c) for c in candidates)}"]
                if found is None else [])
        raise TypeError(f"{type(model).__name__} cannot be split into pipeline stages: expected embed(ids), "
                        f"head(x) and a LayerList of repeated layers; missing {' and '.join(what)}")
    if len(getattr(model, found)) == 0:
        raise ValueError(f"{type(model).__name__}.{found} is empty: a pipeline needs at least one layer")
    embed_layers, head_layers = _piece_layers(model, found)
    return ModelPieces(model, found, embed_layers, head_layers,
                       layer_args if layer_args is not None else _default_layer_args(model))


def _piece_layers(model, layers_name: str) -> tuple:
    """Top-level sublayers (other than the layer list) used by ``embed`` and by ``head``: a dry run on one
    token; a sublayer counts when it is called or one of its parameters gets a gradient."""
    tops = [(n, l) for n, l in model.named_children() if n != layers_name]
    owner = {}
    for name, layer in tops:
        for p in layer.parameters():
            owner.setdefault(id(p), name)
    params = [p for _, l in tops for p in l.parameters() if not p.stop_gradient]
    called, hooks = set(), []
    for name, layer in tops:
        hooks.append(layer.register_forward_pre_hook(lambda _l, _i, n=name: called.add(n)))
    rng = paddle.get_rng_state()                     # the dry run draws no random numbers of the user's
    try:
        ids = paddle.zeros([1, 1], dtype="int64")
        x = model.embed(ids)
        embed = _used(x, params, owner) | called
        called.clear()
        h = x.detach()
        h.stop_gradient = False
        head = _used(model.head(h), params, owner) | called
    finally:
        paddle.set_rng_state(rng)
        for hook in hooks:
            hook.remove()
    order = [n for n, _ in tops]
    return tuple(n for n in order if n in embed), tuple(n for n in order if n in head)


def _used(out, params, owner) -> set:
    if not params or out.stop_gradient:
        return set()
    grads = paddle.grad([out.sum()], params, allow_unused=True)
    return {owner[id(p)] for p, g in zip(params, grads) if g is not None}


def describe_generic(model, layers_name: Optional[str] = None) -> ModelPieces:
    """Pieces of a model without embed()/head(): its longest list of same-type blocks (or ``layers_name``),
    the other parameters attached to the first / last stage by a dry run (see auto_split.py)."""
    from .auto_split import find_blocks, piece_params, refuse_model_losses, resolve

    refuse_model_losses(model)
    path = layers_name if layers_name is not None else find_blocks(model)
    try:
        blocks = resolve(model, path)
    except (AttributeError, IndexError) as e:
        raise TypeError(f"{type(model).__name__} has no block list {path!r}: {e}") from None
    if not isinstance(blocks, (nn.LayerList, nn.Sequential)):
        raise TypeError(f"{type(model).__name__}.{path} must be a paddle.nn.LayerList or Sequential of blocks, got "
                        f"{type(blocks).__name__}")
    if len(blocks) == 0:
        raise ValueError(f"{type(model).__name__}.{path} is empty: a pipeline needs at least one layer")
    from .dry_input import dry_input

    pre, post, forms = piece_params(model, path, dry_input(model))
    return ModelPieces(model, path, pre, post, None, generic=True, block_forms=forms)


# ---- costs and the split ---------------------------------------------------------------------------------
def layer_costs(pieces: ModelPieces, cost: str = "flops", seq_len: Optional[int] = None) -> list:
    """Per-layer cost with the embedding's cost added to the first layer and the head's to the last.

    ``cost="flops"``: forward FLOPs of one sequence from ``ap.trace`` (spec-only, nothing computed);
    falls back to parameter counts with a warning when the trace cannot run. ``cost="params"``:
    parameter counts (a tied weight counts where it is first used)."""
    if cost not in COSTS:
        raise ValueError(f"cost must be one of {COSTS}, got {cost!r}")
    if cost == "flops" and not pieces.generic:        # a model without embed()/head(): parameter counts
        try:
            return _flop_costs(pieces, seq_len)
        except (NotImplementedError, ValueError, TypeError, RuntimeError) as e:
            warnings.warn(f"tracing {type(pieces.model).__name__} for stage costs failed ({e}); balancing "
                          f"stages by parameter counts instead")
    return _param_costs(pieces)


def _param_costs(pieces: ModelPieces) -> list:
    def count(layers) -> float:
        return float(sum(math.prod(p.shape) for p in _unique_params(layers)))

    model = pieces.model
    costs = [count([layer]) for layer in pieces.layers]
    if pieces.generic:
        params = dict(model.named_parameters())
        costs[0] += float(sum(math.prod(params[n].shape) for n in pieces.embed_layers))
        costs[-1] += float(sum(math.prod(params[n].shape) for n in pieces.head_layers if n not in pieces.embed_layers))
        return costs
    costs[0] += count([getattr(model, n) for n in pieces.embed_layers])
    head = [getattr(model, n) for n in pieces.head_layers if n not in pieces.embed_layers]
    costs[-1] += count(head)
    return costs


def _unique_params(layers) -> list:
    seen, out = set(), []
    for layer in layers:
        for p in layer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class _Call(nn.Layer):
    def __init__(self, fn):
        super().__init__()
        self._fn = fn

    def forward(self, *args):
        return self._fn(*args)


def _flop_costs(pieces: ModelPieces, seq_len: Optional[int]) -> list:
    from autoparallel.graph.trace import summary, trace
    from autoparallel.mesh import ProcessMesh
    from autoparallel.placement import Replicate
    from autoparallel.spec import DistSpec

    model = pieces.model
    t = seq_len or min(int(getattr(getattr(model, "config", None), "max_positions", 128) or 128), 1024)
    mesh = ProcessMesh([0], ["d0"], create_groups=False)
    ids = DistSpec(mesh, (Replicate(),), (1, t), "int64")
    embed_graph = trace(_Call(model.embed), ids)
    x_spec = embed_graph.graph["outputs"].spec
    costs = []
    for layer in pieces.layers:
        def run(x, layer=layer):
            return layer(x, *pieces.extra_args(x))
        costs.append(summary(trace(_Call(run), x_spec))["flops"])
    costs[0] += summary(embed_graph)["flops"]
    costs[-1] += summary(trace(_Call(model.head), x_spec))["flops"]
    return [float(c) for c in costs]


def plan_stages(pieces: ModelPieces, num_stages: int, split_points: Optional[Sequence[str]] = None,
                cost: str = "flops", seq_len: Optional[int] = None) -> list:
    """Half-open layer ranges ``[(start, stop), ...]``, one per (virtual) stage; ValueError when the model
    has fewer layers than stages or a split point is wrong."""
    n = pieces.num_layers
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"the number of pipeline stages must be a positive int, got {num_stages!r}")
    if num_stages > n:
        raise ValueError(f"{num_stages} pipeline stages need at least {num_stages} layers, but "
                         f"{type(pieces.model).__name__}.{pieces.layers_name} has {n}: more stages than layers")
    if split_points:
        return split_at(pieces.layer_names, list(split_points), num_stages=num_stages)
    return balanced_split(layer_costs(pieces, cost, seq_len), num_stages)


# ---- the stage module ------------------------------------------------------------------------------------
class _Holder(nn.Layer):
    """Container keeping the original indices of the layers it holds as sublayer names."""

    def __init__(self, layers: dict):
        super().__init__()
        for name, layer in layers.items():
            self.add_sublayer(name, layer)


class PipelineStage(nn.Layer):
    """Stage ``index`` of ``num_stages``: embedding (first stage), ``layers[start:stop]``, head (last stage).

    The model itself is not a sublayer (only the pieces this stage runs are registered), so
    ``parameters()`` is exactly this stage's parameters, under the model's own names."""

    def __init__(self, pieces: ModelPieces, index: int, num_stages: int, bounds: tuple):
        super().__init__()
        object.__setattr__(self, "_pieces", pieces)
        self.index, self.num_stages = index, num_stages
        self.start, self.stop = bounds
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        model = pieces.model
        names = list(pieces.embed_layers if self.is_first else ())
        names += [n for n in (pieces.head_layers if self.is_last else ()) if n not in names]
        if pieces.generic:
            self._register_params(names)
        else:
            for name in names:
                self.add_sublayer(name, getattr(model, name))
        blocks = {str(i): pieces.layers[i] for i in range(*bounds)}
        parent, _, leaf = pieces.layers_name.rpartition(".")
        self._holder(parent).add_sublayer(leaf, _Holder(blocks))

    def _holder(self, path: str) -> nn.Layer:
        """The container at dotted ``path`` under this stage, created on first use."""
        node = self
        for part in path.split(".") if path else ():
            if part not in node._sub_layers:
                node.add_sublayer(part, _Holder({}))
            node = node._sub_layers[part]
        return node

    def _register_params(self, names) -> None:
        """Register the named model parameters under their own names: the owning layer when it lies outside
        the block list's ancestors, else the parameter itself on a container at the owner's path."""
        from .auto_split import resolve

        model, blocks = self._pieces.model, self._pieces.layers_name
        for name in names:
            owner, _, leaf = name.rpartition(".")
            if owner == "" or blocks.startswith(owner + "."):
                self._holder(owner).add_parameter(leaf, getattr(resolve(model, owner) if owner else model, leaf))
                continue
            parent, _, last = owner.rpartition(".")
            holder = self._holder(parent)
            if last not in holder._sub_layers:
                holder.add_sublayer(last, resolve(model, owner))

    @property
    def pieces(self) -> ModelPieces:
        return self._pieces

    def forward(self, x, inputs=None, whole=False):
        """``x``: the model input (first stage) or the previous stage's activation; ``inputs``: the model
        input on later stages of a model split at its blocks (it recomputes the side inputs from them);
        ``whole``: the last stage of a model split at its blocks returns the model's whole output (every head of a
        tuple / dict), not its logits alone (external_loss.py)."""
        model, pieces = self._pieces.model, self._pieces
        if pieces.generic:
            from .auto_split import run_stage

            if self.is_first:
                return run_stage(model, pieces.layers, self.start, self.stop, x, last=self.is_last,
                                 forms=pieces.block_forms, whole=whole)
            if inputs is None:
                raise ValueError(f"stage {self.index} of {type(model).__name__} (split at its blocks) recomputes "
                                 f"the model's side inputs and needs the model inputs; got inputs=None")
            return run_stage(model, pieces.layers, self.start, self.stop, inputs, x=x, last=self.is_last,
                             forms=pieces.block_forms, whole=whole)
        if self.is_first:
            x = model.embed(x)
        extra = pieces.extra_args(x)
        for i in range(self.start, self.stop):
            x = pieces.layers[i](x, *extra)
        if self.is_last:
            x = model.head(x)
        return x

    def extra_repr(self) -> str:
        return f"stage={self.index}/{self.num_stages}, layers=[{self.start}, {self.stop})"


def build_stages(pieces: ModelPieces, bounds: Sequence[tuple]) -> list:
    """One PipelineStage per range of ``bounds``."""
    return [PipelineStage(pieces, k, len(bounds), b) for k, b in enumerate(bounds)]


def apply_recompute(stages: Sequence[PipelineStage], granularity: str = "full", every_n: int = 1) -> None:
    """``strategy.recompute`` inside the stages (parallel/recompute.py): ``"full"`` recomputes each stage's
    blocks in segments of ``every_n`` consecutive blocks, cut at the stage's bounds (a segment never spans
    two stages); ``"selective"`` the attention core of every block."""
    from autoparallel.parallel.recompute import GRANULARITIES, _check_n, _segments, _selective

    if granularity not in GRANULARITIES:
        raise ValueError(f"recompute granularity must be one of {GRANULARITIES}, got {granularity!r}")
    _check_n(every_n)
    for st in stages:
        pieces = st.pieces
        blocks = [pieces.layers[i] for i in range(st.start, st.stop)]
        if granularity == "full":
            _segments(blocks, every_n, [f"{pieces.layers_name}.{i}" for i in range(st.start, st.stop)])
        else:
            for block in blocks:
                _selective(block)


# ---- the whole plan, validated before any process-group work ----------------------------------------------
@dataclass
class PipelinePlan:
    """Stage split plus schedule: everything a pipeline runtime needs that involves no process group."""
    pieces: ModelPieces
    bounds: list                     # layer range per (virtual) stage
    schedule: object                 # schedules.Schedule

    @property
    def pp(self) -> int:
        return self.schedule.num_ranks

    @property
    def vpp(self) -> int:
        return self.schedule.vpp

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    @property
    def micro_batches(self) -> int:
        return self.schedule.micro_batches

    def stages_of(self, pp_rank: int) -> list:
        """Virtual stages held by pipeline rank ``pp_rank``: ``pp_rank, pp_rank + pp, ...``."""
        return list(range(pp_rank, self.num_stages, self.pp))


def plan_pipeline(model, pp: int, micro_batches: int, schedule: str = "1F1B", vpp: int = 1,
                  split_points: Optional[Sequence[str]] = None, cost: str = "flops", seq_len: Optional[int] = None,
                  layers_name: Optional[str] = None) -> PipelinePlan:
    """Validate and plan a pipeline: ValueError / TypeError for bad input, before any launch work.

    Checks, in order: ``pp`` >= 2; the schedule exists and fits ``micro_batches`` and ``vpp``
    (``make_schedule``'s errors); the model has the pipeline pieces; at least ``pp * vpp`` layers; the
    split points name layers, in order, one fewer than the stages."""
    from autoparallel import dispatch_handle
    from .schedules import check_communication, make_schedule
    from .static_forward import run_dygraph

    dispatch_handle.install()   # a pipeline routes paddle's functions when it is built: the user's loss on a call's
    #                             logits runs through dispatch, and F.cross_entropy(model(x), y) looks its function up
    #                             before the call makes the first distributed tensor (external_loss.py)
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 2:
        raise ValueError(f"a pipeline needs pipeline_parallel.degree >= 2 stages, got {pp!r}")
    sched = make_schedule(schedule, pp, micro_batches, vpp)
    check_communication(sched)
    run_dygraph(model)          # model = paddle.jit.to_static(model): the stages run its dygraph forward
    pieces = describe_model(model, layers_name)
    if split_points is not None and not isinstance(split_points, (list, tuple)):
        raise TypeError(f"split_points must be a list of layer names, got {type(split_points).__name__}")
    bounds = plan_stages(pieces, sched.num_stages, split_points, cost, seq_len)
    return PipelinePlan(pieces, bounds, sched)
