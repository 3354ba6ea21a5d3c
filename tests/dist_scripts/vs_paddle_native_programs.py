"""The user programs of vs_paddle_native_worker.py, written once for both APIs: ``A.D`` is the module the user
imports as ``dist`` (``paddle.distributed`` or ``autoparallel``). Each returns {name: tensor or number}, a
``(tensor, True)`` pair marking a tensor the user placed explicitly (its local shard must agree too)."""
import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

A73 = np.arange(21, dtype="float32").reshape(7, 3) - 10.0          # 7 rows over 2 ranks: 4 and 3
RNG = np.random.default_rng(7)
EMB = RNG.standard_normal((8, 4)).astype("float32")


def mesh1(D):
    return D.ProcessMesh([0, 1], dim_names=["x"])


def mesh2(D, rows=False):
    return D.ProcessMesh([[0], [1]] if rows else [[0, 1]], dim_names=["a", "b"])


def pl(D, code):
    """``R``, ``S0``, ``S1``, ``S-1``, ``P``, ``Pavg``, ``Pmax`` -> the API's placement."""
    if code == "R":
        return D.Replicate()
    if code.startswith("S"):
        dim = int(code[1:])
        if dim < 0 and D is paddle.distributed:       # paddle 3.3.1's shard_tensor segfaults on Shard(-1) (C++
            dim += 2                                  # ToTensorDistAttr): its program is the S(1) it means
        return D.Shard(dim)
    return D.Partial({"P": D.ReduceType.kRedSum, "Pavg": D.ReduceType.kRedAvg, "Pmax": D.ReduceType.kRedMax}[code])


def t(a, stop_gradient=True):
    return paddle.to_tensor(a, stop_gradient=stop_gradient)


# ---- shard_tensor ---------------------------------------------------------------------------------------------
def _shard_1d(codes):
    def program(A):
        D = A.D
        return {c: (D.shard_tensor(t(A73), mesh1(D), [pl(D, c)]), True) for c in codes}
    program.__name__ = "shard_tensor_1d_" + "_".join(c.replace("-", "m") for c in codes)
    return program


def _shard_2d(rows, pairs):
    def program(A):
        D = A.D
        return {"".join(p): (D.shard_tensor(t(A73), mesh2(D, rows), [pl(D, c) for c in p]), True) for p in pairs}
    program.__name__ = f"shard_tensor_2d_{'2x1' if rows else '1x2'}"
    return program


def shard_tensor_inputs(A):
    D, m = A.D, mesh1(A.D)
    x = D.shard_tensor(A73, m, [D.Shard(0)])                              # an ndarray
    y = D.shard_tensor(A73.tolist(), m, [D.Shard(1)])                     # a nested list
    z = D.shard_tensor(t(A73), m, [D.Shard(0)], stop_gradient=False)
    w = D.shard_tensor(nn.Linear(3, 5).weight, m, [D.Shard(1)])           # a parameter
    return {"ndarray": (x, True), "list": (y, True), "z": (z, True), "z.stop_gradient": float(z.stop_gradient),
            "param": (w, True), "param.trainable": float(not w.stop_gradient)}


# ---- reshard --------------------------------------------------------------------------------------------------
A84 = np.arange(32, dtype="float32").reshape(8, 4) * 0.5 - 7.0      # even: 4 rows / 2 columns a rank


def _reshard(src, dst, rows=None, a=A84):
    def program(A):
        D = A.D
        m = mesh1(D) if rows is None else mesh2(D, rows)
        x = D.shard_tensor(t(a), m, [pl(D, c) for c in src.split(",")])
        return {"out": (D.reshard(x, m, [pl(D, c) for c in dst.split(",")]), True)}
    tag = "" if rows is None else "_2d"
    tag += "_uneven" if a is A73 else ""
    tag = tag.replace("_2d", "_2x1" if rows else "_1x2")
    program.__name__ = f"reshard_{src.replace(',', '')}_to_{dst.replace(',', '')}{tag}"
    program.expect = a                      # the global value of every reshard (a Partial input: rank 0 holds it)
    return program


