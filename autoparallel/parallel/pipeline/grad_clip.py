"""Gradient clipping by the global norm across pipeline stages.

The norm is over every parameter of the whole model once: each stage adds the squares of its own
parameters' gradients (distributed ones through ``parallel/clip.py``: TP shards summed over the model dim,
data-parallel copies counted once), a parameter shared by stages on several pipeline ranks (a tied
embedding / LM head, whose gradients the runtime has already summed) only on the lowest of them. On real
ranks the stage sums are added over the whole world, each stage's sum contributed by its ``(data 0, model 0)``
rank only; in one process (every stage held here, also the simulated world) the sum is already complete.
Every stage then scales its gradients by the same factor ``clip_norm / max(norm, clip_norm)``
(``paddle.nn.ClipGradByGlobalNorm``), and the optimizer steps without paddle's own clip, which would see
only this rank's stages.
"""
from __future__ import annotations

import paddle

from autoparallel.dist_tensor import is_dist
from autoparallel.parallel.optimizer import ShardedOptimizer

from .amp import scaled_by_scaler


class PipelineOptimizer(ShardedOptimizer):
    """``ShardedOptimizer`` over a rank's stage parameters; clips by the norm over every stage."""

    def __init__(self, optimizer, pipe):
        super().__init__(optimizer)
        self.__dict__["_pipe"] = pipe
        self.last_grad_norm = None

    def step(self):
        scaled = scaled_by_scaler(self._pipe)
        if scaled is not None:
            raise RuntimeError(f"the pipeline's last train_batch ran its backward on a GradScaler's scale "
                               f"({scaled[1]:g}) and the gradients are still scaled: step through "
                               f"scaler.step(optimizer) (it unscales them first), not optimizer.step()")
        super().step()

    def _clip_global_norm(self):
        """Each set paddle clips together (every parameter, or each parameter group by its own ``grad_clip``:
        parallel/group_clips.py) by its norm over every stage; the same sets in the same order on every rank."""
        from autoparallel.parallel.group_clips import clip_sets, suspend

        done = []
        for gc, ps in clip_sets(self._inner):
            if gc is None:
                continue
            check_clip(gc)
            params = [p for p in ps if not p.stop_gradient and getattr(p, "need_clip", True)]
            norm = pipeline_grad_norm(self._pipe, params)
            scale_grads(params, float(gc.clip_norm) / max(norm, float(gc.clip_norm)))
            self.last_grad_norm = norm
            done.append(gc)
        return suspend(self._inner, done) if done else None


def check_clip(gc) -> None:
    if not isinstance(gc, paddle.nn.ClipGradByGlobalNorm):
        raise NotImplementedError(f"gradient clipping with pipeline parallelism supports ClipGradByGlobalNorm "
                                  f"(the norm over every stage), got {type(gc).__name__}")
    if not float(gc.clip_norm) > 0:
        raise ValueError(f"ClipGradByGlobalNorm.clip_norm must be positive, got {gc.clip_norm}")


def counted_elsewhere(pipe) -> set:
    """ids of this rank's parameters shared with a lower pipeline rank (that rank counts them)."""
    if pipe.ranks is None:                       # every stage in this process: shared parameters are one object
        return set()
    from .shared_params import shared_parameters as _shared_parameters

    out = set()
    for rs, names in _shared_parameters(pipe.stages, pipe.plan.pp):
        if pipe.pp_rank in rs and pipe.pp_rank != min(rs):
            for s, name in names.items():
                if s in pipe.held_stages:
                    out.add(id(dict(pipe.stages[s].named_parameters())[name]))
    return out


def pipeline_grad_norm(pipe, params) -> float:
    """sqrt of the sum of squares of every distinct gradient element of the whole model (same on every rank)."""
    from autoparallel.parallel.clip import global_norm, param_terms

    skip = counted_elsewhere(pipe)
    params = [p for p in params if id(p) not in skip]
    dist_params = [p for p in params if is_dist(p)]
    squares = global_norm(param_terms(dist_params)) ** 2 if dist_params else 0.0
    with paddle.no_grad():
        for p in params:
            if not is_dist(p) and p.grad is not None:
                squares += float((p.grad.astype("float32") ** 2).sum())
    if pipe.ranks is not None:                   # real ranks: add the stages' sums over the world
        import paddle.distributed as dist

        t = paddle.to_tensor([squares if tuple(pipe.coords) == (0, 0) else 0.0], dtype="float64")
        dist.all_reduce(t)
        squares = float(t.numpy()[0])
    return squares ** 0.5


def scale_grads(params, factor: float) -> None:
    """Multiply every rank's gradient of ``params`` by ``factor`` in place."""
    from autoparallel.parallel.clip import scale_

    grads = []
    for p in params:
        grads += [t.grad for t in p.locals.values()] if is_dist(p) else [p.grad]
    scale_(grads, factor)
