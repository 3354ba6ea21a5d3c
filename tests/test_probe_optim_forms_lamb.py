"""Lamb over tensor-parallel shards and ZeRO chunks: the whole parameter's trust ratio (parallel/lamb_whole.py).
Losses, learning rates and every parameter after 3 steps equal one process (simulated world), for the forms of
Lamb's weight decay (decayed, none, none with always_adapt, a name-based exclusion) with parameter groups and a
schedule; each piece's own ratio (the negative controls) differs."""
import paddle
import pytest

import autoparallel as ap
from loops2_helpers import RUNS
from test_probe_optim_forms_groups import both, train

LR = paddle.optimizer.lr


def lamb(**kw):
    def make(m):
        names = {m.fc1.bias.name, m.fc2.bias.name}
        if kw.pop("exclude", False):
            kw["exclude_from_weight_decay_fn"] = lambda p: p.name in names
        return paddle.optimizer.Lamb(LR.StepDecay(0.05, 1, 0.7), parameters=[
            {"params": [m.fc1.weight, m.fc1.bias], "learning_rate": 2.0}, {"params": [m.fc2.weight, m.fc2.bias]}],
            **kw)
    return make


FORMS = {"decayed": {"lamb_weight_decay": 0.1}, "no decay": {"lamb_weight_decay": 0.0},
         "no decay, always_adapt": {"lamb_weight_decay": 0.0, "always_adapt": True},
         "bias excluded": {"lamb_weight_decay": 0.1, "exclude": True}}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("run", ["dp x tp", "parallelize tp", "zero2", "parallelize zero3"])
def test_lamb_over_shards_and_chunks_equals_one_process(form, run):
    both(run, lambda env: train(env, lamb(**FORMS[form]), after=lambda o, s: o._learning_rate.step()))


def test_shard_ratios_differ():
    """Negative control: without the whole-parameter correction each shard's own ratio gives other values."""
    from autoparallel.parallel.optimizer import ShardedOptimizer

    fix = ShardedOptimizer._check_whole_tensor_update
    ShardedOptimizer._check_whole_tensor_update = lambda self: None
    try:
        with pytest.raises(AssertionError):
            both("dp x tp", lambda env: train(env, lamb(**FORMS["decayed"])))
    finally:
        ShardedOptimizer._check_whole_tensor_update = fix


def test_chunk_ratios_differ(monkeypatch):
    """Negative control under ZeRO: each chunk's own ratio (the correction off) gives other values."""
    monkeypatch.setattr("autoparallel.parallel.lamb_whole.ZeroLamb.apply", lambda self: None)
    with pytest.raises(AssertionError):
        both("parallelize zero3", lambda env: train(env, lamb(**FORMS["decayed"])))


def test_lamb_multi_precision_over_shards_is_refused():
    with ap.simulate(world_size=4), pytest.raises(NotImplementedError, match="multi_precision"):
        train(RUNS["dp x tp"](), lambda m: paddle.optimizer.Lamb(0.05, parameters=m.parameters(), multi_precision=True))
