"""2 gloo ranks train a data-parallel MLP (``ap.parallelize``, the default watchdog) and one rank ends its program
early without an error while the other goes on into the next step's collectives:

* ``break0``: rank 0 (the host of the TCP store) leaves the loop with ``break`` at step 2 and the script returns;
* ``exit1``: rank 1 calls ``sys.exit(0)`` at step 2.

The rank left behind waits in a gradient all_reduce nobody will join. Each rank prints ``step <i>`` after every
step. Usage: hangs8_early_end.py MODE"""
import sys

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F

import autoparallel as ap

mode = sys.argv[1]
sys.tracebacklimit = 2              # the launcher keeps the tail of each log: the watchdog's lines before the traceback
ap.init_parallel_env()
rank = dist.get_rank()


class MLP(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = paddle.nn.Linear(8, 16), paddle.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


paddle.seed(0)
s = ap.Strategy()
s.data_parallel.degree = 2
model = MLP()
model, opt = ap.parallelize(model, paddle.optimizer.SGD(0.1, parameters=model.parameters()), strategy=s)
rng = np.random.default_rng(0)
for step in range(6):
    x, y = rng.standard_normal((8, 8)).astype("float32"), rng.integers(0, 4, (8,))
    if step == 2 and (mode, rank) == ("break0", 0):
        break                                           # a rank-local stopping rule (a time budget, a flag file)
    if step == 2 and (mode, rank) == ("exit1", 1):
        sys.exit(0)
    with ap.parallel_guard(["data"]):
        loss = F.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y)).mean()
    loss.backward()                                     # the gradient all_reduce
    opt.step()
    opt.clear_grad()
    print(f"step {step} loss {float(loss):.6f}", flush=True)
print("script returned", flush=True)
