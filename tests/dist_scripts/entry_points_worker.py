"""Runs on every rank (4): the article's seed-style entry points on real gloo ranks, several steps each,
reporting every rank's local parameter copies for comparison with the simulated world.

* ``ap.init_parallel_env()`` then ``ap.DataParallel`` + ``ap.Optimizer`` at DP2 x TP2 with global-norm
  clipping, ``loss.backward(use_async_allreduce=True)`` (gloo: accepted, blocking);
* ``ap.shard_optimizer(opt, ap.ShardingStage2("data", mesh))`` over a model distributed by parallelize.
"""

import numpy as np
import paddle
import paddle.nn.functional as F


import autoparallel as ap  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402
from entry_points_common import run  # noqa: E402

world = ap.init_parallel_env()
out = {"world": [world.rank, world.world_size, type(world).__name__]}
for case in ("dp_optimizer", "stage2"):
    losses, locals_ = run(case)
    out[case] = {"losses": losses, "params": {k: v.tolist() for k, v in locals_.items()}}
write_result(out)
