"""Negative controls: deliberate mistakes a test makes to show its comparison with one process can fail."""
from __future__ import annotations

import contextlib
from unittest import mock


@contextlib.contextmanager
def no_gradient_reduction():
    """Data-parallel partial gradients are never reduced: neither by the optimizer's step
    (``reduce_gradients``) nor by the backward hooks the first backward installs (``before_backward``)."""
    from autoparallel.parallel.grads import GradientSync
    from autoparallel.parallel.optimizer import ShardedOptimizer

    with mock.patch.object(ShardedOptimizer, "reduce_gradients", lambda self: 0), \
            mock.patch.object(GradientSync, "before_backward", lambda self, tensors=(): False):
        yield
