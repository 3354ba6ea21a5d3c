"""ZeRO stage 1 / 2 inside pipeline stages (``strategy.sharding`` with ``pipeline_parallel.degree >= 2``).

Each stage's parameters live on the stage's ``[data, model]`` sub-mesh; the ZeRO optimizer of
``parallel/sharding.py`` runs on that sub-mesh, sharding the stage's optimizer states (stage 2: also its
gradients) over the stage's data ranks. A rank holds one sub-mesh (its pipeline rank's, also with VPP); in
one process (the simulated world) every stage's sub-mesh is held, so there is one ZeRO optimizer per sub-mesh.

``step()`` runs in two phases so that global-norm clipping sees the whole model:

1. every sub-mesh's ZeRO optimizer reduces its gradients into its ranks' chunks (stage 1: all-reduce over
   the stage's data ranks, stage 2: reduce-scatter);
2. the norm over every stage is summed from the chunks (each chunk counted once over its shard group, data
   replicas and the model dim as in ``parallel/clip.py``; a tied parameter only on the lowest pipeline rank
   holding it), added over the pipeline stages (on real ranks by one all-reduce over the job, each stage's
   sum contributed by its ``(data 0, model 0)`` rank), then every ZeRO optimizer scales its chunks by the same
   ``clip_norm / max(norm, clip_norm)``, steps its chunks and all-gathers them into the parameters.

The ZeRO optimizers read the learning rate (``set_lr``, a scheduler) from the user's optimizer at each step.
Stage 3 is refused by ``wiring._check_composable``. Checkpoints: ``ap.training_state(pipe, opt)`` (zero_state.py),
and paddle's ``opt.state_dict()`` / ``set_state_dict`` (parallel/zero_state_dict.py).
"""
from __future__ import annotations

from autoparallel.parallel import clip as clipping
from autoparallel.parallel.optim_clone import clone_optimizer
from autoparallel.parallel.param_list import flat_params
from autoparallel.parallel.sharding import ZeroOptimizer

from .amp import scaled_by_scaler
from autoparallel.parallel.step_hooks import StepHooks


class _StageZero(ZeroOptimizer):
    """The ZeRO optimizer of one stage sub-mesh; its ``step`` takes the chunks the pipeline reduced and the
    pipeline's clip factor (``ready``) instead of reducing and clipping by itself."""

    def __init__(self, sub, user, mesh, stage: int, dim: str, degree, offload: bool):
        super().__init__(None, sub, mesh, stage, dim, degree, offload, 1, 25 * 2**20, overlap=False)
        self._inner = user                    # hyperparameters and learning rate: the user's optimizer
        self.ready = None                     # (chunks {rank: {id(param): chunk}}, clip factor)

    def reduce_gradients(self) -> dict:
        return self.ready[0] if self.ready is not None else super().reduce_gradients()

    def _clip(self, grads) -> None:
        factor = self.ready[1] if self.ready is not None else 1.0
        clipping.scale_([grads[r].get(id(p)) for p in self.params if getattr(p, "need_clip", True)
                         for r in self.held], factor)

    def step(self) -> None:
        try:
            super().step()
        finally:
            self.ready = None

    def norm_terms(self, grads, skip) -> list:
        """``parallel/clip.py`` terms of this sub-mesh's chunks: distinct over the shard group and the
        dims the parameter is sharded on."""
        z, terms = self.groups.zmesh, []
        for p in self.params:
            if not getattr(p, "need_clip", True) or id(p) in skip:
                continue
            sharded = {self.groups.shard_dim} | {p.mesh.dim_names[i] for i, pl in enumerate(p.placements)
                                                 if pl.is_shard() or pl.is_block_shard()}
            terms.append(({r: grads[r].get(id(p)) for r in self.held}, z, sharded))
        return terms


