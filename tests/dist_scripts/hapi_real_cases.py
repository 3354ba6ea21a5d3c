"""hapi's ``paddle.Model`` on the ranks of a launch (run by trainer_real_worker.py): ``fit`` with evaluation data,
``evaluate``, ``predict``, ``fit(save_dir=...)``'s ``Model.save`` over a small MLP laid out by ap.parallelize (dp 4; dp 2 x tp 2), against the
same steps written out in one process on the rank (hapi's ``train_batch``: forward, loss, backward, minimize,
clear). ``batch_size`` is one data-parallel rank's rows: the global batch is 8."""
import os

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

import autoparallel as ap

RNG = np.random.default_rng(1)
X = RNG.standard_normal((32, 6)).astype("float32")
Y = RNG.standard_normal((32, 4)).astype("float32")
GLOBAL_BATCH, EPOCHS = 8, 2


class MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(F.tanh(self.fc1(x)))


class Pairs(paddle.io.Dataset):
    def __init__(self, lo, hi):
        self.lo, self.hi = lo, hi

    def __len__(self):
        return self.hi - self.lo

    def __getitem__(self, i):
        return X[self.lo + i], Y[self.lo + i]


class Losses(paddle.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, step, logs=None):
        self.seen.append(float(np.asarray(logs["loss"]).reshape(-1)[0]))


def model():
    paddle.seed(5)
    return MLP()


def one_process():
    """Losses, parameters after fit, evaluation loss, predictions: hapi's steps in one process."""
    net = model()
    opt = paddle.optimizer.Adam(1e-2, parameters=net.parameters())
    losses = []
    for _ in range(EPOCHS):
        for i in range(0, 24, GLOBAL_BATCH):
            loss = F.mse_loss(net(paddle.to_tensor(X[i:i + GLOBAL_BATCH])), paddle.to_tensor(Y[i:i + GLOBAL_BATCH]))
            loss.backward()
            opt.minimize(loss)
            net.clear_gradients()
            losses.append(float(loss))
    with paddle.no_grad():
        pred = net(paddle.to_tensor(X[24:])).numpy()
        ev = float(F.mse_loss(paddle.to_tensor(pred), paddle.to_tensor(Y[24:])))
    return losses, {n: p.numpy() for n, p in net.named_parameters()}, ev, pred


def distributed(dp, tp, out):
    net = model()
    sched = paddle.optimizer.lr.StepDecay(1e-2, step_size=1000)    # constant here; Model.load asserts its state
    opt = paddle.optimizer.Adam(sched, parameters=net.parameters())
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    plan = {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()} if tp > 1 else None
    net, opt = ap.parallelize(net, opt, strategy=s, tp_plan=plan)
    m = paddle.Model(net)
    m.prepare(opt, nn.MSELoss())
    seen = Losses()
    m.fit(Pairs(0, 24), epochs=EPOCHS, batch_size=GLOBAL_BATCH // dp, shuffle=False, verbose=0, callbacks=[seen],
          save_dir=os.path.join(out, f"hapi_dp{dp}_tp{tp}"))              # Model.save per epoch and at the end
    ev = m.evaluate(Pairs(24, 32), batch_size=GLOBAL_BATCH // dp, verbose=0)["loss"]
    pred = m.predict(Pairs(24, 32), batch_size=GLOBAL_BATCH // dp, verbose=0, stack_outputs=True)[0]
    params = {n: (p.full() if ap.is_dist(p) else p).numpy() for n, p in net.named_parameters()}
    m.load(os.path.join(out, f"hapi_dp{dp}_tp{tp}", "final"))          # parameters and optimizer states back
    params["reload"] = max(float(np.abs((p.full() if ap.is_dist(p) else p).numpy() - params[n]).max())
                           for n, p in net.named_parameters())
    return seen.seen, params, float(np.asarray(ev).reshape(-1)[0]), pred


def compare(dp, tp, out) -> dict:
    want, got = one_process(), distributed(dp, tp, out)
    if len(got[0]) != len(want[0]):
        return {"error": f"{len(got[0])} logged steps, one process {len(want[0])}"}
    saved = paddle.load(os.path.join(out, f"hapi_dp{dp}_tp{tp}", "final.pdparams")) if paddle.distributed.get_rank() == 0 \
        else None
    return {"loss": max(abs(a - b) for a, b in zip(got[0], want[0])), "reload": got[1].pop("reload"),
            "param": max(float(np.abs(got[1][n] - v).max()) for n, v in want[1].items()),
            "eval": abs(got[2] - want[2]), "predict": float(np.abs(got[3] - want[3]).max()) if got[3].shape ==
            want[3].shape else float("inf"),
            "saved": 0.0 if saved is None else max(float(np.abs(np.asarray(saved[n]) - v).max())
                                                   for n, v in want[1].items()),
            "moved": max(float(np.abs(v - p.numpy()).max()) for (n, v), p in zip(want[1].items(),
                                                                                 model().parameters()))}


CASES = {"hapi fit/evaluate/predict/save, dp4": lambda out: compare(4, 1, out),
         "hapi fit/evaluate/predict/save, dp2 x tp2": lambda out: compare(2, 2, out)}
