"""Pipeline stages for models without ``embed()`` / ``head()``: split at the repeated block list.

``find_blocks(model)`` picks the ``LayerList`` / ``Sequential`` whose children all have one type and that
holds the most parameters (a PaddleFormers ``LlamaForCausalLM`` gives ``model.layers``, a nanoGPT-style
model ``transformer.h``; a shallow MoE model's layers, not the longer expert list inside one of them).
Everything else is attached to the first stage (what runs before the first block: embeddings, rotary
tables, masks) or the last (what runs after the last block: final norm, LM head), decided by a dry run
on one token that records which parameters receive a gradient at the first block's input and which from
the model's output given the last block's output (parameters used by neither, and frozen ones, go to the
last stage, so the optimizer and checkpoints still hold them).

A stage runs the model's own ``forward`` on the micro-batch's model inputs with the blocks' ``forward``
swapped for proxies, so whatever the model computes between its pieces (masks, position ids, rotary
tables, the tuple handling of block outputs) runs as the model wrote it:

* blocks before the stage's range return their hidden input untouched (no compute);
* the stage's first block takes the activation received from the previous stage in place of its hidden
  input; on every stage but the first, what runs before it (the prefix) runs without gradient, so it only
  supplies the side inputs (masks, positions, rotary tables) and its parameters get no gradient here;
* a stage that is not the last stops the forward when the model calls the next stage's first block and hands
  that block's hidden input on (what the model made of the stage's last block output; stopping inside the last
  block would hand on a raw output without its graph when the model calls the block inside a no-grad region, as
  paddle's reentrant ``recompute`` does); the last stage runs the rest of the model and returns its output
  (the logits: the first element of a tuple output, or ``.logits``).

Side inputs are recomputed on every stage from the micro-batch, so every stage needs the model inputs
(every rank passes the same batch to ``train_batch``). They must not depend on learned parameters: later
stages compute them without gradient (and, on real ranks, from a copy of the prefix parameters that the
first stage's optimizer never updates). The dry run checks it: a model whose blocks take a side input
computed from a learned parameter is refused (``NotImplementedError``; give it ``embed()`` / ``head()``).
So every stage's side inputs are functions of the micro-batch and of buffers alone, the same on every
rank whatever the prefix parameters' layout (a vocab-parallel embedding on the first stage's mesh, a stale
copy elsewhere): the prefix's hidden output, the one thing computed from them, is discarded on later
stages.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import types

import paddle
from paddle import nn

from autoparallel.compat import grad_enabled, set_grad_enabled


_MISSING = object()


class _StageExit(Exception):
    """Raised by the last block of a non-final stage to stop the model's forward."""

    def __init__(self, out):
        super().__init__("pipeline stage boundary")
        self.out = out


def find_blocks(model) -> str:
    """Dotted path of the LayerList/Sequential of same-type layers holding the most parameter elements (the
    longest on a tie, the outermost on a tie of both: a MoE layer's expert list, longer than the decoder
    layers of a shallow model, holds fewer parameters than the layer list around it); TypeError when there
    is none."""
    best, size = None, (0, 0)
    for name, layer in model.named_sublayers(include_self=True):
        if not isinstance(layer, (nn.LayerList, nn.Sequential)):
            continue
        kids = list(layer.children())
        key = (sum(math.prod(p.shape) for p in layer.parameters()), len(kids))
        if kids and key > size and len({type(k) for k in kids}) == 1:
            best, size = name, key
    if best is None:
        raise TypeError(f"{type(model).__name__} cannot be split into pipeline stages: expected embed(ids) and "
                        f"head(x) methods, or a paddle.nn.LayerList / Sequential of repeated same-type layers; "
                        f"found neither")
    if best == "":
        raise TypeError(f"{type(model).__name__} is itself a Sequential of blocks: nothing marks where the "
                        f"embedding and head are; wrap it in a Layer with embed()/head() methods")
    return best


def resolve(model, path: str):
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part) if not part.isdigit() else obj[int(part)]
    return obj


def _hidden_name(fn, block=None) -> str | None:
    """The name of a block forward's first parameter (the hidden state); a wrapper's ``(*args, **kwargs)`` (a
    recompute region installed over the block's forward) is read through to ``block``'s class forward, so a
    model calling its blocks by keyword (``layer(hidden_states=h, ...)``: Phi3) is found either way."""
    name = _first_positional(fn)
    if name is None and block is not None and getattr(type(block), "forward", None) is not None:
        name = _first_positional(types.MethodType(type(block).forward, block))
    return name


