"""AMP with fp32 master weights and dynamic loss scaling; on CPU an emulated autocast.

Paddle 3.3.1 has no low-precision CPU kernels (``auto_cast`` silently stays float32 there), so on CPU
``apply_amp`` emulates autocast: the inputs and outputs of the autocast layers (Linear by default) and
the gradients flowing back into their outputs are rounded through the low-precision dtype (a
round-trip cast), while parameters, optimizer states and reductions stay float32 (the master weights).
An fp16 gradient beyond its range becomes inf exactly as on a GPU, which the loss scaler handles.

    apply_amp(model, dtype="float16")
    opt = AmpOptimizer(opt, LossScaler(init_loss_scaling=2.0**15), mesh)
    opt.scale(loss).backward(); opt.step(); opt.clear_grad()      # skips the step when any rank overflowed
"""
from __future__ import annotations


import paddle

from autoparallel.comm import collectives as C
from autoparallel.comm.world import current_world
from autoparallel.dist_tensor import DistTensor, is_dist
from autoparallel.local_mode import local_mode
from autoparallel.parallel.step_hooks import StepHooks

DTYPES = ("float16", "bfloat16")


def _check_dtype(dtype):
    if dtype not in DTYPES:
        raise ValueError(f"amp dtype must be one of {DTYPES}, got {dtype!r}")


def round_trip(t, dtype):
    """``t`` rounded through ``dtype`` and back to its own dtype (an emulated low-precision value)."""
    _check_dtype(dtype)
    if isinstance(t, DistTensor):
        from autoparallel.comm.fanout import inherit_gradient_state

        out = DistTensor({r: round_trip(x, dtype) for r, x in t.locals.items()}, t.spec)
        inherit_gradient_state(out, t)          # e.g. a sequence-parallel gather's partial-gradient mark
        return out
    with local_mode():
        return t.astype(dtype).astype(t.dtype)


def apply_amp(model, dtype: str = "bfloat16", level: str = "O1", layers=(paddle.nn.Linear,)) -> list:
    """Emulated autocast on every sublayer of the given types (O1), or on every leaf layer but the norms (O2:
    the whole model in low precision, norms kept in float32 as paddle's O2 does); returns the hook handles."""
    _check_dtype(dtype)
    if level not in ("O1", "O2"):
        raise ValueError(f"amp level must be 'O1' or 'O2', got {level!r}")
    handles = []
    for _, layer in model.named_sublayers(include_self=True):
        if _autocast(layer, level, layers):
            handles.append(layer.register_forward_pre_hook(
                lambda _l, inputs: tuple(_cast_input(x, dtype) for x in inputs)))
            handles.append(layer.register_forward_post_hook(lambda _l, _i, out: _cast_output(out, dtype)))
    return handles


def _autocast(layer, level, layers) -> bool:
    if level == "O1":
        return isinstance(layer, tuple(layers))
    leaf = not list(layer.children())
    return leaf and not type(layer).__name__.endswith("Norm") and bool(layer.parameters(include_sublayers=False))


def _cast_input(x, dtype):
    return round_trip(x, dtype) if isinstance(x, (paddle.Tensor, DistTensor)) and _is_float(x) else x


def _is_float(x):
    return "float" in str(x.dtype)


def _cast_output(out, dtype):
    if not isinstance(out, (paddle.Tensor, DistTensor)) or not _is_float(out):
        return out
    out = round_trip(out, dtype)
    for t in (out.locals.values() if isinstance(out, DistTensor) else [out]):
        if not t.stop_gradient:
            t.register_hook(lambda g: g.astype(dtype).astype(g.dtype))
    return out


