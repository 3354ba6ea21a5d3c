"""A layer whose forward branches on ``isinstance(v, paddle.Tensor)`` gets a RuntimeWarning when the model is laid
out: a distributed tensor is not a paddle.Tensor, so the branch silently takes its non-tensor path (here: the mask
is skipped and the output differs from one process). ``paddle.is_tensor`` holds for both."""
import warnings

import numpy as np
import paddle
import paddle.nn as nn
import pytest

import autoparallel as ap
from autoparallel import isinstance_lint

pytestmark = pytest.mark.sim


class Masked(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask=None):
        if isinstance(mask, (paddle.Tensor, np.ndarray)):
            x = x * mask
        return self.fc(x)


class MaskedIsTensor(Masked):
    def forward(self, x, mask=None):
        if paddle.is_tensor(mask):
            x = x * mask
        return self.fc(x)


def _laid_out(cls):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paddle.seed(0)
        with ap.simulate(world_size=2):
            mesh = ap.ProcessMesh([0, 1], dim_names=["dp"])
            net = ap.shard_layer(cls(), mesh)
            x = ap.shard_tensor(paddle.ones([4, 4]), mesh, [ap.Shard(0)])
            mask = ap.shard_tensor(paddle.zeros([4, 4]), mesh, [ap.Shard(0)])
            out = net(x, mask).numpy()
    return out, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "isinstance" in
                 str(w.message)]


def test_an_isinstance_branch_is_named_and_is_tensor_is_not():
    isinstance_lint._SEEN.discard(Masked)
    paddle.seed(0)
    want = Masked()(paddle.ones([4, 4]), paddle.zeros([4, 4])).numpy()
    out, said = _laid_out(Masked)
    assert not np.allclose(out, want)                  # the hazard the warning names: the mask was skipped
    line = Masked.forward.__code__.co_firstlineno + 1
    assert len(said) == 1 and said[0].startswith("Masked.forward (") and f"line {line})" in said[0] \
        and "paddle.is_tensor(x)" in said[0], said
    _, again = _laid_out(Masked)
    assert again == []                                 # once per class
    out, said = _laid_out(MaskedIsTensor)
    assert said == [] and np.allclose(out, want)


def test_the_scan_reads_calls_not_text():
    def f(x):
        name = "isinstance(x, paddle.Tensor)"          # a string, not a call
        return isinstance(x, (int, paddle.Tensor)), isinstance(x, Tensor), isinstance(x, float), name  # noqa: F821

    lines = isinstance_lint.tensor_tests(f)
    first = f.__code__.co_firstlineno
    assert lines == [first + 2, first + 2]
