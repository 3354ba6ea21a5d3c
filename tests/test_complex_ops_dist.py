"""Complex tensors on 2 real gloo ranks (job ``complex`` of the shared 2-rank launch,
dist_scripts/complex_worker.py): gloo refuses complex data ("Unknown DataType"), so every collective carries the
real view; gathers, a Partial sum, an all-to-all reshard and a complex rotary embedding (forward and backward)
equal one process."""
import os

import numpy as np
import paddle
import pytest

from dist_scripts import shared_launch

HERE = os.path.join(os.path.dirname(__file__), "dist_scripts")
JOB = shared_launch.job(__name__, "complex", os.path.join(HERE, "complex_worker.py"), 2, timeout=200)


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


def test_complex_collectives_and_rope_equal_one_process(ranks):
    from complex_worker import A, W, X
    from test_complex_ops import rope

    x = paddle.to_tensor(X, stop_gradient=False)
    y = rope(x)
    (y * paddle.to_tensor(W)).sum().backward()
    for r in ranks:
        for name in ("S0", "P", "S2"):
            assert np.allclose(r[f"as_complex {name}"], A), name
        assert r["reshard S0->S1"]["placements"] == "[S(1)]"
        assert np.allclose(r["reshard S0->S1"]["value"], A)
        for name in ("heads", "seq", "P"):
            assert np.allclose(r[f"rope {name}"]["value"], y.numpy(), rtol=1e-5, atol=1e-6), name
            assert np.allclose(r[f"rope {name}"]["grad"], x.grad.numpy(), rtol=1e-5, atol=1e-6), name
