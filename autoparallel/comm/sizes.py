"""Element and byte counts of a paddle tensor from its shape, without a device round trip.

``int(t.numel())`` builds a 0-d tensor and converts it through numpy: ~120 µs per call on a busy CPU rank
(``t.numel() == 0`` as a condition ~60 µs), against ~0.3 µs for the product of the python shape.
"""
from __future__ import annotations

import math


def numel(t) -> int:
    return math.prod(t.shape)


def nbytes(t) -> int:
    return math.prod(t.shape) * t.element_size()
