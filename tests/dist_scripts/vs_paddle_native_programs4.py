"""The 4-rank user programs of vs_paddle_native_worker.py (its argument ``vs_paddle_native_programs4``): what a
DP x TP user writes on 2 x 2 meshes, ``[[0, 1], [2, 3]]`` (dp x mp) and a permuted ``[[3, 1], [2, 0]]``. The
form of a program is vs_paddle_native_programs.py's; the tables at the end name the documented differences
(docs/vs_paddle_native.md, "4 ranks")."""
import numpy as np
import paddle
import paddle.nn.functional as F

from vs_paddle_native_programs import A73, A84, LB8, LG86, X86, _rank, pl, t
from vs_paddle_native_training import BATCHES, IDS, MLP, Rows, llama_and_plan, params, tp_fn, train_llama

IDS_PERM = [[3, 1], [2, 0]]
EMB16 = np.random.default_rng(5).standard_normal((8, 6)).astype("float32")
IDS42 = np.array([[1, 7], [0, 5], [2, 6], [7, 4]], dtype="int64")


def mesh22(D, perm=False):
    return D.ProcessMesh(IDS_PERM if perm else [[0, 1], [2, 3]], dim_names=["dp", "mp"])


def _pls(D, codes):
    return [pl(D, c) for c in codes.split(",")]


# ---- shard_tensor ---------------------------------------------------------------------------------------------
PAIRS = ("R,R", "S0,R", "R,S1", "S0,S1", "S1,S0", "S0,S0", "P,S0", "S1,P", "R,P")


def _shard(perm, a, tag, pairs=PAIRS):
    def program(A):
        D, m = A.D, mesh22(A.D, perm)
        return {c.replace(",", ""): (D.shard_tensor(t(a), m, _pls(D, c)), True) for c in pairs}
    program.__name__ = f"shard_tensor_2x2{tag}"
    return program


UNEVEN_PAIRS = tuple(p for p in PAIRS if p != "S0,S0")
SHARD_S0S0_UNEVEN = _shard(False, A73, "_S0S0", ("S0,S0",))
# 7 rows over both mesh dims (2, 2, 2, 1): paddle aborts the job (gloo "op.preamble.length <= op.nbytes. 18 vs 12"
# on rank 3 when it gathers the shards); ours is checked against numpy
SKIP_S0S0 = ("paddle 3.3.1 aborts the process (SIGABRT in gloo: 'op.preamble.length <= op.nbytes. 18 vs 12') "
             "gathering 7 rows split over both mesh dims [S(0), S(0)] (2, 2, 2, 1)")
SHARD_S0S0_UNEVEN.paddle_skip = SKIP_S0S0


# ---- reshard --------------------------------------------------------------------------------------------------
def _reshard(src, dst, a=A84, perm=False):
    def program(A):
        D, m = A.D, mesh22(A.D, perm)
        x = D.shard_tensor(t(a), m, _pls(D, src))
        return {"out": (D.reshard(x, m, _pls(D, dst)), True)}
    tag = ("_uneven" if a is A73 else "") + ("_perm" if perm else "")
    program.__name__ = f"reshard4_{src.replace(',', '')}_to_{dst.replace(',', '')}{tag}"
    program.expect, program.mesh_ids = a, IDS_PERM if perm else [[0, 1], [2, 3]]
    if a is A73 and "S0,S0" in (src, dst):
        program.paddle_skip = SKIP_S0S0
    return program


RESHARDS = [("S0,R", "R,S1"), ("S0,S1", "R,R"), ("S0,S0", "R,R"), ("R,R", "S0,S0"), ("R,R", "S0,S1"),
            ("S0,S1", "S0,R"), ("S0,R", "S0,S0"), ("S0,S0", "S0,R"), ("P,S1", "R,R"), ("R,P", "R,R"),
            ("P,S1", "S0,S1"), ("S0,S1", "S1,S0"), ("R,S1", "P,S1")]


# ---- ops --------------------------------------------------------------------------------------------------------
W64 = np.random.default_rng(9).standard_normal((6, 4)).astype("float32")


def matmul_dp_tp(A):
    """x [S(0), R] (batch over dp) @ w [R, S(1)] (columns over mp)."""
    D, m = A.D, mesh22(A.D)
    x = D.shard_tensor(t(X86, False), m, _pls(D, "S0,R"))
    w = D.shard_tensor(t(W64, False), m, _pls(D, "R,S1"))
    y = paddle.matmul(x, w)
    (y * y).mean().backward()
    return {"y": y, "x.grad": x.grad, "w.grad": w.grad}


