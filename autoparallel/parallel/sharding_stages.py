"""paddle's ``ShardingStage1/2/3(sharding_mesh_dim, mesh=None)`` and the other ``shard_fn`` forms of
``shard_optimizer``, turned into the ZeRO optimizer (parallel/sharding.py) over one mesh dim.

    opt = ap.shard_optimizer(opt, ap.ShardingStage2("data", mesh))   # states + gradients sharded over "data"
    opt = ap.shard_optimizer(opt, mesh)                               # the article's form: stage 1 over "data"

The parameters must already be distributed (``ap.shard_layer``, ``ap.shard_tensor``, ``ap.parallelize``).
Stage 3 also gathers each layer's parameters around its forward and backward, so it needs the model those
parameters belong to: one built by ``ap.parallelize`` or ``ap.DataParallel`` (``shard_layer`` models: use
``ap.parallelize`` with ``strategy.sharding.stage = 3``).
"""
from __future__ import annotations

from autoparallel.config.fields import integral
from autoparallel.dist_tensor import is_dist
from autoparallel.core.mesh import as_mesh
from autoparallel.mesh import ProcessMesh
from autoparallel.placement import Replicate, Shard
from autoparallel.parallel.step_hooks import StepHooks

DATA_NAMES = ("data", "dp")


class ShardingStage:
    """Base of ``ShardingStage1/2/3``: which mesh dim the optimizer shards over, and on which mesh."""
    stage = 0

    def __init__(self, sharding_mesh_dim=None, mesh: ProcessMesh | None = None):
        mesh = as_mesh(mesh)                 # a paddle.distributed.ProcessMesh becomes ours
        if mesh is not None and not isinstance(mesh, ProcessMesh):
            raise TypeError(f"{type(self).__name__}: mesh must be an ap.ProcessMesh or None, got "
                            f"{type(mesh).__name__}")
        if integral(sharding_mesh_dim) is not None:
            sharding_mesh_dim = integral(sharding_mesh_dim)        # a numpy int is an index
        elif sharding_mesh_dim is not None and not isinstance(sharding_mesh_dim, str):
            raise TypeError(f"{type(self).__name__}: sharding_mesh_dim must be a mesh dim index or name, got "
                            f"{sharding_mesh_dim!r}")
        self.sharding_mesh_dim, self.mesh = sharding_mesh_dim, mesh
        if mesh is not None and sharding_mesh_dim is not None:
            self.dim_name(mesh)                  # a dim the given mesh does not have is refused here

    def dim_name(self, mesh: ProcessMesh) -> str:
        d = self.sharding_mesh_dim
        if d is None:
            return data_dim(mesh)
        if isinstance(d, int):
            if not 0 <= d < mesh.ndim:
                raise ValueError(f"{type(self).__name__}: sharding_mesh_dim={d} is outside the mesh's {mesh.ndim} "
                                 f"dims {mesh.dim_names}")
            return mesh.dim_names[d]
        if d not in mesh.dim_names:
            raise ValueError(f"{type(self).__name__}: sharding_mesh_dim={d!r} is not a dim of the mesh "
                             f"{mesh.dim_names}")
        return d

    def __repr__(self):
        return f"{type(self).__name__}({self.sharding_mesh_dim!r}, {self.mesh!r})"


class ShardingStage1(ShardingStage):
    """ZeRO stage 1: optimizer states (and the fp32 master weights) sharded over the mesh dim."""
    stage = 1


class ShardingStage2(ShardingStage):
    """ZeRO stage 2: also the gradients (reduce-scatter instead of all-reduce)."""
    stage = 2


class ShardingStage3(ShardingStage):
    """ZeRO stage 3: also the parameters, gathered around each layer's use."""
    stage = 3


