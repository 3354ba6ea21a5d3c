"""PaddleFormers' ``Trainer`` (plain mode) over a model parallelized here.

The Trainer accumulates the value ``training_step`` returns into a plain tensor and checks it with
``isinstance(loss, paddle.Tensor)``; a distributed model's loss is a DistTensor, so the first step failed
with a bare AssertionError. ``training_step`` here returns the loss's global value as a plain tensor (read
by every rank, as every rank runs the step); the backward inside it is unchanged. The Trainer's own
optimizer over the distributed parameters runs as ``ap.shard_optimizer`` would
(parallel/implicit_optimizer.py), and its ``model.no_sync()`` for gradient accumulation is this project's
(no_sync.py). On several launched ranks (trainer_ranks.py) the Trainer's data parallelism is the model's: no
``paddle.DataParallel`` wrap, each data-parallel rank gets its part of the global batch, laid out as such.

With ``gradient_accumulation_steps > 1`` the Trainer divides every ``p.grad`` by that number by hand before the
optimizer step. In the simulated world ``p.grad`` of a distributed parameter is the lowest rank's copy only, so
``optimizer_step`` here applies the same division to the other ranks' copies first (a real rank holds one copy).

With ``recompute_granularity`` set (or expert parallelism) the Trainer runs every backward under ``no_sync`` and
then all-reduces the parameters' gradients itself (paddle's ``fused_allreduce_gradients``, which reads the local
shards and needs paddle's global group). Distributed parameters are left out of that call: their reduction is
the optimizer's (from backward hooks, or at its step for what ``no_sync`` kept), exactly once.

Installed with dispatch when ``paddleformers.trainer.trainer`` is already imported; else as its import ends
(after_import.py), or at the Trainer's first ``hasattr(model, "no_sync")`` (no_sync.py calls ``install()``, a
dictionary look-up once installed). On several launched ranks the Trainer runs as trainer_ranks.py says.
"""
from __future__ import annotations

import sys

from autoparallel import after_import, patches, trainer_pipeline, trainer_ranks, trainer_resume


TARGET = "paddleformers.trainer.trainer"


def install() -> None:
    mod = sys.modules.get(TARGET)
    cls = getattr(mod, "Trainer", None)
    if cls is None:
        after_import.watch(TARGET, install)         # imported later: patched as its import ends
        return
    if getattr(cls.__dict__.get("training_step"), "_ap_wrapper", False):
        return
    patches.patch(cls, "__init__", _init(cls.__init__))
    patches.patch(cls, "training_step", _training_step(cls.training_step))
    patches.patch(cls, "optimizer_step", _optimizer_step(cls.optimizer_step))
    patches.patch(cls, "_wrap_model", _wrap_model(cls._wrap_model))
    patches.patch(cls, "_prepare_inputs", _prepare_inputs(cls._prepare_inputs))
    patches.patch(cls, "save_model", _save_model(cls.save_model))
    patches.patch(cls, "train", _train(cls.train))
    if hasattr(cls, "_save_flex_model_state"):
        patches.patch(cls, "_save_flex_model_state", _save_flex_model(cls._save_flex_model_state))
    if hasattr(cls, "_save_flex_optimizer_state"):
        patches.patch(cls, "_save_flex_optimizer_state", _save_flex_optimizer(cls._save_flex_optimizer_state))
    if hasattr(cls, "_load_flex_checkpoint"):
        patches.patch(cls, "_load_flex_checkpoint", _load_flex(cls._load_flex_checkpoint))
    _install_args(sys.modules.get("paddleformers.trainer.training_args"))
    if callable(getattr(mod, "fused_allreduce_gradients", None)):
        patches.patch(mod, "fused_allreduce_gradients", _fused_allreduce(mod.fused_allreduce_gradients))


def _training_step(orig):
    def training_step(self, *args, **kwargs):
        from autoparallel.dist_tensor import is_dist

        loss = orig(self, *args, **kwargs)
        return loss.full().detach() if is_dist(loss) else loss

    training_step._ap_wrapper = True
    return training_step


def _optimizer_step(orig):
    def optimizer_step(self, *args, **kwargs):
        k = self.args.gradient_accumulation_steps
        if k > 1 and not self.args.enable_auto_parallel:
            _scale_other_copies(self.model, 1.0 / k)
        return orig(self, *args, **kwargs)

    optimizer_step._ap_wrapper = True
    return optimizer_step


def _scale_other_copies(model, factor: float) -> None:
    """The simulated world: what the Trainer did to each distributed parameter's ``p.grad`` (the lowest rank's
    copy), done to the other ranks' copies."""
    import paddle

    from autoparallel.comm.world import current_world
    from autoparallel.dist_tensor import is_dist
    from autoparallel.local_mode import local_mode

    if not current_world().is_simulated:
        return
    with local_mode(), paddle.no_grad():
        for p in model.parameters():
            if not is_dist(p) or p.grad is None:
                continue
            seen = {p.grad.data_ptr()}              # a copy sharing the lowest rank's gradient is done already
            for t in p.locals.values():
                g = t.grad
                if t is not p and g is not None and g._is_initialized() and g.data_ptr() not in seen:
                    seen.add(g.data_ptr())
                    g.scale_(factor)


