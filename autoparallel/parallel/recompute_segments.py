"""Full recompute of a model's blocks in segments of n consecutive blocks, whatever their call form.

Blocks are called the way their model calls them: positionally (``layer(h, mask, ...)``) or by keyword
(``layer(hidden_states=h, attention_mask=m, ...)``), returning the hidden states alone or a tuple with the hidden
states first (attention weights, router logits, a cache entry after them). The hidden states are the first
parameter of the block's ``forward``.

A segment is one recompute region: the first block's call runs every block of the segment on the first
block's other arguments, feeding each block's hidden states to the next. Each block then returns its own output
with the hidden states replaced by the segment's last hidden states, so the model's loop carries the right
value through the blocks that already ran. A later block's call must bring exactly that hidden state and the
same other arguments as the first block (a sliding-window layer given another mask does not): otherwise the
segment would have run it on the wrong inputs, and its call raises ``ValueError`` naming the block
(``checkpoint_every_n_layers=1`` always applies).
"""
from __future__ import annotations

import inspect

import paddle


def _hidden_name(forward, where: str):
    """The name of ``forward``'s first parameter; None for ``forward(*args, ...)`` (hidden states positional)."""
    all_params = list(inspect.signature(forward).parameters.values())
    params = [p for p in all_params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not params and any(p.kind == p.VAR_POSITIONAL for p in all_params):
        return None
    if not params:
        raise TypeError(f"recompute of {where}: its forward takes no positional parameter for the hidden states "
                        f"(signature {inspect.signature(forward)})")
    return params[0].name


def hidden_of(args, kwargs, name: str, where: str):
    if args:
        return args[0]
    if name is not None and name in kwargs:
        return kwargs[name]
    want = f"first parameter {name!r}" if name else "first positional argument of forward(*args, ...)"
    raise TypeError(f"recompute of {where}: called without its hidden states ({want}); got keywords {sorted(kwargs)}")


def with_hidden(args, kwargs, name: str, x):
    if args:
        return (x,) + tuple(args[1:]), kwargs
    return args, {**kwargs, name: x}


def first_of(out, where: str):
    if isinstance(out, (tuple, list)) and out:
        return out[0]
    if isinstance(out, paddle.Tensor) or hasattr(out, "_spec"):
        return out
    raise TypeError(f"recompute of {where} in segments of several blocks: a block must return its hidden states "
                    f"or a tuple/list starting with them, got {type(out).__name__}; use checkpoint_every_n_layers=1")


def replace_first(out, x):
    if isinstance(out, (tuple, list)):
        return type(out)([x, *out[1:]])
    return x


def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, (tuple, list)) and type(a) is type(b) and len(a) == len(b):
        return all(_same(p, q) for p, q in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (bool, int, float, str, type(None))) and isinstance(b, (bool, int, float, str, type(None))):
        return type(a) is type(b) and a == b
    return False


class Segment:
    """Blocks ``names`` as one recompute region (see the module docstring)."""

    def __init__(self, blocks, names, checkpoint):
        self.blocks, self.names, self.checkpoint = list(blocks), list(names), checkpoint
        self.fwds = [b.forward for b in self.blocks]
        self.hidden = [_hidden_name(f, n) for f, n in zip(self.fwds, self.names)]
        self.where = self.names[0] if len(self.names) == 1 else f"{self.names[0]}..{self.names[-1]}"
        self.last = None

    def install(self) -> None:
        self.blocks[0].forward = self.first
        for i, b in enumerate(self.blocks[1:], 1):
            b.forward = (lambda *a, _i=i, **k: self.later(_i, a, k))

    def _run(self, *args, **kwargs):
        outs, x = [], hidden_of(args, kwargs, self.hidden[0], self.names[0])
        for f, name, key in zip(self.fwds, self.names, self.hidden):
            a, k = with_hidden(args, kwargs, key, x)
            outs.append(f(*a, **k))
            if len(self.fwds) > 1:
                x = first_of(outs[-1], name)
        return outs

    def first(self, *args, **kwargs):
        self.last = None
        roots = self.blocks + [a for a in list(args) + list(kwargs.values())]
        outs = self.checkpoint(self._run, self.where, roots, args, kwargs)
        if len(outs) == 1:
            return outs[0]
        x = first_of(outs[-1], self.names[-1])
        outs = [replace_first(o, x) for o in outs]      # no reference to the blocks' intermediate hidden states
        self.last = (outs, x, args, kwargs)
        return outs[0]

    def later(self, i: int, args, kwargs):
        name = self.names[i]
        if self.last is None:
            raise RuntimeError(f"recompute segment {self.where}: {name} was called before {self.names[0]}, "
                               f"which runs the segment; use checkpoint_every_n_layers=1")
        outs, x, args0, kwargs0 = self.last
        if hidden_of(args, kwargs, self.hidden[i], name) is not x:
            raise ValueError(f"recompute segment {self.where}: {name} was called on other hidden states than the "
                             f"output of the block before it (the model changes them between blocks); "
                             f"use checkpoint_every_n_layers=1")
        rest = (tuple(args[1:]), {k: v for k, v in kwargs.items() if k != self.hidden[i]})
        rest0 = (tuple(args0[1:]), {k: v for k, v in kwargs0.items() if k != self.hidden[0]})
        if not _same(rest, rest0):
            raise ValueError(f"recompute segment {self.where} ran every block with the arguments of "
                             f"{self.names[0]}, but {name} was called with other ones (e.g. another attention "
                             f"mask); use checkpoint_every_n_layers=1")
        if i == len(self.blocks) - 1:
            self.last = None
        return outs[i]


def install_segments(blocks, names, n: int, checkpoint) -> list:
    """Segments of ``n`` consecutive ``blocks`` installed in place; returns them."""
    segs = [Segment(blocks[i:i + n], names[i:i + n], checkpoint) for i in range(0, len(blocks), n)]
    for s in segs:
        s.install()
    return segs