def data_dim(mesh: ProcessMesh) -> str:
    """The mesh's data dim: one named "data" / "dp", else the only dim of a 1-D mesh."""
    for n in DATA_NAMES:
        if n in mesh.dim_names:
            return n
    if mesh.ndim == 1:
        return mesh.dim_names[0]
    raise ValueError(f"cannot tell which dim of the mesh {mesh.dim_names} is data parallel (expected one named "
                     f"{' or '.join(DATA_NAMES)}); pass ap.ShardingStage1(dim, mesh) to shard_optimizer")


def _params(optimizer):
    inner = getattr(optimizer, "_inner", optimizer)
    if not hasattr(inner, "_parameter_list"):
        raise TypeError(f"shard_optimizer expects a paddle optimizer, got {type(optimizer).__name__}")
    out = []
    for p in inner._parameter_list or []:
        out.extend(p["params"] if isinstance(p, dict) else [p])
    return [p for p in out if not p.stop_gradient]


def resolve_shard_fn(optimizer, shard_fn):
    """A ShardingStage for ``shard_fn`` (None: states follow the parameters)."""
    if shard_fn is None:
        return None
    if isinstance(shard_fn, ShardingStage):
        return shard_fn
    shard_fn = as_mesh(shard_fn)
    if isinstance(shard_fn, ProcessMesh):
        return ShardingStage1(None, shard_fn)
    if not callable(shard_fn):
        raise TypeError(f"shard_optimizer: shard_fn must be None, ap.ShardingStage1/2/3, a ProcessMesh or a "
                        f"callable (accumulator_name, param, accumulator) -> tensor; got {type(shard_fn).__name__}")
    return _probe(optimizer, shard_fn)


def _probe(optimizer, shard_fn):
    """Ask a paddle-style accumulator shard_fn where it puts each parameter's moment."""
    dims = set()
    mesh = None
    for p in _params(optimizer):
        if not is_dist(p):
            raise ValueError(f"shard_optimizer(shard_fn=...): parameter {p.name} is not distributed; distribute the "
                             f"model first (ap.shard_layer / ap.parallelize)")
        got = shard_fn("moment1", p, p.as_dist().detach())
        pl = list(getattr(got, "placements", None) or [])
        if not is_dist(got) or getattr(got, "mesh", None) != p.mesh or len(pl) != len(p.placements):
            raise NotImplementedError(f"shard_optimizer: shard_fn returned {type(got).__name__} for the moment of "
                                      f"{p.name}; expected a DistTensor on the parameter's mesh {p.mesh}")
        for i, (want, have) in enumerate(zip(pl, p.placements)):
            if want == have:
                continue
            if isinstance(want, Shard) and isinstance(have, Replicate):
                dims.add(p.mesh.dim_names[i])
                continue
            raise NotImplementedError(f"shard_optimizer: shard_fn lays the moment of {p.name} out as "
                                      f"{[str(x) for x in pl]} over its parameter's {[str(x) for x in p.placements]}; "
                                      f"only sharding over a mesh dim the parameter is replicated on (ZeRO) is "
                                      f"supported")
        mesh = p.mesh
    if not dims:
        return None
    if len(dims) > 1:
        raise NotImplementedError(f"shard_optimizer: shard_fn shards optimizer states over the mesh dims "
                                  f"{sorted(dims)}; ZeRO shards over one dim (use ap.ShardingStage1(dim, mesh))")
    return ShardingStage1(dims.pop(), mesh)