def _fused_allreduce(orig):
    def fused_allreduce_gradients(parameter_list, hcg, *args, **kwargs):
        from autoparallel.dist_tensor import is_dist

        params = list(parameter_list)
        plain = [p for p in params if not is_dist(p)]
        if len(plain) == len(params):
            return orig(params, hcg, *args, **kwargs)
        if plain:
            return orig(plain, hcg, *args, **kwargs)
        return None

    fused_allreduce_gradients._ap_wrapper = True
    return fused_allreduce_gradients


def _init(orig):
    import inspect

    sig = inspect.signature(orig)

    def __init__(self, *args, **kwargs):
        from autoparallel.dist_tensor import is_dist

        bound = sig.bind_partial(self, *args, **kwargs).arguments
        model, targs = bound.get("model"), bound.get("args")
        world = getattr(targs, "world_size", 1) if targs is not None else 1
        if model is not None and targs is not None and trainer_pipeline.is_pipeline(model):
            trainer_pipeline.refuse_options(targs, (bound.get("optimizers") or (None,))[0])
            trainer_resume.refuse_forms(targs, trainer_pipeline.WHO)
            if world > 1:
                trainer_ranks.setup_pipeline(self, targs, world)
        elif model is not None and targs is not None and any(is_dist(p) for p in model.parameters()):
            if world > 1:
                trainer_ranks.setup(self, model, targs, world)
            trainer_resume.refuse_forms(targs, "PaddleFormers' Trainer")
            trainer_resume.refuse_masters(model, (bound.get("optimizers") or (None,))[0], targs,
                                          "PaddleFormers' Trainer")
        return orig(self, *args, **kwargs)

    __init__._ap_wrapper = True
    return __init__


def _install_args(mod) -> None:
    cls = getattr(mod, "TrainingArguments", None)
    if cls is None:
        return
    for which, name in enumerate(("dataset_world_size", "dataset_rank")):
        if isinstance(cls.__dict__.get(name), property):
            patches.patch(cls, name, trainer_ranks.dataset_property(cls.__dict__[name], which))


def _train(orig):
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if not trainer_pipeline.is_pipeline(self.model):
            return orig(self, resume_from_checkpoint, *args, **kwargs)
        trainer_pipeline.refuse_options(self.args, self.optimizer)
        with trainer_pipeline.accumulating(self.model):
            return orig(self, resume_from_checkpoint, *args, **kwargs)

    train._ap_wrapper = True
    return train


def _wrap_model(orig):
    def wrap_model(self, model, training=True):
        if trainer_ranks.ranked(self) is None:
            return orig(self, model, training)
        return model                    # no paddle.DataParallel: the model reduces its own gradients

    wrap_model._ap_wrapper = True
    return wrap_model


def _prepare_inputs(orig):
    def prepare_inputs(self, inputs):
        return trainer_ranks.as_parts(self, orig(self, inputs))

    prepare_inputs._ap_wrapper = True
    return prepare_inputs


def _save_model(orig):
    def save_model(self, *args, **kwargs):
        if trainer_pipeline.is_pipeline(self.model):
            return trainer_pipeline.save(self, args[0] if args else kwargs.get("output_dir"))
        if trainer_ranks.ranked(self) is None:
            return orig(self, *args, **kwargs)
        state = trainer_ranks.global_state(self.model)          # every rank: the gathers are collectives
        cls = type(self.model)
        own = cls.state_dict
        model = self.model

        def state_dict(layer, *a, **k):
            return dict(state) if layer is model and not a and not k else own(layer, *a, **k)

        with patches.swapped(cls, {"state_dict": state_dict}):
            return orig(self, *args, **kwargs)

    save_model._ap_wrapper = True
    return save_model


def _distributed(model) -> bool:
    from autoparallel.dist_tensor import is_dist

    return model is not None and any(is_dist(p) for p in model.parameters())


def _save_flex_model(orig):
    def save_flex_model_state(self, output_dir):
        if trainer_pipeline.is_pipeline(self.model):
            return None                 # written by save_model on every rank (trainer_pipeline.save)
        return orig(self, output_dir)

    save_flex_model_state._ap_wrapper = True
    return save_flex_model_state


def _save_flex_optimizer(orig):
    def save_flex_optimizer_state(self, output_dir):
        if trainer_pipeline.is_pipeline(self.model):
            return None                 # written with the parameters by save_model (trainer_pipeline.save)
        if not _distributed(self.model):
            return orig(self, output_dir)
        opt = self.optimizer
        self.optimizer = trainer_ranks.FlexOptimizerView(self.model, opt)
        try:
            return orig(self, output_dir)
        finally:
            self.optimizer = opt

    save_flex_optimizer_state._ap_wrapper = True
    return save_flex_optimizer_state


def _load_flex(orig):
    def load_flex_checkpoint(self, resume_from_checkpoint):
        if trainer_pipeline.is_pipeline(self.model):
            keep = not self.args.ignore_load_lr_and_optim
            trainer_pipeline.load(self, resume_from_checkpoint, keep)
            if keep:
                self._load_scheduler(resume_from_checkpoint)
            return None
        if not _distributed(self.model):
            return orig(self, resume_from_checkpoint)
        trainer_resume.refuse_forms(self.args, "PaddleFormers' Trainer")
        keep = not self.args.ignore_load_lr_and_optim
        trainer_resume.load(self.model, self.optimizer, resume_from_checkpoint, with_optimizer=keep)
        if keep:
            self._load_scheduler(resume_from_checkpoint)
        return None

    load_flex_checkpoint._ap_wrapper = True
    return load_flex_checkpoint
