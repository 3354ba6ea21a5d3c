"""Installing dispatch: the patches of paddle that route ops on distributed tensors (see dispatch_handle for the
handle that undoes them).

* every dotted path of the op table becomes a routed wrapper (rule -> reshard -> local op);
* every other name of those functions, in every loaded module and on ``paddle.Tensor``, and the C op they
  forward to, points at the wrapper (``aliases``); in-place ``op_`` forms, ``x[i] = v``, cast spellings and
  ``paddle.is_tensor`` get their forms (``tensor_forms``);
* the remaining public callables of ``paddle``, ``paddle.nn.functional``, ``paddle.linalg``, ``paddle.incubate``,
  ``paddle.incubate.nn.functional`` and the math methods of ``paddle.Tensor`` are guarded: given a distributed
  tensor they raise ``NotImplementedError``;
* ``paddle.jit``'s ``StaticFunction`` entry, the lazy initialiser hook and the loss scalers are patched too.

Every assignment goes through ``autoparallel.patches``, so ``dispatch_handle.uninstall()`` restores them all.
"""
from __future__ import annotations

import importlib
import inspect

import paddle
from spmd_rules.op_table import IN_PLACE_PATHS, OP_TABLE

from autoparallel import aliases, captured_ops, patches, tensor_forms
from autoparallel import dispatch as D
from autoparallel.compat import owner_of, static_value_converter
from autoparallel.context import state as _ctx
from autoparallel.dispatch import _any_dist, _tracing_tensors
from autoparallel.dispatch_values import VALUE_OPS, resolve as resolve_values
from autoparallel.shadows import SHADOWS


def install_all() -> list:
    """Patch paddle; returns what dispatch_handle plugs in: [the dispatch module, the in-place rebinder]."""
    routed = {}
    for op, paths in OP_TABLE.items():
        for path in paths:
            owner, attr = owner_of(path)
            orig = getattr(owner, attr, None)
            if orig is None or getattr(orig, "_ap_routed", None):
                continue
            D._ORIG[path] = orig
            w = tensor_forms.inplace_routed(op, path, orig) if path in IN_PLACE_PATHS else _routed(op, path, orig)
            patches.patch(owner, attr, w)
            routed[id(orig)] = w
    aliases.patch_aliases(routed)
    tensor_forms.install_setitem()
    aliases.patch_inplace(tensor_forms.inplace_routed)
    tensor_forms.install_casts()
    tensor_forms.install_metadata()
    if SHADOWS[0]:
        tensor_forms.install_shadow_readers()
    _install_composites()
    _install_guards()
    _install_hooks()
    captured_ops.repoint_captured()
    return [D, tensor_forms.rebind]


def _install_hooks() -> None:
    """The other patches of paddle: ``paddle.jit.to_static`` over distributed tensors, the creation order of
    lazily built parameters, the loss scalers, a model's own reentrant recompute, ``Layer.sharded_state_dict``
    over distributed parameters."""
    from paddle.jit.dy2static.program_translator import StaticFunction

    from autoparallel.graph import jit
    from autoparallel.lazy_init import order
    from autoparallel import collective_forms, ddp_guard, export_save, hapi_forms, no_sync, trainer_forms
    from autoparallel import layer_copy, nn_utils_forms, param_init, pylayer_forms, state_dict_forms
    from autoparallel import copy_forms, dcp_forms, optimizer_state_forms, param_carry, summary_forms
    from autoparallel.parallel import amp_scaler, full_state, implicit_optimizer, lr_metrics, model_recompute

    patches.remember(StaticFunction, "__call__")        # graph.jit assigns these two itself
    patches.remember(*static_value_converter())
    jit.install()
    order.install()
    amp_scaler.install()
    implicit_optimizer.install()
    lr_metrics.install()
    model_recompute.install()
    full_state.install()
    param_init.install()
    nn_utils_forms.install()
    pylayer_forms.install()
    state_dict_forms.install()
    optimizer_state_forms.install()
    no_sync.install()
    hapi_forms.install()
    summary_forms.install()
    ddp_guard.install()
    trainer_forms.install()
    layer_copy.install()
    export_save.install()
    dcp_forms.install()
    collective_forms.install()
    param_carry.install()
    copy_forms.install()


def _reset() -> None:
    from autoparallel.graph import jit

    jit._INSTALLED = False
    D._LOCAL_FN.clear()


patches.on_undo(_reset)