def reshard_backward(A):
    D, m = A.D, mesh1(A.D)
    x = D.shard_tensor(t(A84, False), m, [D.Shard(0)])
    y = D.reshard(x, m, [D.Replicate()])
    (y * y).sum().backward()
    return {"y": (y, True), "x.grad": x.grad}


# ---- ops on sharded inputs -----------------------------------------------------------------------------------
X86 = RNG.standard_normal((8, 6)).astype("float32")
W46 = RNG.standard_normal((4, 6)).astype("float32")
LG86 = RNG.standard_normal((8, 6)).astype("float32")
LB8 = np.array([[0], [4], [2], [1], [3], [0], [2], [5]], dtype="int64")


def elementwise(A):
    D, m = A.D, mesh1(A.D)
    x = D.shard_tensor(t(A84, False), m, [D.Shard(0)])
    y = D.shard_tensor(t(A84[:1] * 0.5, False), m, [D.Replicate()])
    z = paddle.tanh(x * 0.1) + y * 2 - paddle.exp(x * 0.05)
    z.sum().backward()
    return {"z": z, "x.grad": x.grad, "y.grad": y.grad}


def partial_inputs(A):
    D, m = A.D, mesh1(A.D)
    p = D.shard_tensor(t(A84), m, [D.Partial()])
    r = D.shard_tensor(t(A84 * 0.5), m, [D.Replicate()])
    w = D.shard_tensor(t(W46), m, [D.Replicate()])
    return {"p+r": p + r, "p*2": p * 2, "p@w": paddle.matmul(p, w), "sum(p)": p.sum(), "relu(p)": F.relu(p)}


def _matmul(xp, wp):
    def program(A):
        D, m = A.D, mesh1(A.D)
        x = D.shard_tensor(t(A84, False), m, [pl(D, xp)])
        w = D.shard_tensor(t(W46, False), m, [pl(D, wp)])
        y = paddle.matmul(x, w)
        (y * y).mean().backward()
        return {"y": y, "x.grad": x.grad, "w.grad": w.grad}
    program.__name__ = f"matmul_{xp}_{wp}"
    return program


def reductions(A):
    D, m = A.D, mesh1(A.D)
    x = D.shard_tensor(t(A84, False), m, [D.Shard(0)])
    y = D.shard_tensor(t(A84, False), m, [D.Shard(1)])
    out = {"sum": x.sum(), "sum0": x.sum(axis=0), "mean1": x.mean(axis=1), "max0": x.max(axis=0),
           "ymean": y.mean(), "ymax1": y.max(axis=1, keepdim=True), "yprod0": paddle.prod(y * 0.1, axis=0)}
    (out["sum"] + out["mean1"].sum() + out["ymax1"].sum() + out["yprod0"].sum()).backward()
    out.update({"x.grad": x.grad, "y.grad": y.grad})
    return out


def mean_uneven(A):
    D, m = A.D, mesh1(A.D)
    y = D.shard_tensor(t(A73), m, [D.Shard(1)])                           # 2 columns and 1
    x = D.shard_tensor(t(A73), m, [D.Shard(0)])                           # 4 rows and 3
    return {"mean": y.mean(), "mean0": y.mean(axis=0), "rows_mean0": x.mean(axis=0), "rows_var0": x.var(axis=0),
            "rows_sum": x.sum()}


def cross_entropy_uneven(A):
    D, m = A.D, mesh1(A.D)
    lg = D.shard_tensor(t(LG86[:7], False), m, [D.Shard(0)])             # 4 rows and 3
    loss = F.cross_entropy(lg, D.shard_tensor(t(LB8[:7]), m, [D.Shard(0)]))
    loss.backward()
    return {"loss": loss, "lg.grad": lg.grad}


def _ce_oracle():
    z = LG86[:7].astype("float64")
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    onehot = np.eye(6)[LB8[:7, 0]]
    return {"loss": -np.log((p * onehot).sum(1)).mean(), "lg.grad": (p - onehot) / 7}


