"""A model that calls its blocks by keyword (PaddleFormers Phi3: ``decoder_layer(hidden_states=h, ...)``) split into
pipeline stages under ``Strategy.recompute``: the recompute region installed over each block's forward takes
``(*args, **kwargs)``, and the stage cut looked the hidden state up under the wrapper's first parameter name
("args", a KeyError on every rank). The name is now read through to the block class's forward. PP2 x DP2 in the
simulated world, two SGD steps equal to one process."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.parallel.pipeline import auto_split
from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="PaddleFormers is not installed")
STEPS, LR = 2, 0.5


def _reference(family):
    model = pf.build(family, num_hidden_layers=4, tie_word_embeddings=False)
    opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = pf.batch(step, b=4, t=8)
        loss = F.cross_entropy(auto_split.model_output(model(paddle.to_tensor(x))), paddle.to_tensor(y))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def _pipelined(family, granularity):
    s = ap.Strategy()
    s.pipeline_parallel.degree, s.data_parallel.degree = 2, 2
    s.recompute.enable, s.recompute.granularity = True, granularity
    with ap.simulate(world_size=4):
        model = pf.build(family, num_hidden_layers=4, tie_word_embeddings=False)
        pipe, opt = ap.parallelize(model, paddle.optimizer.SGD(LR, parameters=model.parameters()), strategy=s)
        losses = []
        for step in range(STEPS):
            losses.append(pipe.train_batch(*pf.batch(step, b=4, t=8)))
            opt.step()
            opt.clear_grad()
    return losses


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_blocks_called_by_keyword_under_recompute_equal_one_process(granularity):
    np.testing.assert_allclose(_pipelined("phi3", granularity), _reference("phi3"), rtol=1e-5, atol=1e-6)


def test_hidden_name_reads_through_an_args_kwargs_wrapper():
    class Block(paddle.nn.Layer):
        def forward(self, hidden_states, attention_mask=None):
            return hidden_states

    b = Block()
    b.forward = lambda *args, **kwargs: Block.forward(b, *args, **kwargs)
    assert auto_split._hidden_name(b.forward, b) == "hidden_states"
    assert auto_split._hidden_name(b.forward) is None
    assert auto_split._hidden_name(Block().forward) == "hidden_states"