def matmul_dp_tp_perm(A):
    """The same on the permuted mesh, then a row-parallel second matmul: [S(0), S(1)] @ [R, S(0)]."""
    D, m = A.D, mesh22(A.D, True)
    x = D.shard_tensor(t(X86, False), m, _pls(D, "S0,R"))
    w = D.shard_tensor(t(W64, False), m, _pls(D, "R,S1"))
    v = D.shard_tensor(t(W64.T.copy(), False), m, _pls(D, "R,S0"))
    y = paddle.matmul(paddle.matmul(x, w), v)
    (y * y).mean().backward()
    return {"y": y, "x.grad": x.grad, "w.grad": w.grad, "v.grad": v.grad}


def elementwise_broadcast(A):
    D, m = A.D, mesh22(A.D)
    x = D.shard_tensor(t(X86, False), m, _pls(D, "S0,S1"))
    b = D.shard_tensor(t(W64[:, 0].copy(), False), m, _pls(D, "R,S0"))     # [6] split over mp
    c = D.shard_tensor(t(X86[:, :1].copy(), False), m, _pls(D, "S0,R"))    # [8, 1] split over dp
    z = paddle.tanh(x + b) * c - x * 0.5
    z.sum().backward()
    return {"z": z, "x.grad": x.grad, "b.grad": b.grad, "c.grad": c.grad}


def reductions4(A):
    D, m = A.D, mesh22(A.D)
    x = D.shard_tensor(t(X86, False), m, _pls(D, "S0,S1"))
    y = D.shard_tensor(t(X86, False), m, _pls(D, "S0,S0"))
    out = {"sum": x.sum(), "sum0": x.sum(axis=0), "sum1": x.sum(axis=1), "mean": x.mean(), "max1": x.max(axis=1),
           "ymean0": y.mean(axis=0), "ysum": y.sum()}
    (out["sum"] + out["sum1"].sum() * 0.5 + out["max1"].sum() + out["ymean0"].sum()).backward()
    out.update({"x.grad": x.grad, "y.grad": y.grad})
    return out


def reductions4_uneven(A):
    D, m = A.D, mesh22(A.D)
    y = D.shard_tensor(t(A73), m, _pls(D, "S0,S1"))             # 4 + 3 rows, 2 + 1 columns
    return {"ysum1": y.sum(axis=1), "ysum0": y.sum(axis=0), "ysum": y.sum(), "ymax0": y.max(axis=0)}


def mean4_uneven(A):
    D, m = A.D, mesh22(A.D)
    y = D.shard_tensor(t(A73), m, _pls(D, "S0,S1"))
    return {"ymean": y.mean(), "ymean1": y.mean(axis=1), "ymean0": y.mean(axis=0)}


def reductions4_S0S0_uneven(A):
    D, m = A.D, mesh22(A.D)
    x = D.shard_tensor(t(A73), m, _pls(D, "S0,S0"))             # 7 rows over 4 ranks: 2, 2, 2, 1
    return {"sum0": x.sum(axis=0), "sum": x.sum(), "mean": x.mean(), "mean0": x.mean(axis=0),
            "max1": x.max(axis=1)}


reductions4_S0S0_uneven.paddle_skip = SKIP_S0S0


def softmax_vocab(A):
    D, m = A.D, mesh22(A.D)
    x = D.shard_tensor(t(LG86, False), m, _pls(D, "S0,S1"))
    a = F.softmax(x, axis=-1)
    (a * a).sum().backward()
    return {"softmax": a, "x.grad": x.grad}


def cross_entropy_vocab(A):
    D, m = A.D, mesh22(A.D)
    lg = D.shard_tensor(t(LG86, False), m, _pls(D, "S0,S1"))
    lb = D.shard_tensor(t(LB8), m, _pls(D, "S0,R"))
    loss = F.cross_entropy(lg, lb)
    loss.backward()
    return {"loss": loss, "lg.grad": lg.grad}


def embedding_vocab(A):
    D, m = A.D, mesh22(A.D)
    ids = D.shard_tensor(t(IDS42), m, _pls(D, "S0,R"))
    w = D.shard_tensor(t(EMB16, False), m, _pls(D, "R,S0"))
    e = F.embedding(ids, w)
    (e * e).sum().backward()
    return {"e": e, "w.grad": w.grad}


