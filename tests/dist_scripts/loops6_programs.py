"""Training loops beyond one model and one loss, as user programs: each ``run(mode)`` trains in one process
(``mode=None``) or under a layout (dp / tp / zero1 / zero2 / zero3 over every rank of the world) and returns the
losses and every parameter (global values) for comparison. Used in one process and ``ap.simulate`` by
tests/test_probe_loops6.py and on real gloo ranks by loops6_worker.py."""
import copy

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle import nn

import autoparallel as ap

RNG = np.random.default_rng(6)
B = 8
X = [RNG.standard_normal((B, 6)).astype("float32") for _ in range(4)]
Y = [RNG.standard_normal((B, 6)).astype("float32") for _ in range(4)]
TP = {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()}


class MLP(nn.Layer):
    def __init__(self, i=6, h=16, o=6):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(i, h), nn.Linear(h, o)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def world() -> int:
    return ap.get_world_size()


def par(model, opt, mode):
    """``model`` (and ``opt``) laid out by ``mode`` over every rank; None: untouched."""
    if mode is None:
        return model, opt
    s = ap.Strategy()
    if mode == "tp":
        s.tensor_parallel.degree = world()
        return ap.parallelize(model, opt, strategy=s, tp_plan=TP)
    s.data_parallel.degree = world()
    if mode.startswith("zero"):
        s.sharding.enable, s.sharding.stage = True, int(mode[-1])
    return ap.parallelize(model, opt, strategy=s)


def full(t):
    return (t.full() if ap.is_dist(t) else t).numpy().copy()


def values(m):
    return {n: full(p) for n, p in m.named_parameters()}


def onto(x, model):
    """``x`` on ``model``'s mesh (batch-sharded over its data dim); plain values and same-mesh values as they are."""
    if not ap.is_dist(x) or x.mesh == ap.mesh_of(model):
        return x
    mesh = ap.mesh_of(model)
    return ap.reshard(x, mesh, [ap.Shard(0) if n == "data" else ap.Replicate() for n in mesh.dim_names])


def sgd_or_adam(m, adam=True):
    if adam:
        return paddle.optimizer.Adam(1e-2, parameters=m.parameters())
    return paddle.optimizer.SGD(0.1, parameters=m.parameters())


# ---- EMA of the weights, kept by hand on a deepcopy ------------------------------------------------------------
def ema(mode, d=0.9):
    paddle.seed(1)
    m = MLP()
    m, opt = par(m, sgd_or_adam(m), mode)
    e = copy.deepcopy(m)
    losses = []
    for i in range(3):
        loss = F.mse_loss(m(paddle.to_tensor(X[i])), paddle.to_tensor(Y[i]))
        loss.backward()
        opt.step(), opt.clear_grad()
        with paddle.no_grad():
            for k, (ep, p) in enumerate(zip(e.parameters(), m.parameters())):
                if (i + k) % 2:
                    ep.set_value(d * ep + (1 - d) * p)
                else:
                    paddle.assign(d * ep + (1 - d) * p, ep)
        e.eval()
        with paddle.no_grad():
            ev = F.mse_loss(e(paddle.to_tensor(X[3])), paddle.to_tensor(Y[3]))
        e.train()
        losses.append([float(loss), float(ev)])
    return losses, values(m), values(e)


# ---- distillation: a frozen teacher, a student, KL on logits ---------------------------------------------------
def distill(tmode, smode):
    paddle.seed(2)
    teacher, student = MLP(6, 32, 6), MLP(6, 8, 6)
    teacher.eval()
    for p in teacher.parameters():
        p.stop_gradient = True
    teacher, _ = par(teacher, None, tmode)
    student, opt = par(student, sgd_or_adam(student), smode)
    losses = []
    for i in range(3):
        x = paddle.to_tensor(X[i])
        with paddle.no_grad():
            t = teacher(x)
        s = student(x)
        t = onto(t, student)
        loss = F.kl_div(F.log_softmax(s / 2.0, -1), F.softmax(t / 2.0, -1), reduction="batchmean") * 4.0
        loss.backward()
        opt.step(), opt.clear_grad()
        losses.append(float(loss))
    return losses, values(student), values(teacher)


