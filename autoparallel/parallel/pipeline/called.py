"""A pipeline-parallel model called like the model: the one-process training loop on a pipeline.

    loss = model(**batch).loss                 # or model(ids, labels=y)[0], model(ids, labels=y)
    (loss / accum_steps).backward()            # or loss.backward(), scaler.scale(loss).backward()
    if (i + 1) % accum_steps == 0: opt.step(); opt.clear_grad()

In training mode with gradients enabled, ``pipe(*args, **kwargs)`` binds the call to the model's forward
signature: ``labels`` (keyword, or the forward's own ``labels`` position) become the pipeline's labels,
``return_dict`` picks the output form, every other argument is a model input (one ids tensor, or a dict of keyword
inputs for a model split at its blocks). It then runs the whole ``train_batch`` step right there (the strategy's
schedule, its 1F1B memory) with the parameters' gradients set aside, keeps the gradients the step produced
(``held``) and puts the set-aside gradients back, so accumulation across calls works as in one process. The loss
it returns (the same value on every rank) is ``value + dummy * 1`` for a fresh 0-d leaf ``dummy`` that requires a
gradient; a hook on ``dummy`` receives ``g``, the gradient of whatever the user backpropagates with respect to the
loss, and adds ``g * held`` to every parameter's ``.grad``. So ``loss / 8``, ``loss * 0.5``,
``scaler.scale(loss)`` and ``loss + term_of_other_parameters`` give one process's gradients (exact for powers of
two on fp32 gradients). (A ``PyLayer`` would do the same, but paddle 3.3.1 crashes with a segmentation fault when
a PyLayer's backward runs a second time; the multiply of the hook form keeps paddle's own error for a second
backward without ``retain_graph``.)

Decisions (docs/pipeline.md, "Called like the model"):

* the return form is the model's own (call_forms.py); the logits of a training call are withheld (any use raises);
* without labels in training mode: the logits, for ``loss_fn(model(x), y).backward()`` (external_loss.py: every
  micro-batch's forward, then the user's loss, then every micro-batch's backward from the logits' gradient; FThenB
  order, refused under an explicitly chosen 1F1B / VPP / ZB-H1);
* under ``paddle.no_grad()`` or after ``model.eval()``: ``eval_batch`` (forward only), the loss with labels, else
  the output (on ranks without the last stage a withheld value); after ``model.eval()`` with gradients enabled a
  ``backward()`` through that loss or output raises naming the remedy (it would otherwise train nothing, silently);
* each loss keeps its own held gradients until it is freed: two pending losses are supported (``(l1 + l2)
  .backward()`` adds both), ``backward(retain_graph=True)`` twice adds twice as in one process, a loss never
  backpropagated changes nothing; a backward after an optimizer step changed the parameters raises, as paddle
  does in one process (the parameters' inplace versions are compared);
* low-precision parameters (float16 / bfloat16 without fp32 masters) are refused: the unit-scale step could
  underflow and ``g * held`` rounds unlike one process; ``strategy.amp`` keeps fp32 master parameters and runs
  the step on its own loss scale.
"""
from __future__ import annotations

import inspect

import paddle

from . import call_forms
from .amp import USER_BACKWARD

LOGITS_WHY = ("the logits of a training step are computed micro-batch by micro-batch on the last stage and not "
              "kept; call the model under paddle.no_grad() or after model.eval() without labels (or "
              "model.eval_batch(inputs)) for them")


LOGITS_WHY_EXTERNAL = "a training call without labels returns the logits only (external_loss.py)"


OUTPUT_FLAGS = {"output_hidden_states": "every block's hidden states", "output_attentions": "every block's attention "
                "weights"}


def call(pipe, args: tuple, kwargs: dict):
    inputs, labels, return_dict = bind(pipe, args, kwargs)
    _refuse_output_flags(pipe, inputs)
    form = _form(pipe, labels is not None, return_dict)
    if pipe.training and paddle.is_grad_enabled():
        if labels is None:                     # loss_fn(model(x), y): the logits, backward through the pipeline
            from . import external_loss

            if pipe.ranks is not None and form.kind != "tensor" and \
                    call_forms.LOGITS not in {r for _, r in form.slots}:
                raise NotImplementedError(external_loss.HEADS_LAUNCHED)
            out = external_loss.call(pipe, _with_return_dict(pipe, inputs, return_dict))
            if isinstance(out, (tuple, list, dict)):   # the model's whole output, its heads distributed
                return out
            return call_forms.build(form, None, out, LOGITS_WHY_EXTERNAL)
        return call_forms.build(form, train_call(pipe, inputs, labels), call_forms.Withheld("the logits",
                                                                                            LOGITS_WHY), LOGITS_WHY)
    return _evaluate(pipe, form, inputs, labels)


