"""4 real gloo ranks: the training examples with --static under ZeRO-2 equal eager mode."""
import os

import numpy as np
import pytest

from autoparallel.testing.launch import launch

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def results():
    return launch(os.path.join(HERE, "dist_scripts", "static_zero_worker.py"), nproc=4, timeout=400)


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_static_zero2_losses_and_parameters_equal_eager(results, model):
    for rank_result in results:
        (eager_loss, eager_params), (static_loss, static_params) = (rank_result[model]["eager"],
                                                                    rank_result[model]["static"])
        assert np.allclose(static_loss, eager_loss, rtol=1e-5, atol=1e-6)
        assert eager_params.keys() == static_params.keys()
        for name in eager_params:
            assert np.allclose(static_params[name], eager_params[name], rtol=1e-5, atol=1e-6), name
        # the run really trained: the loss moved
        assert abs(eager_loss[-1] - eager_loss[0]) > 1e-3
