"""Lazy initialisation reproduces an eager build only when the generator's stream is untouched between the
first lazily created parameter and materialisation; when it is not, the values differ and a warning says why."""
import warnings

import numpy as np
import paddle
import pytest

from autoparallel.lazy_init import LazyInitStreamWarning, materialize


class DrawsInInit(paddle.nn.Layer):
    """Like a model whose __init__ draws random numbers itself (e.g. a random buffer) between its layers."""

    def __init__(self, draw: bool):
        super().__init__()
        self.a = paddle.nn.Linear(4, 4)
        if draw:
            self.register_buffer("noise", paddle.randn([4]))
        self.b = paddle.nn.Linear(4, 4)


def _eager(draw, seed=3):
    paddle.seed(seed)
    return DrawsInInit(draw)


def _lazy(draw, seed=3):
    paddle.seed(seed)
    with paddle.LazyGuard():
        return DrawsInInit(draw)


def _equal(m1, m2) -> bool:
    return all(np.array_equal(p.numpy(), q.numpy()) for p, q in zip(m1.parameters(), m2.parameters()))


def _materialize(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = materialize(model)
    return report, [w for w in caught if issubclass(w.category, LazyInitStreamWarning)]


def test_untouched_stream_equals_eager_and_says_nothing():
    report, caught = _materialize(_lazy(False))
    assert report.stream_mismatch is None and not caught
    assert _equal(_eager(False), _lazy_done(False))


def _lazy_done(draw):
    m = _lazy(draw)
    _materialize(m)
    return m


def test_a_draw_inside_init_is_reported_and_values_really_differ():
    report, caught = _materialize(_lazy(True))
    assert "between the creations" in report.stream_mismatch
    assert len(caught) == 1 and "will not equal an eager build" in str(caught[0].message)
    assert not _equal(_eager(True), _lazy_done(True))       # the warning is about a real difference


def test_a_draw_between_build_and_materialise_is_reported():
    m = _lazy(False)
    paddle.randn([2])
    report, caught = _materialize(m)
    assert "after the model was built" in report.stream_mismatch and caught
    assert not _equal(_eager(False), m)


@pytest.mark.parametrize("draw_before_build", [False, True])
def test_two_models_built_then_materialised_in_order_equal_eager(draw_before_build):
    paddle.seed(5)
    if draw_before_build:
        paddle.randn([3])                               # eager draws it at the same point: no difference
    e1, e2 = DrawsInInit(False), DrawsInInit(False)
    paddle.seed(5)
    if draw_before_build:
        paddle.randn([3])
    with paddle.LazyGuard():
        l1, l2 = DrawsInInit(False), DrawsInInit(False)
    r1, c1 = _materialize(l1)
    r2, c2 = _materialize(l2)
    assert r1.stream_mismatch is None and r2.stream_mismatch is None and not c1 and not c2
    assert _equal(e1, l1) and _equal(e2, l2)


def test_per_parameter_initialize_in_creation_order_says_nothing():
    m = _lazy(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LazyInitStreamWarning)
        for p in m.parameters():
            p.initialize()
    assert _equal(_eager(False), m)