def zero_optimizer(optimizer, stage: ShardingStage, gradient_accumulation_steps: int = 1):
    """The ZeRO optimizer for ``stage`` over the optimizer's (distributed) parameters. Parameters already
    sharded over the sharding dim (the article's ``[Shard(1)]`` weights on a [data, model] mesh) keep
    their states in their own, already sharded, layout: a SplitOptimizer steps both groups."""
    from autoparallel.parallel.accumulation import wrap_optimizer
    from autoparallel.parallel.builds import model_of_params
    from autoparallel.parallel.sharding import apply_zero

    params = _params(optimizer)
    plain = [p.name for p in params if not is_dist(p)]
    if plain:
        raise ValueError(f"shard_optimizer({type(stage).__name__}): {len(plain)} parameters are not distributed "
                         f"({', '.join(plain[:3])}); distribute the model first (ap.shard_layer / ap.parallelize)")
    meshes = {p.mesh for p in params}
    mesh = stage.mesh
    if mesh is None:
        if len(meshes) != 1:
            raise ValueError(f"shard_optimizer({type(stage).__name__}): the parameters live on {len(meshes)} meshes; "
                             f"pass the mesh: {type(stage).__name__}(dim, mesh)")
        mesh = next(iter(meshes))
    dim = stage.dim_name(mesh)
    model = model_of_params(params)
    if stage.stage == 3 and model is None:
        raise ValueError("shard_optimizer(ShardingStage3): stage 3 gathers each layer's parameters around its use "
                         "and needs the model, but these parameters belong to no model built by ap.shard_layer / "
                         "ap.parallelize / ap.DataParallel; distribute the model with one of them first")
    own = [p for p in params if p.mesh == mesh and isinstance(p.placements[mesh.dim_names.index(dim)], Shard)]
    if not own:
        wrapped = wrap_optimizer(optimizer, {}, gradient_accumulation_steps)
        return _loop_divides(apply_zero(model, wrapped, mesh, stage.stage, dp_dim=dim,
                                        gradient_accumulation_steps=gradient_accumulation_steps))
    return _split(optimizer, stage, mesh, dim, model, own, gradient_accumulation_steps)


def _loop_divides(zero):
    """paddle's ``shard_optimizer(opt, shard_fn, gradient_accumulation_steps=k)``: ``k`` is the accumulation window
    only (reductions wait for the k-th backward) and the loop divides its loss by ``k``, as with ``shard_fn=None``
    and in paddle's dynamic mode; the ZeRO step must not divide again (``Strategy.gradient_accumulation_steps``
    through ``ap.parallelize`` is the form whose step divides)."""
    zero.accumulation_divisor = 1
    return zero


def _split(optimizer, stage, mesh, dim, model, own, k):
    from autoparallel.parallel.optim_clone import clone_optimizer
    from autoparallel.parallel.optimizer import ShardedOptimizer
    from autoparallel.parallel.sharding import apply_zero

    inner = getattr(optimizer, "_inner", optimizer)
    if stage.stage == 3:
        raise NotImplementedError(f"ShardingStage3 over {dim!r} while {len(own)} parameters are already sharded over "
                                  f"it ({own[0].name}, ...); use stage 1 or 2, or shard those weights over another dim")
    from autoparallel.parallel.group_clips import clip_sets

    if any(c is not None for c, _ in clip_sets(inner)):          # the optimizer's clip or a parameter group's
        raise NotImplementedError(f"gradient clipping with ZeRO over {dim!r} while {len(own)} parameters are already "
                                  f"sharded over it ({own[0].name}, ...); build the optimizer without grad_clip")
    from autoparallel.parallel.param_list import flat_params

    every = list(flat_params(inner))                 # frozen ones too: one unfrozen later trains (as in paddle)
    i = mesh.dim_names.index(dim)
    ids = {id(p) for p in own} | {id(p) for p in every if p.stop_gradient and is_dist(p) and p.mesh == mesh
                                  and isinstance(p.placements[i], Shard)}
    own = [p for p in every if id(p) in ids]
    rest = [p for p in every if id(p) not in ids]
    names = {p.name: p.name for p in every}
    kept = ShardedOptimizer(clone_optimizer(inner, own, names), gradient_accumulation_steps=k, overlap=True)
    zero = None
    if rest:
        sub = ShardedOptimizer(clone_optimizer(inner, rest, names), gradient_accumulation_steps=k, overlap=True)
        zero = _loop_divides(apply_zero(model, sub, mesh, stage.stage, dp_dim=dim, gradient_accumulation_steps=k))
    return SplitOptimizer(zero, kept, inner)