def _refuse_output_flags(pipe, inputs) -> None:
    """A call asking the model for outputs beyond the loss and the logits (``output_hidden_states=True``) raises: the
    blocks' outputs live on each stage's ranks and the call's output form was learned without them (the field came
    back ``None``, as if the model had not been asked)."""
    asked = [k for k in OUTPUT_FLAGS if isinstance(inputs, dict) and not hasattr(inputs.get(k), "shape")
             and bool(inputs.get(k))]
    if asked:
        raise NotImplementedError(f"{type(pipe.plan.pieces.model).__name__} called through a pipeline with "
                                  f"{', '.join(f'{k}=True' for k in asked)}: a pipeline-parallel model's call returns "
                                  f"the loss and the logits only, and {' and '.join(OUTPUT_FLAGS[k] for k in asked)} "
                                  f"live on each stage's ranks; call it without {' / '.join(asked)}, or run the "
                                  f"trained parameters in an unsplit model in one process for them")


def _with_return_dict(pipe, inputs, return_dict):
    """A model split at its blocks hands back its whole output to ``loss_fn(model(x), y)``: its forward gets the
    call's ``return_dict`` (else a ``return_dict=True`` call came back in the model's default form, a tuple)."""
    if return_dict is None or not pipe.plan.pieces.generic:
        return inputs
    if not isinstance(inputs, dict):
        inputs = {next(iter(inspect.signature(pipe.plan.pieces.model.forward).parameters)): inputs}
    return {**inputs, "return_dict": return_dict}


EVAL_BACKWARD = ("backward() through the output of a pipeline-parallel model called after model.eval(): that call "
                 "ran forward only (eval_batch), so there are no gradients to give; call model.train() before a "
                 "training call (set the config's dropout to 0 to train without it), or model.train_batch(inputs, "
                 "labels), which trains in eval mode too")


def _refuse_backward(t):
    """``t`` (a loss or the logits of an eval-mode call with gradients enabled) raising at backward (not silent)."""
    if not paddle.is_grad_enabled() or not isinstance(t, paddle.Tensor):
        return t

    def refuse(g):
        raise RuntimeError(EVAL_BACKWARD)

    dummy = paddle.zeros([], dtype=t.dtype)
    dummy.stop_gradient = False
    dummy.register_hook(refuse)
    return t + dummy * paddle.ones([], dtype=t.dtype)


def _evaluate(pipe, form, inputs, labels):
    out = pipe.eval_batch(inputs, labels)
    if labels is not None:
        if out is None:
            raise RuntimeError(_NO_SYNC)
        loss = _refuse_backward(paddle.to_tensor(float(out), dtype="float32"))
        why = "with labels the forward-only call returns the loss; call it without labels for the logits"
        return call_forms.build(form, loss, call_forms.Withheld("the logits", why), why)
    if out is None:
        out = call_forms.Withheld("the output", "it lives on the last pipeline stage's ranks, and this rank "
                                                "holds another stage")
    return call_forms.build(form, None, _refuse_backward(out), "a forward-only call returns the logits only")


def _form(pipe, labels: bool, return_dict):
    forms = getattr(pipe.plan.pieces, "call_forms", None) or {}
    form = forms.get((labels, return_dict))
    if form is None:
        raise NotImplementedError(f"{type(pipe.plan.pieces.model).__name__} called with labels={labels}, "
                                  f"return_dict={return_dict!r}: its output form was not learned when the pipeline "
                                  f"was built; call model.train_batch(inputs, labels) / model.eval_batch(inputs)")
    if isinstance(form, Exception):
        raise NotImplementedError(f"the output form of {type(pipe.plan.pieces.model).__name__} called with "
                                  f"labels={labels}, return_dict={return_dict!r} could not be learned (its dry run "
                                  f"raised {type(form).__name__}: {str(form)[:200]}); call model.train_batch(inputs, "
                                  f"labels) / model.eval_batch(inputs)")
    return form


