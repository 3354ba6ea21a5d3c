"""Layer, optimizer, loader and ``parallelize`` programs of vs_paddle_native_worker.py (see
vs_paddle_native_programs.py for the form of a program)."""
import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

RNG = np.random.default_rng(11)
BATCHES = [(RNG.standard_normal((4, 6)).astype("float32"), RNG.standard_normal((4, 4)).astype("float32"))
           for _ in range(3)]
X248 = RNG.standard_normal((2, 4, 8)).astype("float32")


class MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def mesh1(D, names=("x",)):
    return D.ProcessMesh([0, 1], dim_names=list(names))


def tp_fn(D):
    def shard_fn(name, layer, mesh):
        if name == "fc1":
            layer.weight = D.shard_tensor(layer.weight, mesh, [D.Shard(1)])
            layer.bias = D.shard_tensor(layer.bias, mesh, [D.Shard(0)])
        elif name == "fc2":
            layer.weight = D.shard_tensor(layer.weight, mesh, [D.Shard(0)])
    return shard_fn


def params(model, explicit=("fc1.weight", "fc1.bias", "fc2.weight")):
    return {n: (p, n in explicit) for n, p in model.named_parameters()}


def shard_layer_tp(A):
    D, m = A.D, mesh1(A.D)
    paddle.seed(5)
    model = D.shard_layer(MLP(), m, tp_fn(D))
    x = D.shard_tensor(paddle.to_tensor(BATCHES[0][0]), m, [D.Replicate()])
    out = model(x)
    loss = F.mse_loss(out, paddle.to_tensor(BATCHES[0][1]))
    loss.backward()
    res = {"out": out, "loss": loss, **params(model)}
    res.update({n + ".grad": A.grad(p) for n, p in model.named_parameters()})
    return res


def _fit(A, make_opt, shard_fn=None, batch_placement=None, steps=3):
    D, m = A.D, mesh1(A.D)
    paddle.seed(5)
    model = D.shard_layer(MLP(), m, shard_fn)
    opt = D.shard_optimizer(make_opt(model.parameters()))
    losses = []
    for x, y in BATCHES[:steps]:
        xin = D.shard_tensor(paddle.to_tensor(x), m, [batch_placement or D.Replicate()])
        yin = D.shard_tensor(paddle.to_tensor(y), m, [batch_placement or D.Replicate()])
        loss = F.mse_loss(model(xin), yin)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return {"losses": losses, **params(model, () if shard_fn is None else ("fc1.weight", "fc1.bias", "fc2.weight"))}


def optimizer_sgd_tp(A):
    return _fit(A, lambda ps: paddle.optimizer.SGD(0.1, parameters=ps), tp_fn(A.D))


def optimizer_adamw_clip_tp(A):
    return _fit(A, lambda ps: paddle.optimizer.AdamW(0.05, parameters=ps, weight_decay=0.1,
                                                     grad_clip=nn.ClipGradByGlobalNorm(0.5)), tp_fn(A.D))


def optimizer_sgd_clip_dp(A):
    return _fit(A, lambda ps: paddle.optimizer.SGD(0.1, parameters=ps, grad_clip=nn.ClipGradByGlobalNorm(0.3)),
                None, A.D.Shard(0))


def optimizer_adamw_dp(A):
    return _fit(A, lambda ps: paddle.optimizer.AdamW(0.05, parameters=ps, weight_decay=0.01), None, A.D.Shard(0))


def optimizer_momentum_dp(A):
    return _fit(A, lambda ps: paddle.optimizer.Momentum(0.1, parameters=ps, grad_clip=nn.ClipGradByGlobalNorm(0.3)),
                None, A.D.Shard(0))


