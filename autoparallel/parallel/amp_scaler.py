"""``paddle.amp.GradScaler`` over distributed losses and the ap optimizer wrappers.

    scaler = paddle.amp.GradScaler(init_loss_scaling=1024)
    with paddle.amp.auto_cast():
        loss = model(data)                     # a DistTensor
    scaler.scale(loss).backward()
    scaler.step(optimizer)                     # optimizer from ap.parallelize / ap.Optimizer / shard_optimizer
    scaler.update()

Paddle's scaler knows neither a DistTensor loss (``scale`` asks ``var._is_initialized()``) nor gradients
that live in several ranks' local tensors or in a ZeRO optimizer's buckets; and its step hands the
found-inf flag to the *inner* paddle optimizer, which a ZeRO optimizer never consults. ``install()``
(called by the entry points) patches three methods of ``AmpScaler``/``GradScaler``; for anything else
they run paddle's own code unchanged. For an ap optimizer:

* ``scale``: a DistTensor loss times the current scale (a Python float: the loss keeps its shape).
* ``_unscale`` (run by ``step``/``minimize``/``unscale_``): multiplies every rank's local gradient by
  1/scale — before the data-parallel reduction, which is linear, so the result is the same — and checks
  them for inf/nan; the flag is then all-reduced (max) over every process of the job, so an overflow on
  one rank skips the step on all ranks and they stay identical. The wrapper's gradient reduction is moved
  to ``step()`` first (no backward-hook overlap), since ZeRO stage 2/3 buckets would take gradients out of
  ``p.grad`` before they are unscaled.
* ``step``/``minimize``: a skipped step does not call ``optimizer.step()`` (so post-step hooks, e.g.
  automatic checkpoints, do not count it); otherwise it runs the wrapper's whole step.
"""
from __future__ import annotations

_installed = False


def install() -> None:
    """Patch paddle's loss scalers once (idempotent)."""
    global _installed
    if _installed:
        return
    from paddle.amp import grad_scaler as gs

    from autoparallel.parallel import implicit_optimizer

    base_scale, base_unscale = gs.AmpScaler.scale, gs.AmpScaler._unscale
    base_step, base_minimize = gs.GradScaler.step, gs.AmpScaler.minimize

    def scale(self, var):
        from autoparallel.dist_tensor import DistTensor

        if isinstance(var, DistTensor):
            _disable_unless_float16(self)
            if not self._enable:
                return var
            out = var * float(self._scale)
            from autoparallel import backward_start

            backward_start.mark_scaled(out.locals.values())   # ZeRO keeps its gradients in p.grad
            return out
        return base_scale(self, var)

    def _unscale(self, optimizer):
        optimizer = implicit_optimizer.resolve(optimizer)
        if not is_ap_optimizer(optimizer) or not self._enable:
            return base_unscale(self, optimizer)
        state = self._optimizer_states[id(optimizer)]
        if state["state"] is gs.OptimizerState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["state"] is gs.OptimizerState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        _check_pipeline_scaled_by(self, optimizer)
        found = unscale_and_check(optimizer, 1.0 / float(self._scale))
        import paddle

        self._found_inf = paddle.full([1], bool(found), dtype="bool")  # to_tensor leaks a list per call (paddle 3.3)
        state["state"] = gs.OptimizerState.UNSCALED

    def step(self, optimizer):
        optimizer = implicit_optimizer.resolve(optimizer)
        if not is_ap_optimizer(optimizer) or not self._enable:
            return base_step(self, optimizer)
        _step(self, optimizer)
        if not self._use_dynamic_loss_scaling:
            self._optimizer_states = gs.defaultdict(gs._refresh_optimizer_state)

    def minimize(self, optimizer, *args, **kwargs):
        optimizer = implicit_optimizer.resolve(optimizer)
        if not is_ap_optimizer(optimizer) or not self._enable:
            return base_minimize(self, optimizer, *args, **kwargs)
        _step(self, optimizer)
        if self._use_dynamic_loss_scaling:
            self._update()
        self._optimizer_states = gs.defaultdict(gs._refresh_optimizer_state)
        return None, None

    def _step(self, optimizer):
        state = self._optimizer_states[id(optimizer)]
        if state["state"] is gs.OptimizerState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["state"] is gs.OptimizerState.INIT:
            self._unscale(optimizer)
        self._cache_found_inf = bool(self._found_inf)
        if not self._cache_found_inf:
            optimizer.step()
        state["state"] = gs.OptimizerState.STEPPED

    from autoparallel import patches

    for owner, name, fn in ((gs.AmpScaler, "scale", scale), (gs.AmpScaler, "_unscale", _unscale),
                            (gs.AmpScaler, "minimize", minimize), (gs.GradScaler, "step", step),
                            (gs.GradScaler, "scale", scale), (gs.GradScaler, "minimize", minimize)):
        patches.patch(owner, name, fn)          # undone by ap.uninstall()
    patches.on_undo(_reset)
    from autoparallel.parallel import precision_cast

    precision_cast.install()                    # Layer.to(dtype=...) / bfloat16() over distributed parameters
    _installed = True


def _disable_unless_float16(scaler) -> None:
    """paddle's own rule in ``AmpScaler.scale``: a dynamic scaler whose autocast dtype is not float16 (bfloat16, or
    no ``auto_cast(dtype="float16")`` entered) turns itself off (scale 1, no skipped steps). A DistTensor loss
    follows it too, or a distributed run would skip steps and change the scale where one process does not."""
    import warnings

    from paddle.amp.auto_cast import amp_global_state

    dtype = amp_global_state().amp_dtype
    if scaler._enable and dtype != "float16" and scaler._use_dynamic_loss_scaling:
        scaler._enable, scaler._use_dynamic_loss_scaling, scaler._init_loss_scaling = False, False, 1.0
        warnings.warn(f"It is not recommended to use dynamic loss scaling for {dtype}, so GradScaler is disable by "
                      f"default.")


