"""Sample calls of paddle's bitwise ops (``&``, ``|``, ``~`` on integers bit by bit, on bools as logic)."""
from __future__ import annotations

from .case import T, add_case, ints
from .local_arrays import _rng


def cases_bitwise():
    add_case("bitwise_and", ints(16, 5, 6), ints(16, 6))
    add_case("bitwise_or", ints(16, 5, 6), ints(16, 5, 6))
    add_case("bitwise_not", ints(16, 5, 6))
    add_case("bitwise_and", T(_rng("b", 4).random((5, 6)) > 0.5), T(_rng("b", 5).random((6,)) > 0.5), label="bool")
