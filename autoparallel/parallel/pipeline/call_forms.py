"""What ``pipe(...)`` returns: the model's own output form around the pipeline's loss (called.py).

A model may return its logits as a tensor (the example GPT), a tuple (a PaddleFormers causal LM with
``return_dict=False``: ``(loss, logits)`` when given labels, ``(logits,)`` without) or an output object
(``CausalLMOutputWithPast`` with ``.loss`` / ``.logits`` under ``return_dict=True``). ``detect`` learns each form
once, when the pipeline is planned (before any parameter is sharded), by dry runs on one sample of two tokens: a
model split at its blocks runs with every block skipped (as ``auto_split``'s dry run), a model with
``embed()``/``head()`` whole. ``build`` then fills a form with the pipeline's loss and, where it has them, the
logits. A field the pipeline cannot provide honestly (the logits of a training call: computed micro-batch by
micro-batch on the last stage and not kept; any other output of the model) is a ``Withheld`` value, which raises
``NotImplementedError`` saying why on any use, never ``None`` or a wrong tensor.
"""
from __future__ import annotations

import dataclasses
import inspect

import paddle

LOSS, LOGITS, NONE, WITHHELD = "loss", "logits", "none", "withheld"


class Withheld:
    """An output field the pipeline does not provide: any use raises, naming the field and the reason."""

    def __init__(self, what: str, why: str):
        self.__dict__["_msg"] = f"{what} of a pipeline-parallel model's call is not provided: {why}"

    def __getattr__(self, name):
        raise NotImplementedError(self.__dict__["_msg"])

    def __repr__(self):
        return f"<withheld: {self.__dict__['_msg']}>"

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError(self.__dict__["_msg"])


for _name in ("__array__", "__float__", "__int__", "__bool__", "__len__", "__iter__", "__getitem__", "__add__",
              "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__neg__",
              "__matmul__", "__lt__", "__gt__", "__le__", "__ge__", "__setattr__"):
    setattr(Withheld, _name, Withheld._refuse)


@dataclasses.dataclass(frozen=True)
class Form:
    """``kind``: "tensor", "sequence" (tuple / list) or "mapping" (dict, ModelOutput); ``cls``: the type to
    rebuild; ``slots``: ((index or key, role), ...) with role LOSS / LOGITS / NONE / WITHHELD."""
    kind: str
    cls: type = None
    slots: tuple = ()


TENSOR = Form("tensor")


def learn(out, labels: bool) -> Form:
    """The form of one model output (``labels``: whether the call that produced it had labels)."""
    if isinstance(out, paddle.Tensor):
        return TENSOR
    if isinstance(out, dict):
        return Form("mapping", type(out), tuple((k, _role(k, v, labels)) for k, v in out.items() if v is not None))
    if isinstance(out, (tuple, list)):
        roles, seen = [], set()
        for i, v in enumerate(out):
            r = _role(i, v, labels, LOGITS in seen)
            seen.add(r)
            roles.append((i, r))
        return Form("sequence", type(out), tuple(roles))
    raise NotImplementedError(f"the model returns a {type(out).__name__}; a pipeline-parallel model rebuilds a "
                              f"tensor, a tuple / list or a dict / ModelOutput around its loss")


def _role(key, v, labels: bool, logits_seen: bool = False) -> str:
    if v is None:
        return NONE
    if key == "loss" or (key == 0 and labels and isinstance(v, paddle.Tensor) and v.size == 1):
        return LOSS
    if key == "logits" or (isinstance(key, int) and not logits_seen and isinstance(v, paddle.Tensor)
                           and v.ndim >= 3 and list(v.shape[:2]) == [1, 2]):
        return LOGITS
    return WITHHELD


