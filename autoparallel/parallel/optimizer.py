"""shard_optimizer (paddle's signature): reduce partial gradients, then step on local shards.

Data-parallel gradients are all-reduced in fused buckets (parallel/grads.py). The buckets are fixed as
the first backward starts (the forward has recorded which parameters are partial: backward_start.py) and
backward hooks launch each bucket as soon as its gradients are complete on the final accumulation
micro-step (parallel/reducer.py); ``step()`` only reduces what backward did not. ``shard_optimizer`` and ``ap.parallelize`` turn that on
(``overlap=True``); the class default keeps every reduction at step time, for callers that change
gradients between backward and step in ways that are not the same on every rank (the pipeline runtime
sums tied gradients across stages and accumulates zero-bubble weight gradients outside autograd).
"""
from __future__ import annotations

from autoparallel.config.fields import integral
from autoparallel.dispatch import local_mode
from autoparallel.dist_tensor import is_dist
from autoparallel.parallel.param_list import flat_params
from autoparallel.parallel.grads import BUCKET_BYTES, GradientSync, check_bucket_bytes
from autoparallel.parallel.group_clips import Suspended
from autoparallel.parallel.step_hooks import StepHooks


def _paddle_optimizer():
    import paddle

    return paddle.optimizer.Optimizer


class ShardedOptimizer(StepHooks):
    """Wraps a paddle optimizer built over a distributed model's parameters."""

    def __init__(self, optimizer, shard_fn=None, gradient_accumulation_steps: int = 1,
                 bucket_bytes: int = BUCKET_BYTES, overlap: bool = False):
        if not hasattr(optimizer, "step") or not hasattr(optimizer, "clear_grad"):
            raise TypeError(f"shard_optimizer expects a paddle optimizer, got {type(optimizer).__name__}")
        steps = integral(gradient_accumulation_steps)          # numpy ints as ints; bools and floats refused
        if steps is None or steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {gradient_accumulation_steps!r}")
        gradient_accumulation_steps = steps
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        _check_closure_optimizer(optimizer)
        self._inner = optimizer
        self._shard_fn = shard_fn
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.grad_sync = GradientSync(lambda: self.parameters, bucket_bytes, gradient_accumulation_steps, overlap)

    @property
    def parameters(self):
        return list(flat_params(self._inner))            # parameter groups flattened

    @property
    def bucket_bytes(self) -> int:
        """Size limit of a fused gradient bucket (takes effect when the buckets are planned: the first step)."""
        return self.grad_sync.bucket_bytes

    @bucket_bytes.setter
    def bucket_bytes(self, n: int) -> None:
        self.grad_sync.bucket_bytes = check_bucket_bytes(n)

    def reduce_gradients(self) -> int:
        """Reduce every partial gradient not reduced yet (by backward hooks); returns the buckets launched."""
        return self.grad_sync.flush()

    def _scale_gradients(self) -> None:
        """Between the reduction and the update (gradient accumulation divides here)."""

    def step(self):
        whole = self._check_whole_tensor_update()
        self.reduce_gradients()
        self._scale_gradients()
        clip = self._clip_global_norm()
        try:
            with local_mode():
                self._inner.step()
            self._step_other_ranks()
            if whole is not None:
                copies = self.__dict__.get("_rank_copies")
                whole.apply(copies[1] if copies is not None else None)
        finally:
            if isinstance(clip, Suspended):
                clip.restore()
            elif clip is not None:
                self._inner._grad_clip = clip
        self._after_step()

    def _check_whole_tensor_update(self):
        """An optimizer whose update reads whole-parameter norms (Lamb's trust ratio) would read a shard's norm
        on a sharded parameter: the step is corrected to the whole parameter's ratio (parallel/lamb_whole.py);
        returns the correction to apply after the step (None: nothing to correct)."""
        from autoparallel.parallel.lamb_whole import WholeNormLamb, sharded
        from autoparallel.parallel.optim_clone import whole_tensor_kind

        kind = whole_tensor_kind(self._inner)
        names = [p.name for p in self.parameters if sharded(p)] if kind is not None else []
        if not names:
            return None
        if getattr(self._inner, "_multi_precision", False):
            raise NotImplementedError(
                f"{kind}(multi_precision=True) over sharded parameters ({names[0]}: {self._layout(names[0])}): the "
                f"whole-parameter trust ratio is computed for float32 / float64 parameters only; use "
                f"multi_precision=False (or ap.Strategy.amp) or keep these parameters replicated")
        return WholeNormLamb(self._inner, self.parameters)

    def _layout(self, name) -> str:
        p = next(p for p in self.parameters if p.name == name)
        return ", ".join(map(str, p.placements))

    def _clip_global_norm(self):
        """paddle's norm clips over distributed parameters, applied here with the norms of the whole
        (unsharded) gradients, every shard counted once (parallel/clip.py): ``ClipGradByGlobalNorm`` over the
        parameters paddle clips together (all of them, or each parameter group by its own ``grad_clip``:
        parallel/group_clips.py), ``ClipGradByNorm`` per parameter. paddle's own clips, which would see only
        this rank's shards, are off for the step. Returns what to restore (None: nothing to do)."""
        import paddle

        from autoparallel.parallel.group_clips import clip_sets, suspend

        done = []
        for gc, ps in clip_sets(self._inner):
            params = [p for p in ps if not p.stop_gradient]
            if isinstance(gc, (paddle.nn.ClipGradByGlobalNorm, paddle.nn.ClipGradByNorm)) \
                    and any(is_dist(p) for p in params):
                self._clip_params(gc, params)
                done.append(gc)
        return suspend(self._inner, done) if done else None

    def _clip_params(self, gc, params) -> None:
        import paddle

        from autoparallel.parallel.clip import clip_grad_norm_, clip_grad_norm_per_param_

        if isinstance(gc, paddle.nn.ClipGradByNorm):
            clip_grad_norm_per_param_(params, float(gc.clip_norm))
            return
        plain = [p.name for p in params if not is_dist(p)]
        if plain:
            raise NotImplementedError(f"global-norm clipping over distributed and plain parameters together "
                                      f"({', '.join(plain[:3])} are plain); distribute the whole model")
        self.last_grad_norm = clip_grad_norm_(params, float(gc.clip_norm))

    def _step_other_ranks(self) -> None:
        """The simulated world: the other ranks' copies of each parameter (parallel/sim_step.py)."""
        from autoparallel.comm.world import current_world

        if not current_world().is_simulated or not isinstance(self._inner, _paddle_optimizer()):
            return
        params = self.parameters
        key = tuple(id(p) for p in params)
        copies = self.__dict__.get("_rank_copies")
        if copies is None or copies[0] != key:
            from autoparallel.parallel.sim_step import RankCopies

            copies = self.__dict__["_rank_copies"] = (key, RankCopies(self._inner, params))
            loaded = self.__dict__.pop("_loaded_state", None)
            if loaded is not None:                  # set_state_dict before the first step
                copies[1].load_state(loaded)
        copies[1].step()

    def set_state_dict(self, state_dict):
        """paddle's; in the simulated world the other ranks' optimizer copies load it too (sim_step.py)."""
        out = self._inner.set_state_dict(state_dict)
        copies = self.__dict__.get("_rank_copies")
        if copies is not None:
            copies[1].load_state(state_dict)
        else:
            self.__dict__["_loaded_state"] = dict(state_dict)
        return out

    def clear_grad(self, set_to_zero: bool = True):
        self.grad_sync.reset()
        with local_mode():
            self._inner.clear_grad(set_to_zero=set_to_zero)
            for p in self.parameters:                   # the simulated world: every rank's copy
                for t in (p.locals.values() if is_dist(p) else ()):
                    if t is not p:
                        t.clear_gradient(set_to_zero)

    clear_gradients = clear_grad

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _check_closure_optimizer(optimizer) -> None:
    """LBFGS steps with ``step(closure)``: it re-runs the forward and backward several times inside one step and
    takes dot products over all gradients; the distributed step reduces gradients once per step and runs the
    update on local shards, so it is refused by name (not a TypeError from a step without a closure)."""
    import paddle

    if isinstance(optimizer, paddle.optimizer.LBFGS):
        raise NotImplementedError(
            "paddle.optimizer.LBFGS over a distributed model: its step(closure) re-evaluates the loss several times "
            "per step and reads dot products over the whole gradients, which the distributed step (one gradient "
            "reduction per step, updates on local shards) does not give; use an elementwise optimizer (AdamW, "
            "Adam, SGD, Momentum, ...) or run LBFGS in one process")


