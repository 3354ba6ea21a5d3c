"""Data-parallel gradient reduction launched from backward hooks (parallel/reducer.py), in the simulated
world: buckets have the hand-computed composition and launch during backward in backward order; the
reduced gradients equal the single-process gradients of the global batch; non-final accumulation
micro-steps launch nothing; parameters without a gradient, extra backward passes and a parameter used
twice stay correct; ZeRO 1/2/3 reduce (reduce-scatter) from the hooks too."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

from autoparallel import layer_state
import autoparallel as ap
from autoparallel.local_mode import local_mode
from autoparallel.parallel import grads as G
from autoparallel.parallel.sharding import apply_zero
from autoparallel.parallelize import parallelize

N, D_IN, D_H, D_OUT = 8, 8, 16, 4
# parameter bytes (float32): fc1.weight 512, fc1.bias 64, fc2.weight 1024, fc2.bias 64, fc3.weight 256,
# fc3.bias 16. Backward order is the reverse; a 1100-byte limit closes a bucket before fc2.weight (336 + 1024)
# and before fc1.weight (1088 + 512):
BUCKET_BYTES = 1100
SPLIT = [["fc3.bias", "fc3.weight", "fc2.bias"], ["fc2.weight", "fc1.bias"], ["fc1.weight"]]


class MLP(nn.Layer):
    def __init__(self, tied=False):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(D_IN, D_H), nn.Linear(D_H, D_H), nn.Linear(D_H, D_OUT)
        self.tied, self.skip_fc2 = tied, False

    def forward(self, x):
        h = F.relu(self.fc1(x))
        if not self.skip_fc2:
            h = F.relu(self.fc2(h))
            if self.tied:                       # fc2 used twice: autograd sums both uses before accumulating
                h = F.relu(self.fc2(h))
        return self.fc3(h)


def data(seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((N, D_IN)).astype("float32"), rng.integers(0, D_OUT, (N,))


def loss_of(m, seed):
    x, y = data(seed)
    return F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y))


def reference(seeds, tied=False, skip=()):
    """Single-process gradients accumulated over the batches ``seeds``."""
    paddle.seed(0)
    m = MLP(tied)
    for s in seeds:
        m.skip_fc2 = s in skip
        loss_of(m, s).backward()
    return {n: p.grad.numpy() if p.grad is not None else np.zeros(p.shape, "float32")
            for n, p in m.named_parameters()}


def dp_model(dp=4, ga=1, tied=False, **opt_kw):
    paddle.seed(0)
    m = MLP(tied)
    s = ap.Strategy()
    s.data_parallel.degree, s.gradient_accumulation_steps = dp, ga
    m, opt = parallelize(m, paddle.optimizer.SGD(0.0, parameters=m.parameters()), strategy=s)
    opt.bucket_bytes = BUCKET_BYTES
    for k, v in opt_kw.items():
        setattr(opt.grad_sync, k, v)
    return m, opt


def full_grads(m):
    return {n: p.as_dist().grad.full().numpy() for n, p in m.named_parameters()}


def assert_grads(m, ref):
    got = full_grads(m)
    for n, g in ref.items():
        np.testing.assert_allclose(got[n], g, rtol=1e-5, atol=1e-6, err_msg=n)


def names(m, params):
    by_id = {id(p): n for n, p in m.named_parameters()}
    return [by_id[id(p)] for p in params]


def warm_up(m, opt, seeds=(100,)):
    """The first window: reduced at step time; it fixes the buckets and installs the hooks."""
    for s in seeds:
        loss_of(m, s).backward()
    opt.reduce_gradients()
    opt.clear_grad()


# ---- buckets, order, values ----------------------------------------------------------------------------------
def test_buckets_launch_in_backward_order_during_backward():
    with ap.simulate(world_size=4):
        m, opt = dp_model()
        events = []
        for n, p in m.named_parameters():              # record when each gradient is complete (rank 0)
            p._register_backward_hook(lambda n=n: events.append(("grad", n)))
        launch = G.reduce_bucket

        def recording(bucket, async_op=False):
            events.append(("launch", names(m, bucket.params)))
            return launch(bucket, async_op)

        G.reduce_bucket = recording
        try:
            warm_up(m, opt)
            assert [names(m, b.params) for b in opt.grad_sync.buckets] == SPLIT
            events.clear()
            loss_of(m, 0).backward()
            in_backward = list(opt.grad_sync.reducer.launches)      # before backward() returned: the flag
            launched_at_step = opt.reduce_gradients()
        finally:
            G.reduce_bucket = launch
        assert in_backward == [(0, "backward"), (1, "backward"), (2, "backward")] and launched_at_step == 0
        order = [e[1] for e in events if e[0] == "grad"]
        assert sorted(order) == sorted(n for b in SPLIT for n in b)
        # each bucket launches right after its last gradient, before backward computes the next ones
        for i, bucket in enumerate(SPLIT):
            last = max(events.index(("grad", n)) for n in bucket)
            assert events[last + 1] == ("launch", bucket), events
        assert [e[1] for e in events if e[0] == "launch"] == SPLIT
        assert_grads(m, reference([0]))


def test_step_time_reduction_gives_the_same_values_and_buckets():
    ref = reference([0])
    with ap.simulate(world_size=4):
        m, opt = dp_model(overlap=False)
        warm_up(m, opt)
        loss_of(m, 0).backward()
        assert opt.grad_sync.reducer is None and opt.reduce_gradients() == 3
        assert_grads(m, ref)
        assert [names(m, b.params) for b in G.plan_buckets(list(m.parameters()), BUCKET_BYTES)] == SPLIT


def test_dp2_tp2_mesh_reduces_over_the_data_dim_only():
    with ap.simulate(world_size=4):
        paddle.seed(0)
        m = MLP()
        s = ap.Strategy()
        s.data_parallel.degree, s.tensor_parallel.degree = 2, 2
        m, opt = parallelize(m, paddle.optimizer.SGD(0.0, parameters=m.parameters()), strategy=s,
                             tp_plan={"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()})
        warm_up(m, opt)
        loss_of(m, 0).backward()
        assert [l[1] for l in opt.grad_sync.reducer.launches] == ["backward"] * len(opt.grad_sync.buckets)
        assert all(b.dims == (0,) for b in opt.grad_sync.buckets)
        opt.reduce_gradients()
        assert_grads(m, reference([0]))


# ---- gradient accumulation -------------------------------------------------------------------------------------
def test_no_launch_on_non_final_micro_steps():
    with ap.simulate(world_size=4):
        m, opt = dp_model(ga=2)
        warm_up(m, opt, seeds=(100, 101))
        reducer = opt.grad_sync.reducer
        loss_of(m, 0).backward()
        assert reducer.launches == []                       # micro-step 1 of 2: nothing
        loss_of(m, 1).backward()
        assert reducer.launches == [(0, "backward"), (1, "backward"), (2, "backward")]
        assert opt.reduce_gradients() == 0
        assert_grads(m, reference([0, 1]))                  # summed; the step divides by 2
        opt._scale_gradients()
        assert_grads(m, {n: g / 2 for n, g in reference([0, 1]).items()})


def test_unused_parameter_bucket_waits_for_the_step():
    """fc2 gets no gradient: its buckets (and, launching in order, the ones after them) reduce at the step."""
    with ap.simulate(world_size=4):
        m, opt = dp_model()
        warm_up(m, opt)
        m.skip_fc2 = True
        loss_of(m, 0).backward()
        assert opt.grad_sync.reducer.launches == []         # bucket 0 holds fc2.bias: it never completes
        assert opt.reduce_gradients() == 3
        assert_grads(m, reference([0], skip={0}))


def test_more_backward_passes_than_expected_stay_correct():
    """Two backward passes with gradient_accumulation_steps=1: the second arrives after the reduction; the
    reduced value is set aside and the rest reduced at the step. The Reducer then expects two."""
    with ap.simulate(world_size=4):
        m, opt = dp_model()
        warm_up(m, opt)
        reducer = opt.grad_sync.reducer
        loss_of(m, 0).backward()
        loss_of(m, 1).backward()
        assert [l[1] for l in reducer.launches] == ["backward"] * 3
        assert opt.reduce_gradients() == 1                  # one re-reduction of the set-aside parameters
        assert_grads(m, reference([0, 1]))
        assert set(reducer.expected.values()) == {2}
        opt.clear_grad()
        loss_of(m, 2).backward()
        assert reducer.launches == []
        loss_of(m, 3).backward()
        assert len(reducer.launches) == 3
        assert_grads(m, reference([2, 3]))


def test_late_gradients_take_in_place_changes_before_the_step():
    """A re-reduced parameter holds partial sums until the step: scaling every local gradient in between
    (AMP unscaling, the pipeline's cross-stage sum) scales its whole gradient, reduced part included."""
    with ap.simulate(world_size=4):
        m, opt = dp_model()
        warm_up(m, opt)
        loss_of(m, 0).backward()
        loss_of(m, 1).backward()
        with local_mode(), paddle.no_grad():
            for p in m.parameters():
                for t in p.locals.values():
                    t.grad.set_value(t.grad * 0.5)
        opt.reduce_gradients()
        assert_grads(m, {n: g * 0.5 for n, g in reference([0, 1]).items()})


def test_second_flush_reduces_nothing():
    with ap.simulate(world_size=4):
        m, opt = dp_model()
        loss_of(m, 0).backward()
        assert opt.reduce_gradients() == 0 and opt.reduce_gradients() == 0      # the first backward did it all
        opt.clear_grad()
        loss_of(m, 0).backward()
        assert opt.reduce_gradients() == 0 and opt.reduce_gradients() == 0      # hooks did it all
        assert_grads(m, reference([0]))


def test_parameter_used_twice_counts_once_per_backward():
    with ap.simulate(world_size=4):
        m, opt = dp_model(tied=True)
        warm_up(m, opt)
        loss_of(m, 0).backward()
        assert opt.grad_sync.reducer._counts[(id(m.fc2.weight), 0)] == 1
        assert [l[1] for l in opt.grad_sync.reducer.launches] == ["backward"] * 3
        assert_grads(m, reference([0], tied=True))


def test_bad_bucket_size():
    with ap.simulate(world_size=4):
        m, opt = dp_model()
        with pytest.raises(ValueError, match="bucket_bytes must be a positive int, got 0"):
            opt.bucket_bytes = 0


# ---- ZeRO -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_reduces_from_hooks_like_at_the_step(stage):
    ref = reference([0])
    with ap.simulate(world_size=4):
        got = {}
        for overlap in (True, False):
            m, opt = dp_model()
            zopt = apply_zero(m, opt, layer_state.mesh_of(m), stage, bucket_bytes=BUCKET_BYTES, overlap=overlap)
            loss_of(m, 100).backward()
            zopt.reduce_gradients()
            zopt.clear_grad()
            loss_of(m, 0).backward()
            if overlap:
                r = zopt.reducer
                assert [names(m, b) for b in r.buckets] == [names(m, b) for b in reversed(zopt.buckets)]
                assert [l[1] for l in r.launches] == ["backward"] * len(zopt.buckets)
                if stage > 1:                           # reduce-scattered: the full gradients are freed
                    assert all(t.grad is None for p in m.parameters() for t in p.locals.values() if t is not p)
                    with pytest.raises(NotImplementedError, match="chunks"):   # p.grad: a typed error
                        m.fc1.weight.grad
            chunks = zopt.reduce_gradients()
            got[overlap] = {n: np.concatenate([chunks[r][id(p)].numpy() for r in range(4)])
                            for n, p in m.named_parameters()}
        for n, g in ref.items():
            np.testing.assert_allclose(got[True][n], g.ravel(), rtol=1e-5, atol=1e-6, err_msg=n)
            np.testing.assert_allclose(got[False][n], got[True][n], rtol=1e-6, atol=1e-7, err_msg=n)
