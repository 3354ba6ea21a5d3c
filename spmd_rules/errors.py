"""Typed errors rules raise for calls they cannot lay out."""
from __future__ import annotations


class DataDependentShapeError(NotImplementedError):
    """An op whose output size depends on the values (``nonzero``, ``masked_select``, one-argument
    ``where``...) received an input sharded on a dim the output size depends on. Such an op runs only on
    inputs replicated on those dims: its output is then the same on every rank (replicated)."""