def _reset() -> None:
    global _installed
    _installed = False


def _check_pipeline_scaled_by(scaler, optimizer) -> None:
    """A pipeline's backward runs on the scale of the GradScaler passed to its ``train_batch``; unscaling gradients
    that a backward never scaled (or scaled by another scaler) would shrink every update silently."""
    pipes = [vars(o)["_pipe"] for o in _chain(optimizer) if "_pipe" in getattr(o, "__dict__", {})]
    from autoparallel.parallel.pipeline.amp import USER_BACKWARD

    for pipe in pipes:
        scaled = getattr(pipe, "grads_scaled_by", None)
        if scaled is USER_BACKWARD:                  # a backward of the user's own (scaled) loss: as one process
            pipe.grads_scaled_by = None
            continue
        if scaled is None or scaled[0] != id(scaler):
            raise RuntimeError("this GradScaler unscales a pipeline's gradients, but the pipeline's last "
                               "train_batch ran without it, so they were never scaled: pass it as "
                               "pipe.train_batch(inputs, labels, scaler=scaler)")
        if scaled[1] != float(scaler._scale):
            raise RuntimeError(f"the pipeline's gradients were scaled by {scaled[1]:g} but the GradScaler's scale is "
                               f"now {float(scaler._scale):g}: call scaler.update() only after scaler.step()")
        pipe.grads_scaled_by = None


def is_ap_optimizer(optimizer) -> bool:
    from autoparallel.parallel.step_hooks import StepHooks

    return isinstance(optimizer, StepHooks)


_WRAPPED = ("_inner", "optimizer", "zero", "kept")      # where ap wrappers keep the optimizers they drive


def _chain(optimizer) -> list:
    """``optimizer`` and every optimizer it drives (wrapper chains, and both parts of a split optimizer)."""
    out, todo, seen = [], [optimizer], set()
    while todo:
        opt = todo.pop(0)
        if opt is None or id(opt) in seen:
            continue
        seen.add(id(opt))
        out.append(opt)
        own = vars(opt) if hasattr(opt, "__dict__") else {}
        todo.extend(own.get(name) for name in _WRAPPED)
    return out


def _params(optimizer) -> list:
    """The parameters of every paddle optimizer ``optimizer`` drives (each once)."""
    out, seen = [], set()
    for opt in _chain(optimizer):
        if not hasattr(type(opt), "_create_accumulators"):
            continue
        for p in opt._parameter_list or []:
            for q in (p["params"] if isinstance(p, dict) else [p]):
                if id(q) not in seen:
                    seen.add(id(q))
                    out.append(q)
    return out


def _no_backward_overlap(optimizer) -> None:
    """Gradients must stay in ``p.grad`` until they are unscaled: reductions happen in ``step()``."""
    from autoparallel.parallel.amp import AmpOptimizer
    from autoparallel.parallel.sharding import ZeroOptimizer

    for opt in _chain(optimizer):
        if isinstance(opt, AmpOptimizer) and (opt.scaler.dynamic or opt.scaler.scale_value != 1.0):
            raise ValueError("paddle.amp.GradScaler over an optimizer that already scales the loss "
                             "(strategy.amp with float16): use one loss scaler, either opt.scale(loss) / "
                             "opt.step() or GradScaler with strategy.amp.enable=False")
        if isinstance(opt, ZeroOptimizer):
            if opt.reducer is not None:
                raise ValueError("paddle.amp.GradScaler.step over a ZeRO optimizer whose gradients of this step came "
                                 "from a backward of a loss the scaler did not scale (reduced during that backward, "
                                 "they cannot be unscaled): expected scaler.scale(loss).backward() for every backward "
                                 "of a step the scaler steps, got a loss.backward() since the last step")
            opt.overlap = False
        sync = vars(opt).get("grad_sync") if hasattr(opt, "__dict__") else None
        if sync is not None and hasattr(sync, "async_op"):
            sync.async_op = False


def unscale_and_check(optimizer, inv: float) -> bool:
    """Multiply every local gradient of ``optimizer``'s parameters by ``inv``; True when any rank of the job
    holds an inf/nan gradient (agreed by every process)."""
    import paddle

    from autoparallel.checkpoint.sync import job
    from autoparallel.dist_tensor import is_dist
    from autoparallel.local_mode import local_mode

    _no_backward_overlap(optimizer)
    bad = None                  # on the device: one read to the host per step, not one per gradient
    with local_mode(), paddle.no_grad():
        for p in _params(optimizer):
            for t in (p.locals.values() if is_dist(p) else [p]):
                g = t.grad
                if g is None:
                    continue
                if inv != 1.0:
                    g.set_value(g * inv)
                here = paddle.logical_not(paddle.isfinite(g).all())
                bad = here if bad is None else paddle.logical_or(bad, here)
    flag = paddle.zeros([1], dtype="int32") if bad is None else bad.astype("int32").reshape([1])
    multi, _, _ = job()
    if multi:
        import paddle.distributed as dist

        from autoparallel import watchdog

        with watchdog.op("GradScaler.found_inf"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(int(flag.numpy()[0]))


__all__ = ["install", "is_ap_optimizer", "unscale_and_check"]