def _softmax(code, axis):
    def program(A):
        D, m = A.D, mesh1(A.D)
        x = D.shard_tensor(t(X86, False), m, [pl(D, code)])
        a = F.softmax(x, axis=axis)
        (a * a).sum().backward()
        return {"softmax": a, "x.grad": x.grad}
    program.__name__ = f"softmax_{code}_axis{axis}"
    return program


def cross_entropy(A):
    D, m = A.D, mesh1(A.D)
    lg = D.shard_tensor(t(LG86, False), m, [D.Shard(0)])
    lb = D.shard_tensor(t(LB8), m, [D.Shard(0)])
    loss = F.cross_entropy(lg, lb)
    loss.backward()
    return {"loss": loss, "lg.grad": lg.grad}


def cross_entropy_class_split(A):
    D, m = A.D, mesh1(A.D)
    lg = D.shard_tensor(t(LG86, False), m, [D.Shard(1)])
    loss = F.cross_entropy(lg, D.shard_tensor(t(LB8), m, [D.Replicate()]), reduction="sum")
    loss.backward()
    return {"loss": loss, "lg.grad": lg.grad}


def _embedding(code, ids_code="R"):
    def program(A):
        D, m = A.D, mesh1(A.D)
        ids = D.shard_tensor(t(IDS4), m, [pl(D, ids_code)])
        w = D.shard_tensor(t(EMB, False), m, [pl(D, code)])
        e = F.embedding(ids, w)
        (e * e).sum().backward()
        return {"e": e, "w.grad": w.grad}
    program.__name__ = f"embedding_w{code}_ids{ids_code}"
    return program


IDS4 = np.array([[1, 7, 3], [0, 5, 5], [2, 2, 6], [7, 4, 0]], dtype="int64")


def layer_norm(A):
    D, m = A.D, mesh1(A.D)
    x = D.shard_tensor(t(X86, False), m, [D.Shard(0)])
    ln = nn.LayerNorm(6)
    y = ln(x)
    (y * y * paddle.to_tensor(W46[0])).sum().backward()
    return {"y": y, "x.grad": x.grad, "ln.weight.grad": ln.weight.grad, "ln.bias.grad": ln.bias.grad}


def _op(name, fn, code, a=None):
    def program(A):
        D, m = A.D, mesh1(A.D)
        x = D.shard_tensor(t(X86 if a is None else a, False), m, [pl(D, code)])
        y = fn(x)
        (y * y).sum().backward()
        return {"y": y, "x.grad": x.grad}
    program.__name__ = f"op_{name}_{code}"
    return program


OPS = [("reshape_rows", lambda x: x.reshape([4, 12]), "S0"), ("reshape_flat", lambda x: x.reshape([48]), "S1"),
       ("transpose", lambda x: x.T, "S0"), ("slice", lambda x: x[1:6, 2:], "S0"), ("slice", lambda x: x[:, 1:4], "S1"),
       ("concat0", lambda x: paddle.concat([x, x * 2], axis=0), "S0"),
       ("concat1", lambda x: paddle.concat([x, x * 2], axis=1), "S0"),
       ("cumsum0", lambda x: paddle.cumsum(x, axis=0), "S0"), ("cumsum1", lambda x: paddle.cumsum(x, axis=1), "S0"),
       ("gelu", F.gelu, "S1"), ("norm", lambda x: paddle.linalg.norm(x), "S0"),
       ("where", lambda x: paddle.where(x > 0, x, x * 0.1), "S1"),
       ("logsumexp", lambda x: paddle.logsumexp(x, 1), "S1"),
       ("exp_partial", paddle.exp, "P"), ("square_partial", lambda x: x * x, "P"),
       ("gather", lambda x: paddle.gather(x, paddle.to_tensor([5, 0, 3]), axis=0), "S0"),
       ("unsqueeze", lambda x: x.unsqueeze(0).sum(axis=1), "S0"), ("var", lambda x: paddle.var(x, axis=0), "S0"),
       ("stack", lambda x: paddle.stack([x, x + 1], axis=1), "S1"), ("split", lambda x: paddle.split(x, 2, 0)[1], "S0"),
       ("sum_uneven", lambda x: x[:, :5].sum(axis=1), "S1")]