def _first_positional(fn) -> str | None:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    ok = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return params[0].name if params and params[0].kind in ok else None


def _replace_hidden(args, kwargs, name, x):
    if args:
        return (x,) + tuple(args[1:]), kwargs
    if name is None or name not in kwargs:
        raise TypeError("a pipeline block was called without its hidden-state argument; expected it first")
    return args, dict(kwargs, **{name: x})


def _hidden_of(args, kwargs, name):
    return args[0] if args else kwargs[name]


def _first(out):
    """The hidden state of a block output (a tensor, or a tuple/list whose first element it is)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def model_output(out):
    """Logits of a model output: a tensor, the first element of a tuple/list, or ``.logits``."""
    if isinstance(out, (tuple, list)):
        return out[0]
    if isinstance(out, dict) and "logits" in out:
        return out["logits"]
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out


@contextlib.contextmanager
def _grad(enabled: bool):
    prev = grad_enabled()
    set_grad_enabled(enabled)
    try:
        yield
    finally:
        set_grad_enabled(prev)


@contextlib.contextmanager
def stage_proxies(blocks, start: int, stop: int, x=None, last: bool = False, grad: bool = True, forms=None):
    """Swap the blocks' forwards for the stage's proxies (module docstring) for one model call; ``grad``: whether
    the stage's blocks record gradients (False under ``paddle.no_grad()``: evaluation)."""
    originals = [b.forward for b in blocks]
    names = [_hidden_name(f, b) for f, b in zip(originals, blocks)]
    enter_grad = grad_enabled()
    made = {}                                           # block stop - 1's hidden output, and whether grad was on

    def make(j):
        orig, name = originals[j], names[j]

        def proxy(self, *args, **kwargs):
            if j == stop and not last:
                raise _StageExit(_handed_on(stop, _hidden_of(args, kwargs, name), made, grad))
            if j < start:
                return shaped(forms, j, _hidden_of(args, kwargs, name))
            if j == start and x is not None:
                args, kwargs = _replace_hidden(args, kwargs, name, x)
                set_grad_enabled(grad)
            out = orig(*args, **kwargs)
            if j == stop - 1:
                made.update(out=_first(out), grad=grad_enabled())
            return out
        return proxy

    try:
        with _swapped(blocks, {j: make(j) for j in range(len(blocks) if last else stop + 1)}):
            yield
    finally:
        set_grad_enabled(enter_grad)


def _handed_on(stop: int, h, made: dict, grad: bool):
    """The stage's output: the hidden input the model's forward hands block ``stop`` (the stage stops when the model
    calls the next stage's first block, not inside its own last block: a block called inside a no-grad region of the
    model's forward, such as paddle's reentrant ``recompute(layer, ...)`` of PaddleFormers' ``config.recompute``,
    makes its raw output without a graph, and only the region's output carries it). ``NotImplementedError`` when
    that hidden state is still block ``stop - 1``'s raw output made without gradient: one no-grad region holds both
    blocks, so the activation handed on would carry no graph and the stage's parameters would get no gradient."""
    if grad and h is made.get("out") and not made["grad"] and getattr(h, "stop_gradient", False):
        raise NotImplementedError(f"the model's forward runs its blocks #{stop - 1} and #{stop} in one no-grad "
                                  f"region (a recompute of several blocks together), and a pipeline "
                                  f"stage ends between them: the activation handed to the next stage would carry no "
                                  f"gradient graph. Recompute each block on its own (the model's per-layer "
                                  f"recompute), or use strategy.recompute instead of the model's own")
    return h


def run_stage(model, blocks, start: int, stop: int, inputs, x=None, last: bool = False, forms=None, whole=False):
    """One stage's forward: the hidden input the model hands block ``stop``, or the model output when ``last`` (its
    logits, or all of it when ``whole``); ``forms``: ``block_forms``, so a skipped block returns what the model
    unpacks."""
    grad = grad_enabled()
    ctx = _grad(False) if x is not None else contextlib.nullcontext()
    with ctx, stage_proxies(blocks, start, stop, x, last, grad, forms):
        try:
            out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        except _StageExit as e:
            return e.out
    if not last:
        raise RuntimeError(f"{type(model).__name__}.forward returned before its block #{stop}: the blocks must "
                           f"run in list order, each once")
    return out if whole else model_output(out)