def _routed(op, path, orig):
    def wrapper(*args, **kwargs):
        if _ctx.local_depth > 0 or not (_any_dist(args, kwargs) or _tracing_tensors(args, kwargs)):
            return orig(*args, **kwargs)
        if op in VALUE_OPS:             # tensors standing for numbers (arange(h), expand([-1, w])) read first
            args, kwargs = resolve_values(op, args, kwargs)
            if not (_any_dist(args, kwargs) or _tracing_tensors(args, kwargs)):
                return orig(*args, **kwargs)
        return D.run(op, path, args, kwargs)

    wrapper.__wrapped__ = orig
    wrapper.__name__ = getattr(orig, "__name__", path.rsplit(".", 1)[-1])
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper._ap_routed = op
    wrapper._ap_path = path
    wrapper._ap_wrapper = True
    return wrapper


def _layer_holds_dist(args) -> bool:
    """A layer method (``Conv2D.forward``...) called on a plain input while the layer's own parameters are
    distributed (a tensor-parallel or replicated layer fed an undistributed tensor): it runs as the composite
    too, since paddle's own body would hand the distributed parameters to C ops."""
    layer = args[0] if args else None
    return isinstance(layer, paddle.nn.Layer) and _any_dist(tuple(layer._parameters.values()), {})


def _composite(path, orig, fn):
    bind = []          # paddle's own binding of ``orig`` (aliases such as input= for x=), built on first use

    def wrapper(*args, **kwargs):
        if _ctx.local_depth > 0 or not (_any_dist(args, kwargs) or _tracing_tensors(args, kwargs)
                                        or _layer_holds_dist(args)):
            return orig(*args, **kwargs)
        if not bind:
            from autoparallel import binding

            bind.append(binding.binder(orig) if binding.has_signature(orig) else None)
        if bind[0] is not None:
            try:
                args, kwargs = bind[0](args, kwargs)
            except TypeError as e:
                raise TypeError(f"{path}: {e}") from None
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = orig
    wrapper.__name__ = getattr(orig, "__name__", path.rsplit(".", 1)[-1])
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper._ap_composite = path
    wrapper._ap_wrapper = True
    return wrapper


# paddle functions written in python over public ops that all have rules: on distributed tensors they run as paddle
# wrote them, each op routed (their draws, ``paddle.uniform(x.shape)``, are made at the global shape: one process's
# values under the same seed). Each is checked against one process in tests/test_probe_fresh_meta_ops.py.
AS_WRITTEN = tuple(f"paddle.nn.functional.{n}" for n in (
    "alpha_dropout", "feature_alpha_dropout", "dice_loss", "triplet_margin_with_distance_loss",
    "multi_label_margin_loss", "adaptive_log_softmax_with_loss", "embedding_renorm_"))


def _install_composites() -> None:
    """Functions paddle writes in python over its primitives run, on distributed tensors, as our own
    decomposition into routed ops (``spmd_rules.composites``); every other name of the same function (a
    ``paddle.Tensor`` method, an import in another module) points at the wrapper too."""
    from spmd_rules.composites import COMPOSITES
    from spmd_rules.composites_more import COMPOSITES as MORE_COMPOSITES
    from spmd_rules.composites_shape import COMPOSITES as SHAPE_COMPOSITES
    from spmd_rules.composites_compat import COMPOSITES as COMPAT_COMPOSITES
    from spmd_rules.composites_rnn import COMPOSITES as RNN_COMPOSITES
    from spmd_rules.composites_fused import COMPOSITES as FUSED_COMPOSITES
    from spmd_rules.composites_scatter import COMPOSITES as SCATTER_COMPOSITES
    from spmd_rules.composites_stats import COMPOSITES as STATS_COMPOSITES
    from spmd_rules.composites_fill import COMPOSITES as FILL_COMPOSITES
    from spmd_rules.composites_meta import COMPOSITES as META_COMPOSITES
    from spmd_rules.composites_npair import COMPOSITES as NPAIR_COMPOSITES
    from spmd_rules.composites_draws import COMPOSITES as DRAW_COMPOSITES
    from spmd_rules.composites_temporal import COMPOSITES as TEMPORAL_COMPOSITES
    from spmd_rules.composites_whole import COMPOSITES as WHOLE_COMPOSITES
    from spmd_rules.composites_metric import COMPOSITES as METRIC_COMPOSITES

    from autoparallel import autograd_forms, copy_forms, draw_agree, local_ctc

    autograd = {"paddle.grad": autograd_forms.grad, "paddle.autograd.grad": autograd_forms.grad,
                "paddle.autograd.backward": autograd_forms.backward,
                "paddle.to_tensor": copy_forms.to_tensor, "paddle.assign": copy_forms.assign,
                "paddle.as_tensor": copy_forms.as_tensor, "paddle.asarray": copy_forms.asarray,
                "paddle.nn.functional.ctc_loss": local_ctc.ctc_loss,
                "paddle.multinomial": draw_agree.agreed_draw(MORE_COMPOSITES["paddle.multinomial"])}
    mapping = {}
    for path, fn in {**COMPOSITES, **SHAPE_COMPOSITES, **MORE_COMPOSITES, **COMPAT_COMPOSITES, **RNN_COMPOSITES,
                     **FUSED_COMPOSITES, **SCATTER_COMPOSITES, **STATS_COMPOSITES, **FILL_COMPOSITES,
                     **META_COMPOSITES, **NPAIR_COMPOSITES, **DRAW_COMPOSITES, **TEMPORAL_COMPOSITES,
                     **WHOLE_COMPOSITES, **METRIC_COMPOSITES, **{p: None for p in AS_WRITTEN}, **autograd}.items():
        owner, attr = owner_of(path)
        orig = getattr(owner, attr, None)
        if orig is None or hasattr(orig, "_ap_wrapper"):
            continue
        if path in draw_agree.RANDOM_COMPOSITES:
            fn = draw_agree.agreed_generator_call(fn)
        w = mapping.get(id(orig)) or _composite(path, orig, fn or orig)
        patches.patch(owner, attr, w)
        mapping[id(orig)] = w
        D._ORIG[path] = orig            # dispatch.routed_form(orig) finds the wrapper (a loss_fn taken early)
    aliases.repoint_modules(mapping)
    for attr in dir(paddle.Tensor):
        w = mapping.get(id(getattr(paddle.Tensor, attr, None)))
        if w is not None and not attr.startswith("_") and attr not in _STORAGE_METHODS:
            patches.patch(paddle.Tensor, attr, w)