ORACLES = {"op_norm_S0": lambda: {"y": np.linalg.norm(X86)},
           "op_logsumexp_S1": lambda: {"y": np.log(np.exp(X86.astype("float64")).sum(1))},
           "mean_uneven": lambda: {"mean": A73.mean(), "mean0": A73.mean(0), "rows_mean0": A73.mean(0),
                                   "rows_var0": A73.var(0, ddof=1), "rows_sum": A73.sum()},
           "cross_entropy_uneven": lambda: _ce_oracle(),
           "shard_tensor_1d_Pavg_Pmax": lambda: {"Pavg": A73, "Pmax": A73},
           "matmul_S0_S1": lambda: {"y": A84 @ W46},
           "op_concat0_S0": lambda: {"y": np.concatenate([X86, X86 * 2], axis=0)},
           "empty_shard": lambda: {"x": A84[:1], "y": A84[:1].sum(1) * 2, "x.grad": np.full((1, 4), 2.0),
                                   "xR": A84[:1]},
           "cross_mesh": lambda rank: {"mine": A84 * (rank + 1)},
           "from_local_uneven": lambda: {"x": A73}}


def argmax_topk(A):
    D, m = A.D, mesh1(A.D)
    x = D.shard_tensor(t(X86), m, [D.Shard(1)])
    v, i = paddle.topk(x, 2, axis=1)
    return {"argmax1": paddle.argmax(x, axis=1), "argmax0": paddle.argmax(x, axis=0), "topk.v": v, "topk.i": i}


def partial_pairs(A):
    D, m = A.D, mesh1(A.D)
    p = D.shard_tensor(t(A84), m, [D.Partial()])
    q = D.shard_tensor(t(A84 * 0.25), m, [D.Partial()])
    r = D.shard_tensor(t(A84 * 0.5), m, [D.Replicate()])
    return {"p+q": p + q, "p*r": p * r, "p-q": p - q, "p.mean": p.mean(), "p.max": p.max()}


def shard_tensor_dtype(A):
    D, m = A.D, mesh1(A.D)
    x = D.shard_tensor(A84, m, [D.Shard(0)], dtype="float64")
    y = D.shard_tensor(t(A84), m, [D.Shard(1)], dtype="float64")
    return {"x": (x, True), "y": (y, True), "x.dtype64": float(str(x.dtype).endswith("float64")),
            "y.dtype64": float(str(y.dtype).endswith("float64"))}


def partial_leaf_grad(A):
    D, m = A.D, mesh1(A.D)
    p = D.shard_tensor(t(A84, False), m, [D.Partial()])
    y = paddle.tanh(p * 0.1) * 3
    y.sum().backward()
    return {"y": y, "p.grad": p.grad}


def empty_shard(A):
    D, m = A.D, mesh1(A.D)
    x = D.shard_tensor(t(A84[:1], False), m, [D.Shard(0)])           # 1 row over 2 ranks: rank 1 holds none
    y = (x * 2).sum(axis=1)
    y.sum().backward()
    return {"x": (x, True), "y": y, "x.grad": x.grad, "xR": (D.reshard(x, m, [D.Replicate()]), True)}


def cross_mesh(A):
    D = A.D
    m0, m1 = D.ProcessMesh([0], dim_names=["x"]), D.ProcessMesh([1], dim_names=["x"])
    x = D.shard_tensor(t(A84, False), m0, [D.Replicate()])
    y = D.reshard(x * 2, m1, [D.Replicate()])
    return {"mine": A.local(x if _rank() == 0 else y)}              # each rank reads the tensor on its mesh