class PipelineZeroOptimizer(StepHooks):
    """ZeRO stage 1 / 2 over each held stage sub-mesh's data ranks (mesh dim ``dim``), clipped by the norm over
    every stage. ``all_meshes``: on real ranks, every stage's sub-mesh (their ZeRO groups are created on every
    rank in one order)."""

    def __init__(self, optimizer, pipe, stage: int, degree=None, offload: bool = False, *, dim: str = "data",
                 all_meshes=()):
        from .grad_clip import check_clip

        self._inner, self._pipe, self.stage = optimizer, pipe, stage
        self.last_grad_norm = None
        if getattr(optimizer, "_grad_clip", None) is not None:
            check_clip(optimizer._grad_clip)
        _refuse_group_clips(optimizer)
        _create_groups(all_meshes, dim, degree)
        by_mesh: dict = {}
        for p in flat_params(optimizer):
            mesh = getattr(p, "mesh", None)
            if p.stop_gradient and mesh is None:
                continue
            if mesh is None:                # (a frozen parameter joins its stage's ZeRO: it may be unfrozen)
                raise ValueError(f"ZeRO inside pipeline stages shards each stage's optimizer states over its data "
                                 f"ranks, but parameter {p.name} is on no stage sub-mesh (the pipeline runs plain "
                                 f"tensors when data_parallel.degree * tensor_parallel.degree == 1)")
            by_mesh.setdefault(mesh, []).append(p)
        self.zeros = []
        for mesh in sorted(by_mesh, key=lambda m: min(m.process_ids)):
            ps = by_mesh[mesh]
            sub = clone_optimizer(optimizer, ps, {p.name: p.name for p in ps})
            self.zeros.append(_StageZero(sub, optimizer, mesh, stage, dim, degree, offload))

    @property
    def parameters(self) -> list:
        return [p for z in self.zeros for p in z.params]

    def step(self) -> None:
        scaled = scaled_by_scaler(self._pipe)
        if scaled is not None:
            raise RuntimeError(f"the pipeline's last train_batch ran its backward on a GradScaler's scale "
                               f"({scaled[1]:g}) and the gradients are still scaled: step through "
                               f"scaler.step(optimizer) (it unscales them first), not optimizer.step()")
        grads = [z.reduce_gradients() for z in self.zeros]
        factor = self._clip_factor(grads)
        for z, g in zip(self.zeros, grads):
            z.ready = (g, factor)
            z.step()
        self._after_step()

    def _clip_factor(self, grads) -> float:
        from .grad_clip import check_clip, counted_elsewhere

        gc = getattr(self._inner, "_grad_clip", None)
        if gc is None:
            return 1.0
        check_clip(gc)
        skip = counted_elsewhere(self._pipe)
        squares = sum(clipping.global_norm(z.norm_terms(g, skip)) ** 2 for z, g in zip(self.zeros, grads))
        if self._pipe.ranks is not None:              # real ranks: add the stages' sums over the job
            import paddle
            import paddle.distributed as dist

            t = paddle.to_tensor([squares if tuple(self._pipe.coords) == (0, 0) else 0.0], dtype="float64")
            dist.all_reduce(t)
            squares = float(t.numpy()[0])
        self.last_grad_norm = squares ** 0.5
        return clipping.clip_coefficient(self.last_grad_norm, float(gc.clip_norm))

    def clear_grad(self, set_to_zero: bool = True) -> None:
        for z in self.zeros:
            z.clear_grad(set_to_zero)

    clear_gradients = clear_grad

    def memory_bytes(self, rank: int | None = None) -> dict:
        """Bytes ``rank`` (default: this process's first) holds in parameters, gradients and optimizer states,
        summed over the sub-meshes it belongs to."""
        out = {"params": 0, "grads": 0, "optimizer_states": 0}
        for z in self.zeros:
            r = z.held[0] if rank is None else rank
            if r in z.held:
                for k, v in z.memory_bytes(r).items():
                    out[k] += v
        return out

    def checkpoint_state(self, model=None) -> dict:
        """``ap.training_state(pipe, opt)``: parameters and chunked optimizer states under the model's names
        (zero_state.py)."""
        from .zero_state import pipeline_zero_state

        if model is not None and model is not self._pipe:
            raise ValueError(f"this optimizer steps the stages of its pipeline; pass that PipelineModule to "
                             f"ap.training_state, got {type(model).__name__}")
        return pipeline_zero_state(self, self._pipe)

    def state_dict(self) -> dict:
        """paddle's form over every held stage's ZeRO optimizer (parallel/zero_state_dict.py): on real ranks,
        this rank's stage's parameters (each stage's ranks hold its entries, as paddle's pipeline does)."""
        out: dict = {}
        for z in self.zeros:
            sd = z.state_dict()
            masters = dict(out.get("master_weights", {}), **sd.pop("master_weights", {}))
            out.update(sd)
            if masters:
                out["master_weights"] = masters
        return out

    def set_state_dict(self, state_dict) -> None:
        """Every held stage's ZeRO optimizer loads its parameters' states from ``state_dict``."""
        for z in self.zeros:
            z.set_state_dict(state_dict)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _create_groups(meshes, dim: str, degree) -> None:
    """Real ranks: the ZeRO groups of every stage sub-mesh, created on every rank in one order (process
    groups are created with their mesh by every rank of the job, comm/groups.py)."""
    from autoparallel.parallel.zero_groups import ZeroGroups

    for mesh in meshes:
        ZeroGroups(mesh, dim, degree)


def _refuse_group_clips(optimizer) -> None:
    """paddle clips each parameter group by its own norm; ZeRO inside pipeline stages clips by one norm."""
    from autoparallel.parallel.group_clips import has_groups

    if has_groups(optimizer) and any(g.get("grad_clip") is not None for g in optimizer._param_groups):
        raise NotImplementedError("ZeRO inside pipeline stages clips every parameter by one global norm, but the "
                                  "optimizer has parameter groups, which paddle clips each by its own norm; build it "
                                  "over a flat parameter list, or drop strategy.sharding")