def refuse_model_losses(model) -> None:
    """A model whose forward adds its own loss terms (a MoE router's load-balancing loss, PaddleFormers'
    ``output_router_logits=True``) puts them next to its logits; the pipeline computes the loss from the logits
    alone, so it would train without them: refused."""
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "output_router_logits", False):
        raise NotImplementedError(f"{type(model).__name__} has config.output_router_logits=True: its forward returns "
                                  f"the router logits and adds a load-balancing loss to the loss it computes from "
                                  f"labels, while a pipeline computes the loss from the logits alone (loss_fn); the "
                                  f"auxiliary loss would be silently dropped. Set output_router_logits=False")


def block_forms(model, blocks, inputs) -> tuple:
    """Per block, what its forward returns: None for the hidden state itself, else ``(tuple or list, length)`` with
    the hidden state first (a dry run of the first block on ``inputs``; the blocks share one type, so one form).
    A block a stage skips returns the same form, the hidden state first and None for the rest (a cache, attention
    weights), so ``h, _ = block(h, ...)`` still unpacks."""
    orig = blocks[0].forward

    def first(self, *args, **kwargs):
        out = orig(*args, **kwargs)
        raise _StageExit((list if isinstance(out, list) else tuple, len(out)) if isinstance(out, (tuple, list))
                         else None)

    try:
        with _grad(False), _swapped(blocks, {0: first}):
            model(inputs)
    except _StageExit as e:
        return (e.out,) * len(blocks)
    raise RuntimeError(f"{type(model).__name__}.forward never called its first block: the block list must be run by "
                       f"the model's forward")


def shaped(forms, j: int, hidden):
    """``hidden`` in the form block ``j`` returns (``block_forms``)."""
    form = forms[j] if forms else None
    if form is None:
        return hidden
    kind, n = form
    return kind([hidden] + [None] * (n - 1))


def piece_params(model, path: str, inputs) -> tuple:
    """(prefix parameter names, suffix parameter names, block forms): the non-block parameters that get a gradient
    at the first block's input, and from the model output given the last block's output (a dry run on ``inputs``),
    and ``block_forms``."""
    blocks = resolve(model, path)
    block_ids = {id(p) for p in blocks.parameters()}
    every = [(n, p) for n, p in model.named_parameters() if id(p) not in block_ids]
    named = [(n, p) for n, p in every if not p.stop_gradient]
    rng = paddle.get_rng_state()                         # the dry run draws no random numbers of the user's
    try:
        forms = block_forms(model, blocks, inputs)
        h, side = _first_block_input(model, blocks, path, inputs)
        _refuse_learned_side_inputs(model, side, named)
        pre = _grad_names(h, named)
        hx = h.detach()
        hx.stop_gradient = False
        post = _grad_names(_suffix_out(model, blocks, inputs, hx, forms), named)
    except Exception as e:          # noqa: BLE001 - the user's forward failing on the made-up sample: refused by name
        if _raised_here(e):
            raise
        raise _dry_run_error(model, inputs, e) from e
    finally:
        paddle.set_rng_state(rng)
    post |= {n for n, _ in every if n not in pre}          # unused or frozen: on the last stage (kept, saved)
    return tuple(n for n, _ in every if n in pre), tuple(n for n, _ in every if n in post), forms


def _raised_here(e) -> bool:
    """The error was raised by autoparallel's own code (a refusal by name), not inside the user's forward / paddle."""
    import os
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(root + os.sep)


def _dry_run_error(model, inputs, e) -> NotImplementedError:
    from .dry_input import describe
    return NotImplementedError(
        f"splitting {type(model).__name__} into pipeline stages runs its forward on a made-up sample "
        f"({describe(inputs)}: token ids, a float row [1, in_features] for a first Linear, a float sample for a first "
        f"convolution); the forward raised {type(e).__name__}: {str(e)[:300]}. Give the model embed(ids) and "
        f"head(hidden) methods to split it without a dry run (docs/pipeline.md)")