# ---- a GAN: two models, two optimizers, alternating steps ------------------------------------------------------
def gan(mode, penalty=False):
    """``penalty``: a gradient penalty on D's input gradient, ``paddle.grad(create_graph=True)``."""
    paddle.seed(3)
    G, D = MLP(4, 16, 6), MLP(6, 16, 1)
    (G, og), (D, od) = par(G, sgd_or_adam(G), mode), par(D, sgd_or_adam(D), mode)
    losses = []
    for i in range(3):
        z, real = paddle.to_tensor(X[i][:, :4]), paddle.to_tensor(Y[i])
        fake = G(z)
        ld = F.softplus(-D(real)).mean() + F.softplus(D(fake.detach())).mean()
        if penalty:
            xr = paddle.to_tensor(Y[i], stop_gradient=False)
            g = paddle.grad(D(xr).sum(), xr, create_graph=True)[0]
            ld = ld + 0.1 * ((g * g).sum(-1).sqrt() - 1.0).pow(2).mean()
        od.clear_grad()
        ld.backward()
        od.step()
        lg = F.softplus(-D(fake)).mean()
        og.clear_grad()
        lg.backward()
        og.step()
        losses.append([float(ld), float(lg)])
    return losses, values(G), values(D)


# ---- CLIP-style contrastive loss over the whole global batch ---------------------------------------------------
class Clip(nn.Layer):
    def __init__(self):
        super().__init__()
        self.img, self.txt = MLP(6, 16, 8), MLP(6, 16, 8)

    def forward(self, a, b):
        return F.normalize(self.img(a), axis=-1), F.normalize(self.txt(b), axis=-1)


def clip(mode, form="matmul"):
    """``form="matmul"``: the global-view program, logits = img @ txt.T over the (batch-sharded) global batch.
    ``form="gather"``: the hand-written data-parallel program, ``dist.all_gather`` of both embeddings."""
    paddle.seed(4)
    m = Clip()
    m, opt = par(m, sgd_or_adam(m), mode)
    losses = []
    for i in range(3):
        a, b = m(paddle.to_tensor(X[i]), paddle.to_tensor(Y[i]))
        if form == "gather":
            ga, gb = [], []
            dist.all_gather(ga, a), dist.all_gather(gb, b)
            a, b = paddle.concat(ga), paddle.concat(gb)
        logits = paddle.matmul(a, b, transpose_y=True) / 0.1
        labels = paddle.arange(logits.shape[0], dtype="int64")
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        loss.backward()
        opt.step(), opt.clear_grad()
        losses.append(float(loss))
    return losses, values(m)


# ---- siamese towers: one model called on both inputs -----------------------------------------------------------
def siamese(mode):
    paddle.seed(5)
    m = MLP()
    m, opt = par(m, sgd_or_adam(m), mode)
    same = paddle.to_tensor(np.arange(B) % 2, dtype="float32")
    losses = []
    for i in range(3):
        u, v = m(paddle.to_tensor(X[i])), m(paddle.to_tensor(Y[i]))
        dd = ((u - v) ** 2).sum(-1)
        loss = (same * dd + (1 - same) * F.relu(1.0 - dd.sqrt()) ** 2).mean()
        loss.backward()
        opt.step(), opt.clear_grad()
        losses.append(float(loss))
    return losses, values(m)


# ---- two heads, two weighted losses: one backward or two -------------------------------------------------------
class TwoHeads(nn.Layer):
    def __init__(self):
        super().__init__()
        self.trunk, self.h1, self.h2 = MLP(6, 16, 8), nn.Linear(8, 6), nn.Linear(8, 1)

    def forward(self, x):
        t = F.relu(self.trunk(x))
        return self.h1(t), self.h2(t)


def two_heads(mode, form="one"):
    paddle.seed(6)
    m = TwoHeads()
    m, opt = par(m, sgd_or_adam(m), mode)
    losses = []
    for i in range(3):
        o1, o2 = m(paddle.to_tensor(X[i]))
        l1 = F.mse_loss(o1, paddle.to_tensor(Y[i]))
        l2 = F.softplus(o2).mean()
        if form == "one":
            (0.7 * l1 + 0.3 * l2).backward()
        elif form == "list":
            paddle.autograd.backward([0.7 * l1, 0.3 * l2])
        else:
            (0.7 * l1).backward(retain_graph=True)
            (0.3 * l2).backward()
        opt.step(), opt.clear_grad()
        losses.append([float(l1), float(l2)])
    return losses, values(m)


