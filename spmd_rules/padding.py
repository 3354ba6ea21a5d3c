"""``F.pad``: the padded dims are whole (R), every other dim keeps its sharding.

Which dims a pad list reaches follows paddle's ``pad``: in ``constant`` mode a list of ``2 * ndim`` numbers
pads every dim from the first (``pad_from_left_axis=True``, the default) or from the last; a list of any
other length, except ``2 * (ndim - 2)``, pads the last ``len(pad) / 2`` dims starting from the last one (the
torch convention). A list of ``2 * (ndim - 2)`` numbers, or any non-constant mode, pads the spatial dims of
``data_format`` (NCL/NCHW/NCDHW or channel-last), the last spatial dim first. Copying modes and a zero
constant are linear (a Partial input stays Partial); a non-zero constant is not (the input is reduced first).
"""
from __future__ import annotations

from spmd_rules.einsum import labels_result
from spmd_rules.registry import register_spmd_rule
from spmd_rules.utils import check_spec

_MODES = ("constant", "reflect", "replicate", "circular")


def _spatial(op, ndim, data_format):
    if ndim not in (3, 4, 5):
        raise ValueError(f"{op}: a non-constant pad or one of 2*(ndim-2) numbers needs a 3-, 4- or 5-D input, "
                         f"got {ndim}-D")
    fmt = (data_format or ("NCL", "NCHW", "NCDHW")[ndim - 3]).upper()
    if len(fmt) != ndim or fmt[:2] not in ("NC", "NL", "NH", "ND") or fmt[0] != "N":
        raise ValueError(f"{op}: data_format {data_format!r} does not fit a {ndim}-D input")
    return list(range(2, ndim)) if fmt[1] == "C" else list(range(1, ndim - 1))


def pad_widths(op, ndim, pad, mode="constant", data_format=None, pad_from_left_axis=True) -> list:
    """(before, after) for every dim of a ``ndim``-D input, as paddle's ``pad`` applies ``pad``."""
    if mode not in _MODES:
        raise ValueError(f"{op}: mode must be one of {_MODES}, got {mode!r}")
    if not isinstance(pad, (list, tuple)) or not all(isinstance(p, int) and not isinstance(p, bool) for p in pad):
        raise NotImplementedError(f"{op}: pad must be a list of ints on distributed tensors (a tensor's values "
                                  f"decide the output shape), got {type(pad).__name__}")
    if len(pad) % 2 or len(pad) > 2 * ndim:
        raise ValueError(f"{op}: pad must hold an even number of at most {2 * ndim} ints, got {list(pad)}")
    widths = [(0, 0)] * ndim
    pairs = [(pad[i], pad[i + 1]) for i in range(0, len(pad), 2)]
    if mode == "constant" and len(pad) != 2 * (ndim - 2):
        if len(pad) == 2 * ndim and pad_from_left_axis:
            return pairs
        for k, pr in enumerate(pairs):
            widths[ndim - 1 - k] = pr
        return widths
    dims = _spatial(op, ndim, data_format)
    if len(pairs) != len(dims):
        raise ValueError(f"{op}: mode {mode!r} pads the {len(dims)} spatial dims: expects {2 * len(dims)} ints, "
                         f"got {list(pad)}")
    for d, pr in zip(reversed(dims), pairs):
        widths[d] = pr
    return widths


@register_spmd_rule("pad")
def pad(x, pad, mode="constant", value=0.0, data_format=None, pad_from_left_axis=True, name=None):
    check_spec("pad", "x", x)
    widths = pad_widths("pad", x.ndim, pad, mode, data_format, pad_from_left_axis)
    labels = tuple(None if w != (0, 0) else d for d, w in enumerate(widths))
    shape = tuple(n + a + b for n, (a, b) in zip(x.shape, widths))
    linear = "multi" if mode != "constant" or value == 0 else None
    return labels_result("pad", [x], [labels], [labels], [(shape, x.dtype)], linear=linear)