def short_placements(A):
    D = A.D
    m = mesh2(D, rows=True)
    x = D.shard_tensor(t(A84), m, [D.Shard(1)])                       # one placement for a 2-D mesh
    return {"x": (x, True), "y": (D.reshard(x, m, [D.Shard(0)]), True)}


def _bad(name, fn):
    def program(A):
        return {"out": fn(A.D, A)}
    program.__name__ = f"bad_{name}"
    return program


BAD = [_bad("too_many_placements", lambda D, A: D.shard_tensor(t(A84), mesh1(D), [D.Shard(0), D.Shard(1)])),
       _bad("shard_dim_out_of_range", lambda D, A: D.shard_tensor(t(A84), mesh1(D), [D.Shard(2)])),
       _bad("mesh_not_a_mesh", lambda D, A: D.shard_tensor(t(A84), [0, 1], [D.Shard(0)])),
       _bad("reshard_plain_tensor", lambda D, A: D.reshard(t(A84), mesh1(D), [D.Shard(0)])),
       _bad("to_local_other_placements", lambda D, A: A.to_local(
           D.shard_tensor(t(A84), mesh1(D), [D.Shard(0)]), mesh1(D), [D.Shard(1)])),
       _bad("placement_not_a_placement", lambda D, A: D.shard_tensor(t(A84), mesh1(D), ["x"])),
       _bad("mesh_dim_names_mismatch", lambda D, A: D.ProcessMesh([0, 1], dim_names=["a", "b"]))]


def cross_entropy_ignore_index(A):
    D, m = A.D, mesh1(A.D)
    lb = LB8.copy()
    lb[[0, 1, 2]] = -100                                   # 3 of rank 0's 4 rows ignored, none of rank 1's
    lg = D.shard_tensor(t(LG86, False), m, [D.Shard(0)])
    loss = F.cross_entropy(lg, D.shard_tensor(t(lb), m, [D.Shard(0)]), ignore_index=-100)
    loss.backward()
    return {"loss": loss, "lg.grad": lg.grad}


def dtypes(A):
    D, m = A.D, mesh1(A.D)
    i = D.shard_tensor(t(np.arange(8, dtype="int64").reshape(4, 2)), m, [D.Shard(0)])
    x = D.shard_tensor(t(A84), m, [D.Shard(1)])
    return {"i": (i, True), "i*3": i * 3, "cast": x.astype("float64"), "bool": (x > 0).astype("float32"),
            "isum": i.sum()}


def from_local_partial_avg(A):
    D, m, r = A.D, mesh1(A.D), _rank()
    p = A.from_local(t(A84 * (r + 1)), m, [D.Partial(D.ReduceType.kRedAvg)])
    return {"p": (p, True), "pR": (D.reshard(p, m, [D.Replicate()]), True)}


# ---- local tensors -------------------------------------------------------------------------------------------
def _rank():
    return paddle.distributed.get_rank()


def from_local_round_trip(A):
    D, m, r = A.D, mesh1(A.D), _rank()
    loc = t(A73[:6].reshape(2, 3, 3)[r])                                  # 3 rows each: even
    x = A.from_local(loc, m, [D.Shard(0)])
    rep = A.from_local(t(A73[:2]), m, [D.Replicate()])
    par = A.from_local(t(A73[:2] * (r + 1)), m, [D.Partial()])
    back = A.to_local(x, m, [D.Shard(0)])
    return {"x": (x, True), "rep": (rep, True), "par": (par, True), "back": back,
            "par_to_R": (D.reshard(par, m, [D.Replicate()]), True)}


def from_local_uneven(A):
    D, m, r = A.D, mesh1(A.D), _rank()
    loc = t(A73[:4] if r == 0 else A73[4:])
    return {"x": (A.from_local(loc, m, [D.Shard(0)]), True)}


def from_local_not_a_layout(A):
    D, m, r = A.D, mesh1(A.D), _rank()
    return {"x": (A.from_local(t(A73[:3] if r == 0 else A73[3:]), m, [D.Shard(0)]), True)}   # 3 and 4 rows


