"""Sample calls of the ops vision-language models added (spmd_rules/multimodal.py, search.py)."""
from __future__ import annotations

import numpy as np

from .case import T, add_case, f


def cases_multimodal():
    mask = np.zeros((4, 3), bool)
    mask[0, :] = mask[2, 1:] = True                       # 3 + 0 + 2 + 0 positions: uneven over the rows
    add_case("masked_scatter", f(4, 3), T(mask), f(6, 1))
    add_case("masked_scatter", f(4, 3), T(mask[:, :1].copy()), f(6), label="broadcast-mask")
    add_case("argwhere", T(np.array([[0.0, 1.5, 0.0], [2.0, 0.0, -1.0]])), grad=False)
    seq = T(np.array([0.0, 0.5, 1.5, 2.5]), grad=False)
    add_case("searchsorted", seq, f(3, 4), grad=False)
    add_case("searchsorted", seq, f(3, 4), right=True, out_int32=True, grad=False, label="right-int32")
    add_case("bucketize", f(3, 4), seq, grad=False)