class LossScaler:
    """paddle.amp.GradScaler's update rules: after ``decr_every_n_nan_or_inf`` consecutive overflowing steps
    the scale is multiplied by ``decr_ratio`` (not below 1); after ``incr_every_n_steps`` consecutive good
    steps by ``incr_ratio``. A static scaler never changes its scale."""

    def __init__(self, init_loss_scaling: float = 2.0**15, incr_ratio: float = 2.0, decr_ratio: float = 0.5,
                 incr_every_n_steps: int = 1000, decr_every_n_nan_or_inf: int = 2,
                 use_dynamic_loss_scaling: bool = True):
        if not init_loss_scaling > 0:
            raise ValueError(f"init_loss_scaling must be positive, got {init_loss_scaling}")
        if not incr_ratio > 1.0:
            raise ValueError(f"incr_ratio must be > 1, got {incr_ratio}")
        if not 0.0 < decr_ratio < 1.0:
            raise ValueError(f"decr_ratio must be in (0, 1), got {decr_ratio}")
        for name, v in (("incr_every_n_steps", incr_every_n_steps), ("decr_every_n_nan_or_inf", decr_every_n_nan_or_inf)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.scale_value = float(init_loss_scaling)
        self.incr_ratio, self.decr_ratio = incr_ratio, decr_ratio
        self.incr_every, self.decr_every = incr_every_n_steps, decr_every_n_nan_or_inf
        self.dynamic = use_dynamic_loss_scaling
        self.good_steps = self.bad_steps = 0

    @classmethod
    def from_strategy(cls, amp) -> "LossScaler":
        """From ``strategy.amp``; bfloat16 needs no scaling (a static scale of 1)."""
        if amp.dtype == "bfloat16":
            return cls(1.0, use_dynamic_loss_scaling=False)
        return cls(amp.init_loss_scaling, amp.incr_ratio, amp.decr_ratio, amp.incr_every_n_steps,
                   amp.decr_every_n_nan_or_inf, amp.use_dynamic_loss_scaling)

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.good_steps, self.bad_steps = 0, self.bad_steps + 1
            if self.bad_steps == self.decr_every:
                self.scale_value = max(1.0, self.scale_value * self.decr_ratio)
                self.bad_steps = 0
        else:
            self.good_steps, self.bad_steps = self.good_steps + 1, 0
            if self.good_steps == self.incr_every:
                self.scale_value *= self.incr_ratio
                self.good_steps = 0


def _local_grads(params):
    for p in params:
        for t in (p.locals.values() if is_dist(p) else [p]):
            if t.grad is not None:
                yield t


def found_inf(params, mesh=None) -> bool:
    """Whether any rank's gradients hold inf/nan: a local flag all-reduced (max) over every dim of ``mesh``. The
    flags stay on the device until the one read of the agreed result (not one read per gradient)."""
    held = current_world().local_ranks(mesh.process_ids) if mesh is not None else [current_world().rank]
    flags = {r: None for r in held}
    with local_mode(), paddle.no_grad():
        for p in params:
            for r, t in (p.locals.items() if is_dist(p) else [(held[0], p)]):
                if t.grad is not None:
                    here = paddle.logical_not(paddle.isfinite(t.grad).all())
                    flags[r] = here if flags.get(r) is None else paddle.logical_or(flags[r], here)
        xs = {r: paddle.zeros([1], dtype="float32") if v is None else v.astype("float32").reshape([1])
              for r, v in flags.items()}
        if mesh is not None:
            for d in range(mesh.ndim):
                xs = C.mesh_groups_apply(xs, mesh, d, lambda v, ranks: C._reduce_raw(v, ranks, "max"))
    return any(float(x.numpy().max()) > 0 for x in xs.values())


class AmpOptimizer(StepHooks):
    """Unscales gradients, agrees on overflow across ranks, skips the step on overflow, updates the scale.
    ``optimizer`` is any ap optimizer (ShardedOptimizer, ZeroOptimizer) or a paddle one."""

    def __init__(self, optimizer, scaler: LossScaler, mesh=None, params=None):
        self.optimizer, self.scaler, self.mesh = optimizer, scaler, mesh
        inner = getattr(optimizer, "_inner", optimizer)
        self.params = list(params) if params is not None else [
            q for p in inner._parameter_list for q in (p["params"] if isinstance(p, dict) else [p])]
        self.skipped = 0
        self.last_found_inf = False
        self._scaled = False            # opt.scale(loss) called since the last step / clear_grad
        sync = getattr(optimizer, "__dict__", {}).get("grad_sync")
        if sync is not None:            # a clip by hand before the step sees unscaled gradients (hand_clip.py)
            below = sync.step_divisor
            sync.step_divisor = lambda: below() * self._pending_scale()

    def scale(self, loss):
        self._scaled = True
        return loss * self.scaler.scale_value if self.scaler.scale_value != 1.0 else loss

    def _pending_scale(self) -> float:
        """The scale the gradients still carry (the step divides it out): set by ``opt.scale(loss)``."""
        return self.scaler.scale_value if self._scaled else 1.0

    def step(self) -> bool:
        """Returns True when the step ran, False when it was skipped. The gradients must come from
        ``opt.scale(loss).backward()`` when the scale is not 1 (float16): dividing the gradients of an unscaled
        loss by the scale would shrink every update by that factor, so that is refused."""
        scaled, self._scaled = self._scaled, False
        if self.scaler.scale_value != 1.0 and not scaled:
            raise RuntimeError(f"AMP loss scaling (float16, scale {self.scaler.scale_value:g}): opt.step() was called "
                               f"without opt.scale(loss) since the last step; write opt.scale(loss).backward() "
                               f"instead of loss.backward() (the step divides the gradients by the scale)")
        self._unscale()
        return self._step_unless(found_inf(self.params, self.mesh))

    def _unscale(self) -> None:
        """Every local gradient divided by the loss scale."""
        inv = 1.0 / self.scaler.scale_value
        if inv != 1.0:
            with local_mode(), paddle.no_grad():
                for t in _local_grads(self.params):
                    t.grad.set_value(t.grad * inv)

    def _step_unless(self, inf: bool) -> bool:
        """Update the scale by ``inf`` (agreed by every rank that steps together); step unless it is set."""
        self.last_found_inf = inf
        self.scaler.update(inf)
        if inf:
            self.skipped += 1
            return False
        self.optimizer.step()
        self._after_step()
        return True

    def clear_grad(self, set_to_zero: bool = True):
        self._scaled = False
        return self.optimizer.clear_grad(set_to_zero)

    def __getattr__(self, name):
        return getattr(self.optimizer, name)