class Rows(paddle.io.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.full([3], i, "float32"), np.array([i % 3], "int64")


def shard_dataloader(A):
    D, m = A.D, mesh1(A.D)
    loader = paddle.io.DataLoader(Rows(), batch_size=4, shuffle=False)
    dl = D.shard_dataloader(loader, m, shard_dims="x")
    out = {}
    for i, (x, y) in enumerate(dl):
        out[f"x{i}"], out[f"y{i}"] = (x, True), (y, True)
    return out


def _parallelize(A, mesh, config, shard_input, three_d=False):
    D = A.D
    paddle.seed(5)
    model = MLP()
    opt = paddle.optimizer.AdamW(0.05, parameters=model.parameters())
    model, opt = D.parallelize(model, opt, mesh, config)
    losses = []
    for x, y in BATCHES:
        xin, yin = paddle.to_tensor(x), paddle.to_tensor(y)
        if three_d:                     # [batch, seq, hidden]: paddle's gather_output handles 3-D outputs only
            xin, yin = xin.reshape([2, 2, 6]), yin.reshape([2, 2, 4])
        if shard_input:
            xin = D.shard_tensor(xin, mesh, [D.Shard(0)] + [D.Replicate()] * (mesh.ndim - 1))
            yin = D.shard_tensor(yin, mesh, [D.Shard(0)] + [D.Replicate()] * (mesh.ndim - 1))
        loss = F.mse_loss(model(xin), yin)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return {"losses": losses, **params(model, ())}


def parallelize_tp_plan(A):
    D = A.D
    plan = {"fc1": D.ColWiseParallel(), "fc2": D.RowWiseParallel()}
    return _parallelize(A, D.ProcessMesh([[0, 1]], dim_names=["dp", "mp"]), {"mp_config": {"parallelize_plan": plan}},
                        False)


def parallelize_plan_options(A):
    D = A.D
    plan = {"fc1": D.ColWiseParallel(gather_output=True), "fc2": D.RowWiseParallel(is_input_parallel=False)}
    return _parallelize(A, D.ProcessMesh([[0, 1]], dim_names=["dp", "mp"]), {"mp_config": {"parallelize_plan": plan}},
                        False, three_d=True)


def parallelize_dp2_plan(A):
    D = A.D
    plan = {"fc1": D.ColWiseParallel(), "fc2": D.RowWiseParallel()}
    return _parallelize(A, D.ProcessMesh([[0], [1]], dim_names=["dp", "mp"]),
                        {"mp_config": {"parallelize_plan": plan}, "dp_config": {"sharding_level": 0}}, True)


def parallelize_dp(A):
    D = A.D
    return _parallelize(A, D.ProcessMesh([0, 1], dim_names=["dp"]), {"dp_config": {"sharding_level": 0}}, True)


def shard_layer_io_fns(A):
    D, m = A.D, mesh1(A.D)
    paddle.seed(5)

    def input_fn(inputs, mesh):
        return D.shard_tensor(inputs[0], mesh, [D.Shard(0)])

    def output_fn(outputs, mesh):
        return D.reshard(outputs, mesh, [D.Replicate()])

    model = D.shard_layer(MLP(), m, tp_fn(D), input_fn=input_fn, output_fn=output_fn)
    out = model(paddle.to_tensor(BATCHES[1][0]))
    out.mean().backward()
    return {"out": (out, True), **{n + ".grad": A.grad(p) for n, p in model.named_parameters()}}


def dp_tp_2d(A):
    """A 2-D mesh [[0, 1]] (dp 1 x mp 2) and a [[0], [1]] one (dp 2 x mp 1): batch over dp, columns / rows over mp."""
    D = A.D
    out = {}
    for tag, ids in (("1x2", [[0, 1]]), ("2x1", [[0], [1]])):
        m = D.ProcessMesh(ids, dim_names=["dp", "mp"])
        paddle.seed(5)
        model = MLP()

        def shard_fn(name, layer, mesh):
            if name == "fc1":
                layer.weight = D.shard_tensor(layer.weight, mesh, [D.Replicate(), D.Shard(1)])
            elif name == "fc2":
                layer.weight = D.shard_tensor(layer.weight, mesh, [D.Replicate(), D.Shard(0)])
        model = D.shard_layer(model, m, shard_fn)
        opt = D.shard_optimizer(paddle.optimizer.SGD(0.1, parameters=model.parameters()))
        for x, y in BATCHES[:2]:
            pl = [D.Shard(0), D.Replicate()]
            xin, yin = D.shard_tensor(paddle.to_tensor(x), m, pl), D.shard_tensor(paddle.to_tensor(y), m, pl)
            loss = F.mse_loss(model(xin), yin)
            loss.backward()
            opt.step()
            opt.clear_grad()
            out[f"{tag}.loss{len(out)}"] = float(loss)
        out.update({f"{tag}.{n}": (p, n.endswith("weight")) for n, p in model.named_parameters()})
    return out


def to_local_grad(A):
    D, m = A.D, mesh1(A.D)
    x = D.shard_tensor(paddle.to_tensor(BATCHES[0][0], stop_gradient=False), m, [D.Shard(0)])
    loc = A.to_local(x * 2, m, [D.Shard(0)])
    (loc * loc).sum().backward()
    return {"local": loc, "x.grad": x.grad}


def unshard_param(A):
    D, m = A.D, mesh1(A.D)
    paddle.seed(5)
    model = D.shard_layer(MLP(), m, tp_fn(D))
    return {"fc1.weight": D.unshard_dtensor(model.fc1.weight), "fc2.weight": D.unshard_dtensor(model.fc2.weight)}


def local_map_reshard_inputs(A):
    D, m = A.D, mesh1(A.D)
    x = D.shard_tensor(paddle.to_tensor(BATCHES[0][0]), m, [D.Replicate()])
    f = D.local_map(lambda a: a * 3, [[D.Shard(1)]], [[D.Shard(1)]], m, reshard_inputs=True)
    return {"y": (f(x), True)}


def shard_dataloader_dict(A):
    D, m = A.D, mesh1(A.D)

    class Dicts(paddle.io.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"ids": np.full([3], i, "int64"), "mask": np.full([2], i * 0.5, "float32")}
    dl = D.shard_dataloader(paddle.io.DataLoader(Dicts(), batch_size=4, shuffle=False), m, input_keys=["ids", "mask"],
                            shard_dims="x")
    b = next(iter(dl))
    return {"ids": (b["ids"], True), "mask": (b["mask"], True)}


def param_reshard_grad(A):
    D, m = A.D, mesh1(A.D)
    paddle.seed(5)
    lin = nn.Linear(6, 4)
    lin.weight = D.shard_tensor(lin.weight, m, [D.Shard(1)])
    w2 = D.reshard(lin.weight, m, [D.Replicate()])
    x = D.shard_tensor(paddle.to_tensor(BATCHES[0][0]), m, [D.Replicate()])    # (S(0): paddle's reduce_scatter)
    y = paddle.matmul(x, w2) + lin.bias
    (y * y).mean().backward()
    return {"y": y, "w2": (w2, True), "weight.grad": A.grad(lin.weight), "bias.grad": A.grad(lin.bias)}


def accumulate_then_step(A):
    D, m = A.D, mesh1(A.D)
    paddle.seed(5)
    model = D.shard_layer(MLP(), m, tp_fn(D))
    opt = D.shard_optimizer(paddle.optimizer.AdamW(0.05, parameters=model.parameters()))
    xin = D.shard_tensor(paddle.to_tensor(BATCHES[0][0]), m, [D.Replicate()])
    for x, y in BATCHES[:2]:                              # two backwards, one step
        F.mse_loss(model(D.shard_tensor(paddle.to_tensor(x), m, [D.Replicate()])), paddle.to_tensor(y)).backward()
    grads = {n + ".grad": A.grad(p) * 1 for n, p in model.named_parameters()}     # copies: clear_grad frees them
    opt.step()
    opt.clear_grad(set_to_zero=False)
    out = model(xin)
    return {"out": out, **grads, **params(model)}


def state_dict_values(A):
    D, m = A.D, mesh1(A.D)
    paddle.seed(5)
    model = D.shard_layer(MLP(), m, tp_fn(D))
    return {"sd." + k: (v, k in ("fc1.weight", "fc1.bias", "fc2.weight")) for k, v in model.state_dict().items()}


def dtensor_from_fn(A):
    D, m = A.D, mesh1(A.D)
    return {"ones": (D.dtensor_from_fn(paddle.ones, m, [D.Shard(0)], shape=[7, 4]), True),
            "full": (D.dtensor_from_fn(paddle.full, m, [D.Shard(1)], shape=[2, 5], fill_value=3.0), True)}


def inplace_ops(A):
    D, m = A.D, mesh1(A.D)
    x = D.shard_tensor(paddle.to_tensor(BATCHES[0][0]), m, [D.Shard(0)])
    y = D.shard_tensor(paddle.to_tensor(BATCHES[1][0]), m, [D.Replicate()])
    x.add_(y)
    x.scale_(0.5)
    return {"x": (x, True)}


class Attention(nn.Layer):
    def __init__(self, hidden=8, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x):
        b, s, h = x.shape
        split = [b, s, self.heads, h // self.heads]
        q, k, v = (paddle.transpose(f(x).reshape(split), [0, 2, 1, 3]) for f in (self.q, self.k, self.v))
        a = F.softmax(paddle.matmul(q, k, transpose_y=True) / 2.0, axis=-1)
        y = paddle.transpose(paddle.matmul(a, v), [0, 2, 1, 3]).reshape([b, s, h])
        return self.norm(self.o(y) + x)


def attention_tp(A):
    D, m = A.D, mesh1(A.D)
    paddle.seed(5)

    def shard_fn(name, layer, mesh):
        if name in ("q", "k", "v"):
            layer.weight = D.shard_tensor(layer.weight, mesh, [D.Shard(1)])
            layer.bias = D.shard_tensor(layer.bias, mesh, [D.Shard(0)])
        elif name == "o":
            layer.weight = D.shard_tensor(layer.weight, mesh, [D.Shard(0)])
    model = D.shard_layer(Attention(), m, shard_fn)
    # SGD: the key bias's gradient is rounding noise (softmax ignores a per-row constant), which Adam would scale up
    opt = D.shard_optimizer(paddle.optimizer.SGD(0.5, parameters=model.parameters()))
    x = D.shard_tensor(paddle.to_tensor(X248), m, [D.Replicate()])
    losses = []
    for _ in range(2):
        y = model(x)
        loss = (y * y).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return {"y": y, "losses": losses, **{n: (p, n[0] in "qkvo" and n != "o.bias") for n, p in model.named_parameters()}}


IDS = np.random.default_rng(3).integers(0, 64, (2, 2, 8)).astype("int64")


def llama_and_plan(D, layers, prefix="model"):
    """A tiny PaddleFormers Llama (seed 0), its SGD optimizer and paddle's plan for it: q/k/v/gate/up column,
    o/down row, keys under ``prefix``."""
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
                      fuse_rms_norm=False, tie_word_embeddings=False)
    paddle.seed(0)
    model = LlamaForCausalLM(cfg)
    plan = {f"{prefix}.layers.*.{n}": D.ColWiseParallel() for n in ("self_attn.q_proj", "self_attn.k_proj",
                                                                    "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    plan.update({f"{prefix}.layers.*.{n}": D.RowWiseParallel() for n in ("self_attn.o_proj", "mlp.down_proj")})
    return model, paddle.optimizer.SGD(0.5, parameters=model.parameters()), plan


def train_llama(model, opt, batches):
    """SGD steps over ``batches`` (ids that are their own labels); the losses and the parameters after."""
    losses = []
    for x in batches:
        loss = model(input_ids=x, labels=x, return_dict=True).loss
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return {"losses": losses, **params(model, ())}


def _llama(A, prefix):
    """A PaddleFormers Llama under paddle's plan (q/k/v/gate/up column, o/down row) on mp = 2, 2 SGD steps."""
    D = A.D
    model, opt, plan = llama_and_plan(D, 2, prefix)
    mesh = D.ProcessMesh([[0, 1]], dim_names=["dp", "mp"])
    model, opt = D.parallelize(model, opt, mesh, {"mp_config": {"parallelize_plan": plan}})
    return train_llama(model, opt, [paddle.to_tensor(ids) for ids in IDS])


def paddleformers_llama_parallelize(A):
    return _llama(A, "model")


def parallelize_plan_typo(A):
    """The layers are ``model.layers.*``: a plan naming ``llama.layers.*`` matches nothing."""
    return _llama(A, "llama")


def partial_loss_backward(A):
    D, m = A.D, mesh1(A.D)
    x = D.shard_tensor(paddle.to_tensor(BATCHES[0][0], stop_gradient=False), m, [D.Shard(1)])
    w = D.shard_tensor(paddle.to_tensor(BATCHES[1][0].T.copy(), stop_gradient=False), m, [D.Shard(0)])
    loss = paddle.matmul(x, w).sum()                       # Partial(sum) on both APIs
    loss.backward()
    return {"loss": loss, "x.grad": x.grad, "w.grad": w.grad}


def grad_api_and_hooks(A):
    D, m = A.D, mesh1(A.D)
    x = D.shard_tensor(paddle.to_tensor(BATCHES[0][0], stop_gradient=False), m, [D.Shard(0)])
    y = x * x
    (g,) = paddle.grad(y.sum(), x, create_graph=False)
    z = x * 3
    z.register_hook(lambda gr: gr * 2)
    z.sum().backward()
    with paddle.no_grad():
        n = x * 5
    return {"paddle.grad": g, "x.grad": x.grad, "no_grad.stop_gradient": float(n.stop_gradient)}


def clip_grad_norm_by_hand(A):
    D, m = A.D, mesh1(A.D)
    paddle.seed(5)
    model = D.shard_layer(MLP(), m, tp_fn(D))
    opt = D.shard_optimizer(paddle.optimizer.SGD(0.1, parameters=model.parameters()))
    x = D.shard_tensor(paddle.to_tensor(BATCHES[0][0]), m, [D.Replicate()])
    F.mse_loss(model(x), paddle.to_tensor(BATCHES[0][1])).backward()
    norm = paddle.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    opt.step()
    return {"norm": norm, **params(model)}


def shard_dataloader_splitted(A):
    D, m = A.D, mesh1(A.D)
    r = paddle.distributed.get_rank()
    part = paddle.io.Subset(Rows(), list(range(4 * r, 4 * r + 4)))           # each rank loads its own half
    dl = D.shard_dataloader(paddle.io.DataLoader(part, batch_size=2, shuffle=False), [m, m], shard_dims="x",
                            is_dataset_splitted=True)
    out = {}
    for i, (x, y) in enumerate(dl):
        out[f"x{i}"], out[f"y{i}"] = (x, True), (y, True)
    return out


def _one_process_clip():
    paddle.seed(5)
    model = MLP()
    opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    F.mse_loss(model(paddle.to_tensor(BATCHES[0][0])), paddle.to_tensor(BATCHES[0][1])).backward()
    norm = paddle.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    opt.step()
    return {"norm": float(norm), **{n: p.numpy() for n, p in model.named_parameters()}}


TRAINING_ORACLES = {"clip_grad_norm_by_hand": _one_process_clip}     # one process's values


def set_get_mesh(A):
    D = A.D
    m = mesh1(D)
    D.set_mesh(m)
    return {"same": float(D.get_mesh() == m)}


TRAINING = [
    shard_layer_tp, optimizer_sgd_tp, optimizer_adamw_clip_tp, optimizer_sgd_clip_dp, optimizer_adamw_dp,
    optimizer_momentum_dp,
    shard_dataloader, parallelize_tp_plan, parallelize_plan_options, parallelize_dp2_plan, parallelize_dp,
    set_get_mesh, shard_layer_io_fns, dp_tp_2d, to_local_grad, unshard_param, local_map_reshard_inputs,
    shard_dataloader_dict, param_reshard_grad, accumulate_then_step, state_dict_values, dtensor_from_fn, inplace_ops,
    attention_tp, paddleformers_llama_parallelize, parallelize_plan_typo, partial_loss_backward, grad_api_and_hooks,
    clip_grad_norm_by_hand, shard_dataloader_splitted]