def shard_optimizer(optimizer, shard_fn=None, gradient_accumulation_steps: int = 1):
    """paddle's ``shard_optimizer(optimizer, shard_fn=None, gradient_accumulation_steps=1)``; ``shard_fn`` is

    * ``None``: optimizer states follow their parameters' layouts (data-parallel gradients reduced);
    * ``ap.ShardingStage1/2/3(sharding_mesh_dim, mesh=None)``: ZeRO stage 1/2/3 over that mesh dim;
    * a ProcessMesh (the article's ``shard_optimizer(opt, mesh)``): ZeRO stage 1 over the mesh's data dim;
    * paddle's ``shard_fn(accumulator_name, param, accumulator) -> distributed accumulator``: asked once
      per parameter; states that it shards over a mesh dim the parameter is replicated on run as ZeRO
      stage 1 over that dim, states kept in the parameter's layout as above, anything else is refused.
    See parallel/sharding_stages.py."""
    from autoparallel.parallel.sharding_stages import resolve_shard_fn, zero_optimizer

    steps = integral(gradient_accumulation_steps)          # numpy ints as ints (every shard_fn); bools, floats refused
    if steps is None or steps < 1:
        raise ValueError(f"shard_optimizer: gradient_accumulation_steps must be an int >= 1, got "
                         f"{gradient_accumulation_steps!r}")
    gradient_accumulation_steps = steps
    _check_closure_optimizer(getattr(optimizer, "_inner", optimizer))
    from autoparallel.parallel.stale_optimizers import repoint_stale

    repoint_stale(getattr(optimizer, "_inner", optimizer))      # built from parameters taken before the layout
    stage = resolve_shard_fn(optimizer, shard_fn)
    if stage is None:
        return ShardedOptimizer(optimizer, None, gradient_accumulation_steps, overlap=True)
    return zero_optimizer(optimizer, stage, gradient_accumulation_steps)
