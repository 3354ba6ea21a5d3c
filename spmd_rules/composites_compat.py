"""Composite ops of ``paddle.compat`` (torch-style signatures), decomposed into routed ops.

``paddle.compat.split(tensor, split_size_or_sections, dim=0)``: an int is the size of every chunk (the last
may be smaller), a list the sizes themselves -- it runs as paddle's ``split`` with explicit sections (a
vision tower splitting its packed patches into images by ``cu_seqlens`` lengths)."""
from __future__ import annotations

import numbers

from spmd_rules.composites import gshape


def split(tensor, split_size_or_sections, dim=0):
    shape = gshape(tensor)
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or not -len(shape) <= dim < len(shape):
        raise ValueError(f"paddle.compat.split: dim must be an int in [-{len(shape)}, {len(shape)}), got {dim!r}")
    n = shape[dim]
    s = split_size_or_sections
    if isinstance(s, numbers.Integral) and not isinstance(s, bool):
        if s <= 0:
            raise ValueError(f"paddle.compat.split: split_size must be positive, got {s}")
        sections = [int(s)] * (n // s) + ([n % s] if n % s else [])
    else:
        sections = [int(v) for v in s]
        if sum(sections) != n:
            raise ValueError(f"paddle.compat.split: sections {sections} must sum to dim {dim}'s size {n}")
    return tuple(tensor.split(sections, axis=dim))


COMPOSITES: dict = {"paddle.compat.split": split}