from_local_not_a_layout.paddle_skip = from_local_uneven.paddle_skip = (
    "paddle's dtensor_from_local takes the global shape to be the local one times the mesh size: rank 0 says "
    "[8, 3], rank 1 [6, 3], and the next collective hangs")


def unshard(A):
    D, m = A.D, mesh1(A.D)
    return {"S0": D.unshard_dtensor(D.shard_tensor(t(A73), m, [D.Shard(0)])),
            "S1": D.unshard_dtensor(D.shard_tensor(t(A73), m, [D.Shard(1)])),
            "P": D.unshard_dtensor(D.shard_tensor(t(A73), m, [D.Partial()]))}


def local_map_partial(A):
    D, m = A.D, mesh1(A.D)
    x = D.shard_tensor(t(A73), m, [D.Shard(0)])
    s = D.local_map(lambda a: a.sum(axis=0), [[D.Partial()]], [[D.Shard(0)]], m)(x)
    return {"s": (s, True), "s_R": (D.reshard(s, m, [D.Replicate()]), True)}


from vs_paddle_native_training import TRAINING, TRAINING_ORACLES       # noqa: E402  (layer / optimizer programs)

ORACLES.update(TRAINING_ORACLES)

CODES = ("R", "S0", "S1", "P")
PROGRAMS = (
    [_shard_1d(["S0", "S1", "R", "P"]), _shard_1d(["S-1"]), _shard_1d(["Pavg", "Pmax"]),
     _shard_2d(False, [("R", "S0"), ("S0", "S1"), ("S1", "S0"), ("P", "S0"), ("S0", "P"), ("S0", "S0")]),
     _shard_2d(True, [("S0", "R"), ("S1", "S0"), ("S0", "S1"), ("P", "S1"), ("S0", "S0")]), shard_tensor_inputs]
    + [_reshard(s, d) for s in CODES for d in CODES]
    + [_reshard(s, d, a=A73) for s in CODES for d in CODES if s != d]
    + [_reshard("Pavg", "R"), _reshard("Pavg", "S0"), _reshard("Pmax", "R"), _reshard("R", "Pavg"),
       _reshard("R", "Pmax"), _reshard("S0", "Pavg"),
       _reshard("S0,R", "R,S1", rows=True), _reshard("S0,R", "R,R", rows=True), _reshard("S0,R", "S1,S0", rows=True),
       _reshard("P,S1", "R,R", rows=True), _reshard("P,S1", "S0,S1", rows=True), reshard_backward]
    + [elementwise, partial_inputs, _matmul("S1", "S0"), _matmul("S0", "R"), _matmul("R", "S1"), _matmul("S0", "S1"),
       reductions, mean_uneven, cross_entropy_uneven, _softmax("S0", -1), _softmax("S1", -1), _softmax("S0", 0),
       cross_entropy, cross_entropy_class_split, _embedding("S0"), _embedding("S1"), _embedding("R", "S0"), layer_norm]
    + [_op(*o) for o in OPS] + [argmax_topk, partial_pairs, shard_tensor_dtype, partial_leaf_grad, empty_shard,
       cross_mesh, short_placements, cross_entropy_ignore_index, dtypes, from_local_partial_avg] + BAD
    + [_reshard("S0,S1", d, rows=False) for d in ("R,R", "S1,S0", "R,S0", "P,S1")]
    + [from_local_round_trip, from_local_uneven, from_local_not_a_layout, unshard, local_map_partial]
    + TRAINING
)
empty_shard.paddle_skip = "paddle 3.3.1 aborts the process (SIGABRT) on the rank holding an empty shard"
cross_mesh.paddle_skip = "paddle 3.3.1's reshard between meshes segfaults on CPU (SameStatusReshardFunction)"
BAD[1].paddle_skip = "paddle 3.3.1's shard_tensor segfaults on a Shard dim past the tensor's rank (ToTensorDistAttr)"