def _guarded(name, orig):
    def wrapper(*args, **kwargs):
        if _ctx.local_depth == 0 and _any_dist(args, kwargs) and _guarded_op(name) in VALUE_OPS:
            args, kwargs = resolve_values(_guarded_op(name), args, kwargs)      # linspace(0, n - 1, h)
        if _ctx.local_depth == 0 and _any_dist(args, kwargs):
            raise NotImplementedError(f"{name} has no spmd rule, so it cannot run on distributed tensors; "
                                      f"register one with spmd_rules.register_spmd_rule({name.rsplit('.', 1)[-1]!r})")
        return orig(*args, **kwargs)

    wrapper.__wrapped__ = orig
    wrapper.__name__ = getattr(orig, "__name__", name)
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper._ap_guard = True
    return wrapper


def _guarded_op(name: str) -> str:
    return name.rsplit(".", 1)[-1]


# Tensor methods that act on storage, not values: they keep working on a DistParameter's local shard.
_STORAGE_METHODS = {"numpy", "clone", "detach", "detach_", "set_value", "cpu", "cuda", "item", "tolist",
                    "backward", "register_hook", "clear_grad", "clear_gradient", "copy_", "get_tensor",
                    "value", "is_dense", "is_dist", "element_size", "numel", "dim", "ndimension",
                    "is_contiguous", "contiguous", "data_ptr", "get_strides", "to", "pin_memory",
                    "zero_", "fill_", "uniform_", "normal_", "stop_gradient", "shape", "dtype", "place",
                    "size", "is_leaf", "grad", "name", "persistable", "type", "_md5sum", "__format__",
                    "__repr__", "__str__", "__hash__", "__bool__", "__len__", "__array__", "__index__",
                    "__float__", "__int__", "__nonzero__", "__deepcopy__", "__reduce_ex__", "__setitem__",
                    "__iter__", "__contains__", "__dlpack__", "__array_ufunc__"}


def _install_guards() -> None:
    for modname in ("paddle", "paddle.nn.functional", "paddle.linalg", "paddle.incubate",
                    "paddle.incubate.nn.functional", "paddle.fft", "paddle.signal", "paddle.geometric",
                    "paddle.vision.ops"):
        mod = importlib.import_module(modname)
        for attr in dir(mod):
            if attr.startswith("_"):
                continue
            val = getattr(mod, attr)
            if not (inspect.isfunction(val) or inspect.isbuiltin(val)) or hasattr(val, "_ap_wrapper") \
                    or hasattr(val, "_ap_guard"):
                continue
            try:
                patches.patch(mod, attr, _guarded(f"{modname}.{attr}", val))
            except (AttributeError, TypeError):
                pass
    public = set(dir(paddle))
    for attr in dir(paddle.Tensor):
        if attr in _STORAGE_METHODS or attr.startswith("_") or attr not in public:
            continue
        val = getattr(paddle.Tensor, attr)
        if not callable(val) or hasattr(val, "_ap_wrapper") or hasattr(val, "_ap_guard") or isinstance(val, type):
            continue
        try:
            patches.patch(paddle.Tensor, attr, _guarded(f"paddle.Tensor.{attr}", val))
        except (AttributeError, TypeError):
            pass
