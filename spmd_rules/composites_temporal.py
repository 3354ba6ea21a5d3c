"""Composite op (see composites.py): ``F.temporal_shift`` (TSM video models), written with routed slices and
concats: over ``x`` viewed as [N, T, C, H, W], the first ``C·shift_ratio`` channels take the previous frame's
values (zeros at t = 0), the next ``C·shift_ratio`` the following frame's (zeros at the last t), the rest stay."""
from __future__ import annotations

from spmd_rules.composites import _p, gshape


def temporal_shift(x, seg_num, shift_ratio=0.25, name=None, data_format="NCHW"):
    paddle = _p()
    shape = gshape(x)
    if data_format not in ("NCHW", "NHWC"):
        raise ValueError(f"temporal_shift: data_format must be 'NCHW' or 'NHWC', got {data_format!r}")
    if len(shape) != 4:
        raise ValueError(f"temporal_shift: x must be 4-D [N*T, C, H, W] (or NHWC), got shape {shape}")
    if not isinstance(seg_num, int) or seg_num <= 0 or shape[0] % seg_num:
        raise ValueError(f"temporal_shift: seg_num must be a positive int dividing dim 0 ({shape[0]}), got {seg_num!r}")
    if not 0 < shift_ratio < 0.5:
        raise ValueError(f"temporal_shift: shift_ratio must be in (0, 0.5) (paddle's range), got {shift_ratio}")
    if data_format == "NHWC":
        x = x.transpose([0, 3, 1, 2])
    nt, c, h, w = gshape(x)
    n = nt // seg_num
    v = x.reshape([n, seg_num, c, h, w])
    c1, c2 = int(c * shift_ratio), int(c * 2 * shift_ratio)
    dtype = str(x.dtype).replace("paddle.", "")
    parts = []
    if c1:
        parts.append(paddle.concat([paddle.zeros([n, 1, c1, h, w], dtype=dtype), v[:, :-1, :c1]], axis=1))
    if c2 > c1:
        parts.append(paddle.concat([v[:, 1:, c1:c2], paddle.zeros([n, 1, c2 - c1, h, w], dtype=dtype)], axis=1))
    parts.append(v[:, :, c2:])
    out = (paddle.concat(parts, axis=2) if len(parts) > 1 else parts[0]).reshape([nt, c, h, w])
    return out.transpose([0, 2, 3, 1]) if data_format == "NHWC" else out


COMPOSITES: dict = {"paddle.nn.functional.temporal_shift": temporal_shift}
