"""A custom fused op joins sharded execution through register_spmd_rule.

    python examples/custom_op_rule.py            # simulated 4-rank world, no launcher needed

``fused_swiglu(x, gate) = silu(gate) * x`` is an ordinary paddle function. Its rule says: elementwise,
both operands laid out alike (the larger operand's sharding wins, nonlinear so Partial inputs are
reduced first). Under a 2x2 mesh the op runs on each rank's shards and the result equals the single
process, forward and backward.
"""
import argparse

import numpy as np
import paddle
import paddle.nn.functional as F

import autoparallel as ap
from autoparallel.mesh import mesh_from_shape
from autoparallel.testing.check import assemble
from spmd_rules import get_spmd_rule, register_spmd_rule
from spmd_rules.elementwise import elementwise_result


@register_spmd_rule("fused_swiglu")
def fused_swiglu_rule(x, gate):
    return elementwise_result("fused_swiglu", [x, gate])


@ap.custom_op("fused_swiglu")
def fused_swiglu(x, gate):
    return F.silu(gate) * x


def main(world: int = 4) -> bool:
    rng = np.random.default_rng(0)
    x, g = (rng.standard_normal((8, 12)).astype("float32") for _ in range(2))
    xt, gt = paddle.to_tensor(x, stop_gradient=False), paddle.to_tensor(g, stop_gradient=False)
    fused_swiglu(xt, gt).sum().backward()
    with ap.simulate(world_size=world):
        mesh = mesh_from_shape([2, 2], ["data", "model"])
        xd = ap.shard_tensor(paddle.to_tensor(x), mesh, [ap.Shard(0), ap.Shard(1)], stop_gradient=False)
        gd = ap.shard_tensor(paddle.to_tensor(g), mesh, [ap.Shard(0), ap.Replicate()], stop_gradient=False)
        print("rule:", get_spmd_rule("fused_swiglu")(xd.spec, gd.spec))
        y = fused_swiglu(xd, gd)
        print("output:", y)
        y.sum().backward()
        ok_fwd = np.allclose(assemble(y.locals, y.spec), fused_swiglu(xt, gt).numpy(), atol=1e-6)
        gx, gg = xd.grad, gd.grad
        ok_bwd = np.allclose(assemble(gx.locals, gx.spec), xt.grad.numpy(), atol=1e-6) and \
            np.allclose(assemble(gg.locals, gg.spec), gt.grad.numpy(), atol=1e-6)
    print(f"forward matches single process: {ok_fwd}; input gradients match: {ok_bwd}")
    return bool(ok_fwd and ok_bwd)


def cli(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Takes no options.").parse_args(argv)
    return 0 if main() else 1


if __name__ == "__main__":
    raise SystemExit(cli())