def layer_norm4(A):
    D, m = A.D, mesh22(A.D)
    x = D.shard_tensor(t(X86, False), m, _pls(D, "S0,R"))
    ln = paddle.nn.LayerNorm(6)
    y = ln(x)
    (y * y * paddle.to_tensor(W64[:, 0])).sum().backward()
    return {"y": y, "x.grad": x.grad, "ln.weight.grad": ln.weight.grad, "ln.bias.grad": ln.bias.grad}


# ---- local tensors --------------------------------------------------------------------------------------------
def _coords(m):
    ids = np.asarray(m.process_ids).reshape(m.shape)
    return [int(c) for c in np.argwhere(ids == _rank())[0]]


def from_local4(A):
    D, m = A.D, mesh22(A.D, True)
    i, j = _coords(m)
    x = A.from_local(t(A84[4 * i:4 * i + 4, 2 * j:2 * j + 2]), m, _pls(D, "S0,S1"))
    p = A.from_local(t(A84[:, 2 * j:2 * j + 2] * (i + 1)), m, _pls(D, "P,S1"))
    s = A.from_local(t(A84[2 * (2 * i + j):2 * (2 * i + j) + 2]), m, _pls(D, "S0,S0"))
    return {"x": (x, True), "p": (p, True), "s": (s, True), "x.local": A.to_local(x, m, _pls(D, "S0,S1")),
            "pR": (D.reshard(p, m, _pls(D, "R,R")), True)}


def from_local4_uneven(A):
    D, m = A.D, mesh22(A.D)
    i, j = _coords(m)
    k = 2 * i + j
    s = A.from_local(t(A73[2 * k:min(2 * k + 2, 7)]), m, _pls(D, "S0,S0"))         # 2, 2, 2, 1 rows
    rows = A73[:4] if i == 0 else A73[4:]
    x = A.from_local(t(rows[:, :2] if j == 0 else rows[:, 2:]), m, _pls(D, "S0,S1"))  # 4 + 3 rows, 2 + 1 cols
    return {"s": (s, True), "x": (x, True), "x.local": A.to_local(x, m, _pls(D, "S0,S1"))}


from_local4_uneven.paddle_skip = ("paddle's dtensor_from_local takes the global shape to be the local one times "
                                  "the mesh dims' sizes (each rank its own), and the next collective hangs")


def from_local4_not_a_layout(A):
    D, m = A.D, mesh22(A.D)
    i, j = _coords(m)
    k = 2 * i + j
    rows = A73[[0], :] if k == 0 else A73[1 + 2 * (k - 1):3 + 2 * (k - 1)]           # 1, 2, 2, 2 rows
    return {"s": (A.from_local(t(rows), m, _pls(D, "S0,S0")), True)}


from_local4_not_a_layout.paddle_skip = from_local4_uneven.paddle_skip


def unshard4(A):
    D, m = A.D, mesh22(A.D, True)
    out = {c: D.unshard_dtensor(D.shard_tensor(t(A73), m, _pls(D, c))) for c in ("S0,S1", "P,S1")}
    return {**out, "S0,S0": D.unshard_dtensor(D.shard_tensor(t(A84), m, _pls(D, "S0,S0")))}   # (uneven: SKIP_S0S0)