def build(form: Form, loss, logits, why: str):
    """``form`` filled with ``loss`` and ``logits`` (either may be a Withheld); other fields withheld."""
    if form.kind == "tensor":
        return loss if loss is not None else logits
    roles = {r for _, r in form.slots}
    if loss is not None and LOSS not in roles:
        raise NotImplementedError(f"the model's output ({form.cls.__name__}) has no loss field when called with "
                                  f"labels, so the pipeline's loss has nowhere to go; call model.train_batch(inputs, "
                                  f"labels) for the loss")
    if loss is None and LOGITS not in roles:
        raise NotImplementedError(f"the model's output ({form.cls.__name__}) has no logits field; call "
                                  f"model.eval_batch(inputs) for the last stage's output")
    values = {LOSS: loss, LOGITS: logits, NONE: None}
    filled = [(k, values[r] if r in values else Withheld(f"output field {k!r}", why)) for k, r in form.slots]
    if form.kind == "mapping":
        return form.cls(**dict(filled))
    return form.cls(v for _, v in filled)


def detect(model, pieces) -> dict:
    """{(labels given, return_dict keyword or None): Form or the exception its dry run raised}."""
    params = inspect.signature(model.forward).parameters
    if "labels" not in params:                 # called with labels= anyway: the pipeline's loss, a tensor
        keys = [(False, None)]
    else:
        keys = [(lab, None) for lab in (True, False)]
    if "return_dict" in params:
        keys += [(lab, rd) for lab, _ in list(keys) for rd in (True, False)]
    rng = paddle.get_rng_state()
    modes = [(layer, layer.training) for _, layer in model.named_sublayers(include_self=True)]
    forms = {(True, None): TENSOR, (True, True): TENSOR, (True, False): TENSOR} if "labels" not in params else {}
    try:
        model.eval()                          # no running statistics updated, no random numbers drawn
        for key in keys:
            try:
                forms[key] = learn(_dry(model, pieces, *key), key[0])
            except Exception as e:            # noqa: BLE001 - kept and raised by name when that form is called
                forms[key] = e
    finally:
        paddle.set_rng_state(rng)
        for layer, training in modes:
            layer.training = training
    return forms


def _dry(model, pieces, labels: bool, return_dict):
    from .auto_split import _hidden_name, _hidden_of, _swapped, resolve, shaped
    from .dry_input import dry_input

    ids = dry_input(model) if pieces.generic else paddle.zeros([1, 2], dtype="int64")
    kwargs = {"labels": paddle.zeros([1, 2], dtype="int64")} if labels else {}
    if return_dict is not None:
        kwargs["return_dict"] = return_dict
    with paddle.no_grad():
        if not pieces.generic:
            return model(ids, **kwargs)
        blocks = resolve(model, pieces.layers_name)
        forms = pieces.block_forms

        def skip(j):
            name = _hidden_name(blocks[j].forward, blocks[j])
            return lambda self, *args, **kw: shaped(forms, j, _hidden_of(args, kw, name))

        with _swapped(blocks, {j: skip(j) for j in range(len(blocks))}):
            return model(ids, **kwargs)


_INSTEAD = {
    "generate": "to generate, load the trained parameters into an unsplit {cls} in one process "
                "(ap.training_state(pipe, opt) lists them under the model's names)",
    "state_dict": "for a checkpoint use ap.training_state(pipe, opt): this rank's stages under the model's names",
}
_INSTEAD["set_state_dict"] = _INSTEAD["state_dict"]


def missing_attribute(pipe, name: str):
    """``PipelineModule.__getattr__``: an attribute of the model the pipeline was split from (``generate``,
    ``state_dict``, ...) raises ``AttributeError`` saying what the pipeline runs and what to use instead; any other
    name a plain ``AttributeError``."""
    model = getattr(getattr(pipe.__dict__.get("plan"), "pieces", None), "model", None)
    if name.startswith("_") or model is None or not hasattr(model, name):
        raise AttributeError(f"'PipelineModule' object has no attribute {name!r}")
    cls = type(model).__name__
    instead = _INSTEAD.get(name, "call it on an unsplit {cls}").format(cls=cls)
    raise AttributeError(f"'PipelineModule' object has no attribute {name!r}: a pipeline-parallel model runs {cls}'s "
                         f"forward through its stages (pipe(...), train_batch, eval_batch) and holds only this "
                         f"process's stages, so {cls}.{name} does not run across them; {instead}")