def bind(pipe, args: tuple, kwargs: dict):
    """(inputs, labels, return_dict) of a call, bound to the model's forward signature."""
    model = pipe.plan.pieces.model
    sig = inspect.signature(model.forward)
    kwargs = dict(kwargs)
    own = {n for n, p in sig.parameters.items() if p.kind is not p.VAR_KEYWORD}
    extra = {k: kwargs.pop(k) for k in ("labels", "return_dict") if k in kwargs and k not in own}
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"a pipeline-parallel model is called with the arguments of "
                        f"{type(model).__name__}.forward{sig} (plus labels=, return_dict=): {e}") from None
    given = {}
    for name, value in bound.arguments.items():
        if sig.parameters[name].kind is sig.parameters[name].VAR_KEYWORD:
            given.update(value)
        elif sig.parameters[name].kind is sig.parameters[name].VAR_POSITIONAL:
            if value:
                raise TypeError(f"a pipeline-parallel model takes its inputs by name; {type(model).__name__}.forward"
                                f" got {len(value)} extra positional arguments")
        else:
            given[name] = value
    given.update(extra)
    labels, return_dict = given.pop("labels", None), given.pop("return_dict", None)
    first = next(iter(sig.parameters))
    if not given:
        raise TypeError(f"a pipeline-parallel model called without inputs; expected {type(model).__name__}"
                        f".forward{sig}")
    if list(given) == [first]:
        return given[first], labels, return_dict
    if not pipe.plan.pieces.generic:
        raise TypeError(f"{type(model).__name__} runs through its embed(ids) method, which takes the ids tensor "
                        f"alone; got the inputs {sorted(given)}")
    return given, labels, return_dict


class _Ticket:
    """One call's held gradients, applied by the hook on its loss's dummy leaf."""

    def __init__(self, pipe, held: dict, versions: dict):
        self.pipe, self.held, self.versions = pipe, held, versions
        self.steps = getattr(pipe, "steps_taken", 0)          # counted by the wrapped optimizer (wiring.py)

    def apply(self, g):
        stale = [t.name for t, v in self.versions.values() if t._inplace_version() != v]
        if stale or getattr(self.pipe, "steps_taken", 0) != self.steps:
            raise RuntimeError(f"backward() of a pipeline-parallel model's loss after its parameters were changed in "
                               f"place (an optimizer step since the call{': ' + stale[0] if stale else ''}): its "
                               f"gradients belong to the old values. Paddle refuses this in one process too; call "
                               f"backward() before opt.step()")
        with paddle.no_grad():
            for t, h in self.held.values():
                add = h * g.astype(h.dtype)
                cur = paddle.Tensor.grad.__get__(t)
                paddle.Tensor.grad.__set__(t, add if cur is None else cur + add)
        if getattr(self.pipe, "grads_scaled_by", None) is None:
            self.pipe.grads_scaled_by = USER_BACKWARD


def leaves(pipe) -> list:
    """Every tensor autograd accumulates a gradient in: each held shard of a distributed parameter."""
    from autoparallel.dist_tensor import is_dist

    out = []
    for p in pipe.parameters():
        out.extend(p._ap_locals.values() if is_dist(p) else [p])
    return out


def train_call(pipe, inputs, labels):
    """Run the step with the gradients set aside; the loss tensor whose backward adds the step's gradients."""
    ts = leaves(pipe)
    low = sorted({str(t.dtype).replace("paddle.", "") for t in ts} & {"float16", "bfloat16"})
    if low:
        raise NotImplementedError(f"a pipeline-parallel model with {'/'.join(low)} parameters called like the model: "
                                  f"its step runs at unit loss scale (low-precision gradients could underflow) and "
                                  f"backward's g * gradients would round unlike one process; keep fp32 parameters "
                                  f"with strategy.amp (fp32 masters, its own loss scale), or use "
                                  f"model.train_batch(inputs, labels, scaler=scaler)")
    value, held = _step(pipe, ts, inputs, labels)
    versions = {id(t): (t, t._inplace_version()) for t in ts}
    ticket = _Ticket(pipe, held, versions)
    dummy = paddle.zeros([], dtype="float32")
    dummy.stop_gradient = False
    dummy.register_hook(lambda g: ticket.apply(g))
    return paddle.full([], value, dtype="float32") + dummy * paddle.ones([], dtype="float32")


def _step(pipe, ts: list, inputs, labels):
    """(loss value, {id: (leaf, gradient of this step)}); every leaf's gradient is as before the call afterwards."""
    get, put = paddle.Tensor.grad.__get__, paddle.Tensor.grad.__set__
    saved, scaled = {}, getattr(pipe, "grads_scaled_by", None)
    with paddle.no_grad():
        for t in ts:
            g = get(t)
            saved[id(t)] = g.clone() if g is not None else None
            put(t, None)
    held = {}
    pipe.grads_scaled_by = None
    try:
        value = pipe.train_batch(inputs, labels)
        with paddle.no_grad():
            for t in ts:
                g = get(t)
                if g is not None:
                    held[id(t)] = (t, g.clone())
    finally:
        pipe.grads_scaled_by = scaled
        for t in ts:
            put(t, saved[id(t)])
    if value is None:
        raise RuntimeError(_NO_SYNC)
    return float(value), held


_NO_SYNC = ("a pipeline-parallel model called like the model returns the loss on every rank, but this pipeline "
            "reports it on the last stage only (apply_pp(sync_loss=False)); build it with sync_loss=True or call "
            "model.train_batch(inputs, labels)")