@contextlib.contextmanager
def _swapped(blocks, fns: dict):
    """Blocks ``j`` of ``fns`` run ``fns[j]`` instead of their forward inside the context. One layer object held at
    several positions (ALBERT-style sharing: ``LayerList([block] * n)``) takes its positions in call order: its
    k-th call in the context is position k's (the blocks run in list order, each once)."""
    where = {}
    for j in range(len(blocks)):
        where.setdefault(id(blocks[j]), []).append(j)
    objs = {id(blocks[j]): blocks[j] for j in fns}
    own = {k: b.__dict__.get("forward", _MISSING) for k, b in objs.items()}
    try:
        for k, b in objs.items():
            b.forward = types.MethodType(_by_call(where[k], fns, own[k]), b)
        yield
    finally:
        for k, f in own.items():
            objs[k].__dict__.pop("forward", None)
            if f is not _MISSING:
                objs[k].__dict__["forward"] = f


def _by_call(positions: list, fns: dict, own):
    """The forward of a block object held at ``positions``: its k-th call runs ``fns[positions[k]]``, or the
    block's own forward for a position ``fns`` leaves alone."""
    calls = [0]

    def forward(self, *args, **kwargs):
        j = positions[calls[0] % len(positions)]
        calls[0] += 1
        if j in fns:
            return fns[j](self, *args, **kwargs)
        return (own if own is not _MISSING else type(self).forward.__get__(self))(*args, **kwargs)
    return forward


def _first_block_input(model, blocks, path, inputs):
    name = _hidden_name(blocks[0].forward, blocks[0])

    def grab(self, *args, **kwargs):
        side = list(args[1:]) if args else [v for k, v in kwargs.items() if k != name]
        side += list(kwargs.values()) if args else []
        raise _StageExit((_hidden_of(args, kwargs, name), side))

    try:
        with _swapped(blocks, {0: grab}):
            model(inputs)
    except _StageExit as e:
        return e.out
    raise RuntimeError(f"{type(model).__name__}.forward never called {path}[0]: the block list must be run by the "
                       f"model's forward")


def _suffix_out(model, blocks, inputs, hx, forms):
    """Model output given ``hx`` as the last block's output, as the last stage computes it: what runs before that
    block runs without gradient and every block is skipped (a block the model wraps in paddle's reentrant
    ``recompute`` when its input requires a gradient would otherwise tie the output to the prefix's parameters
    through the wrapper: PaddleFormers' ``config.recompute`` put the embedding on the last stage too)."""
    def skip(j):
        name = _hidden_name(blocks[j].forward, blocks[j])
        return lambda self, *args, **kwargs: shaped(forms, j, _hidden_of(args, kwargs, name))

    def last(self, *args, **kwargs):
        set_grad_enabled(True)
        return shaped(forms, len(blocks) - 1, hx)

    fns = {j: skip(j) for j in range(len(blocks))}
    fns[len(blocks) - 1] = last
    with _grad(False), _swapped(blocks, fns):
        return model(inputs)


def _tensors(obj) -> list:
    """The tensors in a block argument (a tensor, or nested tuples / lists / dicts of them)."""
    if isinstance(obj, paddle.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _refuse_learned_side_inputs(model, side, named) -> None:
    """Later stages recompute the blocks' side inputs without gradient: none may come from a learned parameter."""
    outs = [t for t in _tensors(side) if not t.stop_gradient]
    params = [p for _, p in named]
    if not outs or not params:
        return
    grads = paddle.grad([t.astype("float32").sum() for t in outs], params, allow_unused=True, retain_graph=True)
    used = [n for (n, _), g in zip(named, grads) if g is not None]
    if used:
        raise NotImplementedError(f"{type(model).__name__}: its blocks take inputs besides the hidden state that are "
                                  f"computed from learned parameters ({', '.join(used)}); pipeline stages after the "
                                  f"first recompute those inputs without gradient, so these parameters would get "
                                  f"wrong gradients. Give the model embed(ids) and head(x) methods instead")


def _grad_names(out, named) -> set:
    params = [p for _, p in named]
    outs = [t for t in _tensors(out if isinstance(out, (dict, tuple, list)) else [out]) if not t.stop_gradient]
    if not params or not outs:                        # every head of a tuple / dict output counts
        return set()
    grads = paddle.grad([sum(t.astype("float32").sum() for t in outs)], params, allow_unused=True)
    return {n for (n, _), g in zip(named, grads) if g is not None}
