"""The call forms of the public API on real ranks (2 gloo processes): the paths the in-process tests cannot reach
(one shard per process, process groups, a data set already split per rank). Run:

    OMP_NUM_THREADS=1 PYTHONPATH=.:examples python -m paddle.distributed.launch --nproc_per_node 2 \
        tools/check_api_call_forms_dist.py

Each rank prints ``RANK<r> True []`` when every check holds, else the names of the failing checks (exit 1).
Anything but a 2-rank launch is refused.
"""
import argparse
import os

import numpy as np
import paddle
import paddle.distributed as dist

import autoparallel as ap


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   epilog="Run on 2 ranks: python -m paddle.distributed.launch --nproc_per_node 2 "
                                          "tools/check_api_call_forms_dist.py (takes no options)")


def checks(rank: int) -> list:
    """(name, passed) of every check on this rank."""
    out = []
    mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
    full = np.arange(8, dtype="float32").reshape(4, 2)
    x = ap.shard_tensor(paddle.to_tensor(full), dist.ProcessMesh([0, 1], ["x"]), [dist.Shard(-2)], stop_gradient=False)
    out.append(("shard_tensor paddle forms", np.array_equal(x.local.numpy(), full[2 * rank:2 * rank + 2])))
    y = ap.dtensor_from_local(local_tensor=paddle.to_tensor(full[2 * rank:2 * rank + 2]), mesh=mesh, placements=[ap.Shard(0)])
    out.append(("dtensor_from_local", np.array_equal(y.numpy(), full)))
    out.append(("dtensor_to_local", np.array_equal(ap.dtensor_to_local(y, mesh, [ap.Shard(0)]).numpy(), full[2 * rank:2 * rank + 2])))
    class SqSum(ap.LocalLayer):
        def forward(self, t):
            return (t * t).sum()
    loss = SqSum([(mesh, [ap.Partial()])], [None])(x)
    out.append(("LocalLayer value", abs(float(loss) - float((full ** 2).sum())) < 1e-4))
    loss.backward()
    out.append(("LocalLayer grad", np.allclose(x.grad.numpy(), 2 * full)))
    z = ap.local_map(lambda a: a + rank, [[ap.Shard(0)]])(x)
    out.append(("local_map", np.allclose(z.numpy(), full + np.array([[0], [0], [1], [1]], "float32"))))
    g = mesh.get_group("x")
    out.append(("get_group", g is None or sorted(g.ranks) == [0, 1]))
    m2 = ap.ProcessMesh([[0], [1]], ["a", "b"])
    out.append(("get_submesh_with_dim", m2.get_submesh_with_dim("b").process_ids == [rank]))
    class DS(paddle.io.Dataset):
        def __len__(self): return 8
        def __getitem__(self, i): return np.full([3], i, "float32")
    dl = ap.shard_dataloader(paddle.io.DataLoader(DS(), batch_size=4, shuffle=False), mesh, shard_dims="x")
    b = next(iter(dl))
    out.append(("shard_dataloader global", np.array_equal(b.numpy()[:, 0], np.arange(4)) and b.local.shape == [2, 3]))
    local_loader = paddle.io.DataLoader(paddle.io.Subset(DS(), list(range(4 * rank, 4 * rank + 4))), batch_size=2, shuffle=False)
    b2 = next(iter(ap.shard_dataloader(local_loader, mesh, shard_dims="x", is_dataset_splitted=True)))
    out.append(("shard_dataloader splitted", np.array_equal(b2.numpy()[:, 0], [0, 1, 4, 5])))
    # parallelize paddle form vs reference
    from autoparallel.testing.models import adamw, build, train_steps, trained_reference
    ref_losses, _ = trained_reference("gpt", 2)
    m = build("gpt")
    m, opt = ap.parallelize(m, adamw(m.parameters()), dist.ProcessMesh([[0, 1]], ["dp", "mp"]),
                            {"mp_config": {"parallelize_plan": {"blocks.*.mlp.fc1": dist.ColWiseParallel(),
                                                                "blocks.*.mlp.fc2": dist.RowWiseParallel()}}})
    losses = train_steps(m, opt, 2)
    out.append(("parallelize paddle form", np.allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)))
    return out


def main(argv=None) -> int:
    parser = build_parser()
    parser.parse_args(argv)
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    if world != 2:
        parser.error(f"needs exactly 2 launched ranks (python -m paddle.distributed.launch --nproc_per_node 2), "
                     f"got a world of {world}")
    ap.init_parallel_env()
    rank = ap.get_rank()
    out = checks(rank)
    print(f"RANK{rank}", all(v for _, v in out), [n for n, v in out if not v])
    return 0 if all(v for _, v in out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
