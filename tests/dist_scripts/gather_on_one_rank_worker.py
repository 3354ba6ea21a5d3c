"""2 gloo ranks, the article's flow (``ap.init_parallel_env``, ``ap.shard_layer``; no ``parallelize``): rank 0
gathers the model's state alone (``ap.full_state_dict`` inside ``if rank == 0:``, a collective) while rank 1 goes on
to its forward's all_reduce. The watchdog started by init_parallel_env names the mismatch on both ranks (they
exit with code 75); before, both waited for gloo's bare TIMEOUT, 30 s."""
import paddle
import paddle.distributed as dist

import autoparallel as ap

ap.init_parallel_env()
mesh = ap.ProcessMesh([0, 1], dim_names=["tp"])
net = ap.shard_layer(paddle.nn.Linear(4, 6), mesh, lambda name, layer, m: setattr(
    layer, "weight", ap.shard_tensor(layer.weight, m, [ap.Shard(1)])) if name == "" else None)
if dist.get_rank() == 0:
    state = ap.full_state_dict(net)                 # a gather the other rank never makes
x = ap.shard_tensor(paddle.ones([2, 4]), mesh, [ap.Replicate()])
net(x).sum().backward()
