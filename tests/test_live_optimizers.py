"""parallel/stale_optimizers.live_optimizers: every live paddle optimizer, found without walking the collector's
objects after the first call (``Optimizer.__new__`` records each new one), dropped when it dies."""
import gc

import paddle

from autoparallel.parallel import stale_optimizers as so


def _param():
    return paddle.create_parameter([2], "float32")


def test_optimizers_before_and_after_the_first_lookup_are_found_and_dead_ones_dropped():
    before = paddle.optimizer.SGD(parameters=[_param()])
    assert any(o is before for o in so.live_optimizers())             # found by the first walk (or recorded)
    after = paddle.optimizer.AdamW(parameters=[_param()])

    class NoSuperInit(paddle.optimizer.Optimizer):                    # never calls Optimizer.__init__
        def __init__(self):
            pass

    odd = NoSuperInit()
    live = so.live_optimizers()
    assert all(any(o is x for o in live) for x in (before, after, odd))
    ident = id(after)
    del after, live
    gc.collect()
    assert all(id(o) != ident for o in so.live_optimizers())


def test_a_layer_laid_out_after_its_optimizer_trains():
    """The user path the lookup serves: an optimizer built before ap.shard_layer steps the distributed
    parameters (it held the replaced originals)."""
    import autoparallel as ap

    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], ["x"])
        net = paddle.nn.Linear(4, 4)
        opt = paddle.optimizer.SGD(0.5, parameters=net.parameters())
        net = ap.shard_layer(net, mesh)
        w = net.weight.full().numpy().copy()
        net(ap.shard_tensor(paddle.ones([2, 4]), mesh, [ap.Replicate()])).sum().backward()
        opt.step()
        assert abs(net.weight.full().numpy() - w).max() > 0.1