# ---- freezing / unfreezing layers between steps ----------------------------------------------------------------
def freeze(mode, steps=((True, False), (False, False), (False, True), (True, False))):
    """Step k trains with fc1 frozen when ``steps[k][0]``, fc2 frozen when ``steps[k][1]``."""
    paddle.seed(7)
    m = MLP()
    m, opt = par(m, sgd_or_adam(m), mode)
    losses = []
    for i, (f1, f2) in enumerate(steps):
        for p in m.fc1.parameters():
            p.stop_gradient = f1
        for p in m.fc2.parameters():
            p.stop_gradient = f2
        loss = F.mse_loss(m(paddle.to_tensor(X[i])), paddle.to_tensor(Y[i]))
        loss.backward()
        opt.step(), opt.clear_grad()
        losses.append(float(loss))
    return losses, values(m)


# ---- train() / eval() toggles mid-run, with BatchNorm and Dropout ----------------------------------------------
class BNNet(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 16), nn.BatchNorm1D(16), nn.Linear(16, 6)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def bn_toggle(mode):
    paddle.seed(8)
    m = BNNet()
    m, opt = par(m, sgd_or_adam(m, adam=False), mode)     # SGD: Adam would amplify fc1.bias's ~0 gradient
    losses = []
    for i in range(3):
        m.train()
        loss = F.mse_loss(m(paddle.to_tensor(X[i])), paddle.to_tensor(Y[i]))
        loss.backward()
        opt.step(), opt.clear_grad()
        m.eval()
        with paddle.no_grad():
            ev = F.mse_loss(m(paddle.to_tensor(X[3])), paddle.to_tensor(Y[3]))
        losses.append([float(loss), float(ev)])
    buffers = {n: full(b) for n, b in m.named_buffers()}
    return losses, values(m), buffers


# ---- a head added to the model after parallelize ---------------------------------------------------------------
class Extended(nn.Layer):
    def __init__(self):
        super().__init__()
        self.body = MLP()

    def forward(self, x):
        h = self.body(x)
        return self.head(h) if hasattr(self, "head") else h


def new_head(mode, where="model"):
    """``model.head = nn.Linear(...)`` after ``ap.parallelize``, trained by a second optimizer over its
    parameters (``where="model"``), or by a new plain optimizer over every parameter of the model in place of the
    parallelized one (``where="opt"``)."""
    paddle.seed(9)
    m = Extended()
    m, opt = par(m, sgd_or_adam(m, adam=False), mode)
    m.head = nn.Linear(6, 3)
    if where == "model":
        opt2 = paddle.optimizer.SGD(0.1, parameters=m.head.parameters())
    else:
        opt = opt2 = paddle.optimizer.SGD(0.1, parameters=m.parameters())
    losses = []
    for i in range(3):
        loss = F.mse_loss(m(paddle.to_tensor(X[i])), paddle.to_tensor(Y[i][:, :3]))
        loss.backward()
        opt.step(), opt.clear_grad()
        if opt2 is not opt:
            opt2.step(), opt2.clear_grad()
        losses.append(float(loss))
    return losses, values(m)


# ---- evaluation with the EMA weights swapped into the model, then swapped back ---------------------------------
def ema_swap(mode, restore="assign", d=0.8):
    """The EMA as a dict of tensors, swapped into the model for evaluation and the trained weights restored by
    ``paddle.assign(backup, p)``, ``p[...] = backup`` (``restore="setitem"``) or ``p.scale_(0.0).add_(backup)``
    (``restore="inplace"``)."""
    paddle.seed(10)
    m = MLP()
    m, opt = par(m, sgd_or_adam(m), mode)
    shadow = {n: p.clone() for n, p in m.named_parameters()}
    losses = []
    for i in range(3):
        loss = F.mse_loss(m(paddle.to_tensor(X[i])), paddle.to_tensor(Y[i]))
        loss.backward()
        opt.step(), opt.clear_grad()
        with paddle.no_grad():
            for n, p in m.named_parameters():
                shadow[n] = d * shadow[n] + (1 - d) * p
            backup = {n: p.clone() for n, p in m.named_parameters()}
            for n, p in m.named_parameters():
                p.set_value(shadow[n])
            m.eval()
            ev = F.mse_loss(m(paddle.to_tensor(X[3])), paddle.to_tensor(Y[3]))
            m.train()
            for n, p in m.named_parameters():
                if restore == "assign":
                    paddle.assign(backup[n], p)
                elif restore == "setitem":
                    p[...] = backup[n]
                else:
                    p.scale_(0.0).add_(backup[n])
        losses.append([float(loss), float(ev)])
    return losses, values(m), {n: full(t) for n, t in shadow.items()}