def sub_meshes(A):
    D, m = A.D, mesh22(A.D)
    mt = m.get_mesh_with_dim("mp")                                   # [[0, 2], [1, 3]], dims (mp, dp)
    out = {"mt": (D.shard_tensor(t(A84), mt, _pls(D, "S0,S1")), True),
           "mt_ids": [float(i) for i in mt.process_ids], "m0_ids": [float(i) for i in m[0].process_ids],
           "mp0_ids": [float(i) for i in m.get_mesh_with_dim("mp", 0).process_ids]}
    sub = m[0] if _rank() in (0, 1) else m[1]                        # each rank's own row: [0, 1] or [2, 3]
    out["row"] = (D.shard_tensor(t(A73 * (1 + _rank() // 2)), sub, [D.Shard(0)]), True)
    return out


# ---- layers, optimizer, loader, parallelize -------------------------------------------------------------------
def _fit4(A, perm):
    """An MLP, fc1 column- / fc2 row-parallel over "mp", the batch over "dp": AdamW + global-norm clip, 3 steps."""
    D, m = A.D, mesh22(A.D, perm)

    def shard_fn(name, layer, mesh):
        if name == "fc1":
            layer.weight = D.shard_tensor(layer.weight, mesh, _pls(D, "R,S1"))
            layer.bias = D.shard_tensor(layer.bias, mesh, _pls(D, "R,S0"))
        elif name == "fc2":
            layer.weight = D.shard_tensor(layer.weight, mesh, _pls(D, "R,S0"))
    paddle.seed(5)
    model = D.shard_layer(MLP(), m, shard_fn)
    opt = D.shard_optimizer(paddle.optimizer.AdamW(0.05, parameters=model.parameters(), weight_decay=0.1,
                                                   grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5)))
    losses = []
    for x, y in BATCHES:
        xin, yin = (D.shard_tensor(paddle.to_tensor(v), m, _pls(D, "S0,R")) for v in (x, y))
        loss = F.mse_loss(model(xin), yin)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return {"losses": losses, **params(model)}


def dp_tp_adamw_clip(A):
    return _fit4(A, False)


def dp_tp_adamw_clip_perm(A):
    return _fit4(A, True)


def shard_dataloader_dp(A):
    D, m = A.D, mesh22(A.D)
    dl = D.shard_dataloader(paddle.io.DataLoader(Rows(), batch_size=4, shuffle=False), m, shard_dims="dp")
    out = {}
    for i, (x, y) in enumerate(dl):
        out[f"x{i}"], out[f"y{i}"] = (x, True), (y, True)
    return out


def parallelize_llama_dp_mp(A):
    """paddle's ``parallelize`` of a PaddleFormers Llama: dp 2 x mp 2, q/k/v/gate/up column, o/down row."""
    D = A.D
    model, opt, plan = llama_and_plan(D, 1)
    mesh = mesh22(D)
    model, opt = D.parallelize(model, opt, mesh, {"mp_config": {"parallelize_plan": plan},
                                                  "dp_config": {"sharding_level": 0}})
    return train_llama(model, opt, [D.shard_tensor(paddle.to_tensor(ids), mesh, _pls(D, "S0,R")) for ids in IDS])


def tp_only_rows(A):
    """The 2-rank shard_fn of vs_paddle_native_training (1-D placements) over each row of the 2 x 2 mesh."""
    D, m = A.D, mesh22(A.D)
    sub = m[0] if _rank() in (0, 1) else m[1]
    paddle.seed(5)
    model = D.shard_layer(MLP(), sub, tp_fn(D))
    x = D.shard_tensor(paddle.to_tensor(BATCHES[_rank() // 2][0]), sub, [D.Replicate()])
    loss = F.mse_loss(model(x), paddle.to_tensor(BATCHES[_rank() // 2][1]))
    loss.backward()
    return {"loss": loss, **params(model), **{n + ".grad": A.grad(p) for n, p in model.named_parameters()}}


PROGRAMS = (
    [_shard(False, A73, "", UNEVEN_PAIRS), _shard(True, A73, "_perm", UNEVEN_PAIRS), _shard(False, A84, "_even"),
     _shard(True, A84, "_even_perm"), SHARD_S0S0_UNEVEN]
    + [_reshard(s, d) for s, d in RESHARDS]
    + [_reshard(s, d, A73) for s, d in RESHARDS[:8]]
    + [_reshard(s, d, perm=True) for s, d in RESHARDS[:6]]
    + [matmul_dp_tp, matmul_dp_tp_perm, elementwise_broadcast, reductions4, reductions4_uneven, mean4_uneven,
       reductions4_S0S0_uneven, softmax_vocab, cross_entropy_vocab, embedding_vocab, layer_norm4, from_local4,
       from_local4_uneven, from_local4_not_a_layout, unshard4, sub_meshes, dp_tp_adamw_clip, dp_tp_adamw_clip_perm,
       shard_dataloader_dp, parallelize_llama_dp_mp, tp_only_rows]
)

ORACLES = {"from_local4_uneven": lambda: {"s": A73, "x": A73}, "shard_tensor_2x2_S0S0": lambda: {"S0S0": A73},
           "reductions4_S0S0_uneven": lambda: {"sum0": A73.sum(0), "sum": A73.sum(), "mean": A73.mean(),
                                               "mean0": A73.mean(0), "max1": A73.max(1)}}
ORACLES["mean4_uneven"] = lambda: {"ymean": A73.mean(), "ymean1": A73.mean(1), "ymean0": A73.mean(0)}
# paddle 3.3.1 on CPU raises here (gloo has no reduce_scatter kernel): ours is checked against numpy
PADDLE_RAISES = {"reshard4_PS1_to_S0S1": "Unimplemented cpu kernel for CReduceScatterOp"}
# paddle's value is wrong: the mean of uneven shards (4 + 3 rows, 2 + 1 columns) averages the ranks' means
PADDLE_WRONG = {"mean4_uneven"}
OURS_DIFFER = {"from_local4_not_a_layout": "ours raises ValueError on every rank (paddle not run: it hangs)"}
