"""paddle's ``dist.to_distributed(model, optimizer, dataloader, device_num, node_num, config)`` as its documentation
writes the loop (``for i, data in enumerate(dist_loader())``), in the simulated 4-rank world: the planner chooses,
losses and parameters equal one process; ``config.sequence_parallel`` is kept; a pipelined choice gets plain
batches; bad counts, configs and loaders are refused before any work."""
import os

import numpy as np
import pytest

from autoparallel.testing import paddleformers_models as pf
from dist_scripts import shared_launch

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

import paddle  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel.testing.datasets import token_pair_loader  # noqa: E402

B, T, RTOL, ATOL = 4, 16, 1e-4, 1e-5
JOB = shared_launch.job(__name__, "to_distributed", os.path.join(os.path.dirname(__file__), "dist_scripts",
                                                                 "to_distributed_worker.py"), 2, timeout=200)


def loader():
    return token_pair_loader(pf.VOCAB, B, T)


def train(model, opt, dist_loader):
    """paddle's documented loop: ``for i, data in enumerate(dist_loader())``."""
    losses = []
    for _, data in enumerate(dist_loader()):
        inputs, labels = data
        loss = pf.loss_of(model(input_ids=inputs, labels=labels))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: (p.full().numpy() if hasattr(p, "full") else p.numpy()) for n, p in model.named_parameters()}


def build(**kw):
    model = pf.build("llama", fill_zeros=True, **kw)
    return model, paddle.optimizer.AdamW(1e-3, parameters=model.parameters())


def assert_same(got, ref):
    assert len(got[0]) == len(ref[0]) == 2
    np.testing.assert_allclose(got[0], ref[0], rtol=RTOL, atol=ATOL)
    for n, p in ref[1].items():
        np.testing.assert_allclose(got[1][n], p, rtol=RTOL, atol=ATOL, err_msg=n)


@pytest.fixture(scope="module")
def reference():
    return train(*build(), loader())


@pytest.mark.parametrize("sp", [False, True])
def test_documented_loop_equals_one_process(reference, sp):
    with ap.simulate(world_size=4):
        cfg = ap.ToDistributedConfig()
        cfg.sequence_parallel = sp
        cfg.input_spec = [paddle.static.InputSpec([B, T], "int64", "input_ids")]
        model, opt, dist_loader = ap.to_distributed(*build(), loader(), device_num=4, node_num=1, config=cfg)
        chosen, mesh = ap.chosen_strategy(model), ap.mesh_of(model)
        assert chosen.global_batch_size == B
        if sp:
            assert chosen.sequence_parallel.enable and chosen.tensor_parallel.degree > 1
        assert isinstance(dist_loader, ap.ShardDataloader) and len(dist_loader) == 2
        inputs = next(iter(dist_loader))[0]
        data = mesh.dim_names.index("data")
        want = ap.Shard(0) if mesh.shape[data] > 1 else ap.Replicate()
        assert inputs.placements[data] == want, (mesh, inputs.placements)     # each data rank gets its part
        assert_same(train(model, opt, dist_loader), reference)


def test_paddles_own_config_object_is_read():
    from paddle.distributed.auto_parallel.high_level_api import ToDistributedConfig

    cfg = ToDistributedConfig()
    cfg.sequence_parallel = True
    with ap.simulate(world_size=4):
        model, _, _ = ap.to_distributed(*build(), loader(), device_num=2, node_num=2, config=cfg)
        assert ap.chosen_strategy(model).sequence_parallel.enable


def test_a_pipelined_choice_gets_plain_batches(monkeypatch):
    """When the plan pipelines the model (which takes the same plain batch on every rank), the loader yields the
    user's batches as they are; forced here by fixing the degrees the planner would otherwise choose."""
    import importlib

    par = importlib.import_module("autoparallel.parallelize")        # the module (ap.parallelize is the function)
    plain = par.parallelize

    def pipelined(model, optimizer, strategy, seq_len=None):
        s = ap.Strategy()
        s.data_parallel.degree, s.pipeline_parallel.degree = 2, 2
        return plain(model, optimizer, strategy=s)

    ref = train(*build(tie_word_embeddings=False), loader())
    monkeypatch.setattr(par, "parallelize", pipelined)
    with ap.simulate(world_size=4):
        model, opt, dist_loader = ap.to_distributed(*build(tie_word_embeddings=False), loader(), device_num=4)
        assert ap.mesh_of(model) is None and len(dist_loader) == 2
        batch = next(iter(dist_loader))
        assert all(type(t) is paddle.Tensor for t in batch)
        assert_same(train(model, opt, dist_loader), ref)


class NoBatchSize:
    def __iter__(self):
        return iter([])


@pytest.mark.parametrize("kwargs,exc,words", [
    ({"device_num": 8}, ValueError, r"device_num x node_num = 8 must be the world running it, got a world of 4"),
    ({"device_num": 2, "node_num": 1}, ValueError, r"= 2 must be the world"),
    ({"device_num": "4"}, TypeError, r"device_num must be a positive int, got '4'"),
    ({"device_num": 4, "node_num": 0}, TypeError, r"node_num must be a positive int, got 0"),
    ({"device_num": np.int64(4), "config": 3}, TypeError, r"config must be a ToDistributedConfig.*got int"),
    ({"device_num": 4, "config": "spec"}, TypeError, r"config must be a ToDistributedConfig"),
    ({"device_num": 4, "loader": NoBatchSize()}, ValueError, r"dataloader must have a batch size.*NoBatchSize"),
])
def test_bad_input_is_refused_before_any_work(kwargs, exc, words):
    with ap.simulate(world_size=4):
        model, opt = build()
        data = kwargs.pop("loader", None) or loader()
        with pytest.raises(exc, match=words):
            ap.to_distributed(model, opt, data, **kwargs)
        assert ap.mesh_of(model) is None and not any(ap.is_dist(p) for p in model.parameters())


@pytest.mark.parametrize("field,value,exc,words", [
    ("sequence_parallel", "yes", TypeError, r"sequence_parallel must be True or False, got 'yes'"),
    ("input_spec", [paddle.static.InputSpec([B], "int64")], ValueError, r"second dim.*got shape \[4\]"),
    ("input_spec", [paddle.static.InputSpec([B, -1], "int64")], ValueError, r"known sequence length"),
])
def test_bad_config_is_refused(field, value, exc, words):
    cfg = ap.ToDistributedConfig()
    setattr(cfg, field, value)
    with ap.simulate(world_size=4), pytest.raises(exc, match=words):
        ap.to_distributed(*build(), loader(), device_num=4, config=cfg)


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


def test_real_ranks_run_the_documented_loop_as_one_process(ranks, reference):
    for r in ranks:
        got = r["documented_loop"]
        assert isinstance(got, dict), got
        assert_same((got["losses"], {n: np.array(p, "float32") for n, p in got["params"].items()}), reference)


def test_real_ranks_refuse_plain_batches_that_differ(ranks):
    for r in ranks:
        assert r["plain_batches_that_differ"].startswith("ValueError"), r["plain_batches_that_differ"]
        assert "same global batch on every rank" in r["plain_batches_that_differ"]