class SplitOptimizer(StepHooks):
    """ZeRO over the parameters replicated on the sharding dim, and a plain wrapper over those already sharded
    on it (their states follow their sharded layout). ``step`` / ``clear_grad`` drive both; attributes of
    the ZeRO part (``stage``, ``memory_bytes``, ``inner_opts``...) are read from it. The learning rate is the
    user's optimizer's (``source``): ``set_lr`` / ``set_lr_scheduler`` / ``get_lr`` act on it, and both parts
    take it at each step."""

    _LR = ("set_lr", "set_lr_scheduler", "get_lr", "_learning_rate")

    def __init__(self, zero, kept, source=None):
        self.zero, self.kept, self.source = zero, kept, source

    @property
    def parameters(self):
        return (self.zero.params if self.zero is not None else []) + self.kept.parameters

    def step(self):
        from autoparallel.parallel.optim_clone import sync_lr

        for part in (self.zero, self.kept):
            if part is not None and self.source is not None:
                sync_lr(self.source, part._inner)
        if self.zero is not None:
            self.zero.step()
        self.kept.step()
        self._after_step()

    def clear_grad(self, set_to_zero: bool = True):
        if self.zero is not None:
            self.zero.clear_grad(set_to_zero)
        self.kept.clear_grad(set_to_zero)

    clear_gradients = clear_grad

    def checkpoint_state(self, model=None) -> dict:
        """``ap.training_state`` of both groups under the unsharded run's names: the ZeRO part's parameters
        and chunked states (checkpoint/zero_state.py), the kept part's states in their sharded layout."""
        from autoparallel.checkpoint.state import optimizer_state, paddle_optimizer

        if model is None:
            model = self.zero.model if self.zero is not None else None
        if model is None:
            raise ValueError("SplitOptimizer.checkpoint_state: these parameters belong to no model built by "
                             "ap.parallelize / ap.DataParallel; pass the model: ap.training_state(model, opt)")
        if self.zero is not None:
            state = self.zero.checkpoint_state(model)
        else:
            state = {"model": dict(model.named_parameters()), "optimizer": {}}
        named = {id(p) for _, p in model.named_parameters()}
        lost = [p.name for p in self.kept.parameters if id(p) not in named]
        if lost:
            raise ValueError(f"the optimizer steps {len(lost)} parameters the given {type(model).__name__} does "
                             f"not hold ({', '.join(lost[:3])}); pass the model it was built over")
        kept = optimizer_state(paddle_optimizer(self.kept), model, self.kept)
        clash = sorted(set(kept) & set(state["optimizer"]))
        if clash:
            raise ValueError(f"parameters {clash[:3]} are stepped by both the ZeRO and the kept optimizer")
        state["optimizer"].update(kept)
        return state

    def state_dict(self) -> dict:
        """paddle's form of both groups: the ZeRO part's (parallel/zero_state_dict.py) and the kept part's
        states in their sharded layout (optimizer_state_forms.py), under one process's keys."""
        out = dict(self.kept.state_dict())
        if self.zero is not None:
            zero = self.zero.state_dict()
            masters = dict(out.get("master_weights", {}), **zero.pop("master_weights", {}))
            clash = sorted(set(zero) & set(out) - {"LR_Scheduler"})
            if clash:
                raise ValueError(f"optimizer.state_dict: {clash[:3]} are kept by both the ZeRO and the kept part")
            out.update(zero)
            if masters:
                out["master_weights"] = masters
        return out

    def set_state_dict(self, state_dict) -> None:
        if self.zero is not None:
            self.zero.set_state_dict(state_dict)
        self.kept.set_state_dict(state_dict)

    def __getattr__(self, name):
        if name in ("zero", "kept", "source"):
            raise AttributeError(name)
        if name in self._LR and self.source is not None:
            return getattr(self.source, name)
        return getattr(self.zero if self.zero is not None else self.kept, name)