# ---- self-distillation: the teacher is a deepcopy of the parallelized student ----------------------------------
def self_distill(mode):
    paddle.seed(11)
    student = MLP()
    student, opt = par(student, sgd_or_adam(student), mode)
    losses = []
    teacher = None
    for i in range(4):
        if i % 2 == 0:                  # the teacher refreshed from the student every other step
            teacher = copy.deepcopy(student)
            teacher.eval()
        x = paddle.to_tensor(X[i])
        with paddle.no_grad():
            t = teacher(x)
        loss = F.mse_loss(student(x), t.detach() * 0.5 + paddle.to_tensor(Y[i]) * 0.5)
        loss.backward()
        opt.step(), opt.clear_grad()
        losses.append(float(loss))
    return losses, values(student), values(teacher)


# ---- the cases: name -> (program, layout args, one-process args) -----------------------------------------------
CASES = {
    "ema dp": (ema, ("dp",), (None,)), "ema tp": (ema, ("tp",), (None,)), "ema zero3": (ema, ("zero3",), (None,)),
    "distill tp teacher, dp student": (distill, ("tp", "dp"), (None, None)),
    "distill tp teacher, zero3 student": (distill, ("tp", "zero3"), (None, None)),
    "gan dp": (gan, ("dp",), (None,)), "gan zero2": (gan, ("zero2",), (None,)),
    "gan penalty zero1": (gan, ("zero1", True), (None, True)),
    "gan penalty zero2": (gan, ("zero2", True), (None, True)),
    "clip dp": (clip, ("dp",), (None,)), "clip zero2": (clip, ("zero2",), (None,)),
    "siamese dp": (siamese, ("dp",), (None,)), "siamese tp": (siamese, ("tp",), (None,)),
    "siamese zero3": (siamese, ("zero3",), (None,)),
    "two heads one backward tp": (two_heads, ("tp", "one"), (None, "one")),
    "two heads two backwards zero2": (two_heads, ("zero2", "two"), (None, "two")),
    "two heads two backwards zero3": (two_heads, ("zero3", "two"), (None, "two")),
    "two heads autograd.backward tp": (two_heads, ("tp", "list"), (None, "list")),
    "freeze zero1": (freeze, ("zero1",), (None,)), "freeze zero2": (freeze, ("zero2",), (None,)),
    "freeze zero3": (freeze, ("zero3",), (None,)),
    "bn toggle dp": (bn_toggle, ("dp",), (None,)),
    "ema swap assign zero1": (ema_swap, ("zero1", "assign"), (None, "assign")),
    "ema swap assign zero2": (ema_swap, ("zero2", "assign"), (None, "assign")),
    "ema swap assign zero3": (ema_swap, ("zero3", "assign"), (None, "assign")),
    "ema swap setitem zero1": (ema_swap, ("zero1", "setitem"), (None, "setitem")),
    "ema swap setitem zero3": (ema_swap, ("zero3", "setitem"), (None, "setitem")),
    "ema swap inplace zero2": (ema_swap, ("zero2", "inplace"), (None, "inplace")),
    "ema swap setitem tp": (ema_swap, ("tp", "setitem"), (None, "setitem")),
    "self distill zero3": (self_distill, ("zero3",), (None,)),
    "self distill tp": (self_distill, ("tp",), (None,)),
    "new head dp": (new_head, ("dp",), (None,)), "new head zero3": (new_head, ("zero3",), (None,)),
}
REFUSED = {                     # name -> (program, args, the error type expected)
    "clip all_gather by hand": (clip, ("dp", "gather"), TypeError),
    "two heads two backwards tp": (two_heads, ("tp", "two"), NotImplementedError),
}


def plain(result):
    losses, *dicts = result
    return {"losses": np.asarray(losses, dtype="float64").tolist(),
            "values": [{k: v.tolist() for k, v in d.items()} for d in dicts]}


def run_case(name):
    """The case's result under its layout (an error: its type and text), as plain lists."""
    if name in REFUSED:
        fn, args, _ = REFUSED[name]
    else:
        fn, args, _ = CASES[name]
    try:
        return plain(fn(*args))
    except Exception as e:          # reported, not raised: the other cases of the launch still run
        return {"error": type(e).__name__, "text": str(e)}


def reference(name):
    fn, _, args = CASES[name]
    return plain(fn(*args))
