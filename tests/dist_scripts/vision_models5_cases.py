"""Models of tests/dist_scripts/vision_models5_worker.py: paddle.vision models, paddle's Transformer layers, RNNs,
a zoo of conv / norm / pool layers and hapi's ``paddle.Model``, each trained a few steps by one process and by a
distributed form; ``train`` returns (losses, {name: parameter or buffer, global value}) for ``compare``."""
import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

import autoparallel as ap


def full(t):
    return t.full().numpy() if ap.is_dist(t) else t.numpy()


def worst(a, b, rtol, atol) -> float:
    """Largest |a - b| / (atol + rtol |b|) (<= 1: equal within the tolerance; inf: other shapes)."""
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    if a.shape != b.shape:
        return float("inf")
    return float((np.abs(a - b) / (atol + rtol * np.abs(b))).max()) if a.size else 0.0


def compare(want, got, rtol, atol) -> float:
    if sorted(got[1]) != sorted(want[1]):
        raise AssertionError(f"other entries: {sorted(set(got[1]) ^ set(want[1]))}")
    return max([worst(got[0], want[0], rtol, atol)] + [worst(got[1][n], v, rtol, atol) for n, v in want[1].items()])


def state(model):
    """Every parameter and buffer (BatchNorm's running statistics are non-trainable parameters in paddle)."""
    out = {n: full(p) for n, p in model.named_parameters()}
    out.update({n: full(b) for n, b in model.named_buffers()})
    return out


def images(n=16, size=32, classes=5, steps=2, dtype="float32"):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((n, 3, size, size)) * 2 + 1).astype(dtype)
    y = rng.integers(0, classes, (n,)).astype("int64")
    return x.reshape((steps, n // steps) + x.shape[1:]), y.reshape(steps, n // steps)


def make_opt(kind, params):
    if kind == "sgd":
        return paddle.optimizer.SGD(0.01, parameters=params)
    return paddle.optimizer.Momentum(0.05, momentum=0.9, parameters=params)


def ce(model, x, y):
    return F.cross_entropy(model(x), y)


def train(build, xs, ys, wrap=None, opt="momentum", lossf=ce):
    """``len(xs)`` steps of batch ``xs[i], ys[i]``; ``wrap(model, opt) -> (model, opt, feed)`` makes it distributed
    (``feed`` lays out each batch tensor, or None: plain tensors, the global batch)."""
    paddle.seed(0)
    model = build()
    optimizer = make_opt(opt, model.parameters())
    feed = None
    if wrap is not None:
        model, optimizer, feed = wrap(model, optimizer)
    losses = []
    for x, y in zip(xs, ys):
        x, y = paddle.to_tensor(x), paddle.to_tensor(y)
        if feed is not None:
            x, y = feed(x), feed(y)
        loss = lossf(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(full(loss)))
    return losses, state(model)


# ---- sequence models ----------------------------------------------------------------------------------------------
class Seq2Seq(nn.Layer):
    """paddle's nn.Transformer (pre-norm) with a source padding mask (float, -1e9), the causal target mask of
    ``generate_square_subsequent_mask`` and the padding mask as memory mask."""

    def __init__(self):
        super().__init__()
        self.src_emb, self.tgt_emb = nn.Embedding(11, 16, padding_idx=0), nn.Embedding(11, 16)
        self.tr = nn.Transformer(16, 4, 2, 2, 32, dropout=0.0, normalize_before=True)
        self.out = nn.Linear(16, 11)

    def forward(self, src, tgt):
        smask = paddle.unsqueeze((src == 0).astype("float32") * -1e9, [1, 2])
        tmask = self.tr.generate_square_subsequent_mask(tgt.shape[1])
        return self.out(self.tr(self.src_emb(src), self.tgt_emb(tgt), src_mask=smask, tgt_mask=tmask,
                                memory_mask=smask))


class EncDec(nn.Layer):
    """TransformerEncoder / TransformerDecoder built apart, final norms, bool masks (True: attend)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 16)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, activation="gelu"), 2,
                                         norm=nn.LayerNorm(16))
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0), 1, norm=nn.LayerNorm(16))
        self.out = nn.Linear(16, 11)

    def forward(self, src, tgt):
        smask = (src != 0).unsqueeze(1).unsqueeze(1)
        tmask = paddle.tril(paddle.ones([tgt.shape[1], tgt.shape[1]], dtype="bool"))
        return self.out(self.dec(self.emb(tgt), self.enc(self.emb(src), smask), tmask, smask))


def s2s_data():
    rng = np.random.default_rng(3)
    src = rng.integers(1, 11, (2, 4, 6))
    src[:, :, -2:] = 0
    return src, rng.integers(1, 11, (2, 4, 5))


def s2s_loss(model, src, tgt):
    return F.cross_entropy(model(src, tgt[:, :-1]), tgt[:, 1:])


def attention_plan(prefix, stacks):
    plan = {}
    for stack, atts in stacks:
        for att in atts:
            for p in ("q_proj", "k_proj", "v_proj"):
                plan[f"{prefix}{stack}.layers.*.{att}.{p}"] = ap.ColWiseParallel()
            plan[f"{prefix}{stack}.layers.*.{att}.out_proj"] = ap.RowWiseParallel()
        plan[f"{prefix}{stack}.layers.*.linear1"] = ap.ColWiseParallel()
        plan[f"{prefix}{stack}.layers.*.linear2"] = ap.RowWiseParallel()
    return plan


SEQ2SEQ_PLAN = attention_plan("tr.", [("encoder", ["self_attn"]), ("decoder", ["self_attn", "cross_attn"])])


def decode(model, src, mesh=None, steps=3):
    """Greedy decoding in eval mode with the decoder's incremental self-attention cache and static cross cache
    (``gen_cache``): the logits of each step."""
    model.eval()
    src = paddle.to_tensor(src)
    tok = paddle.ones([src.shape[0], 1], dtype="int64")
    if mesh is not None:
        src, tok = (ap.shard_tensor(t, mesh, [ap.Shard(0)]) for t in (src, tok))
    smask = paddle.unsqueeze((src == 0).astype("float32") * -1e9, [1, 2])
    memory = model.tr.encoder(model.src_emb(src), smask)
    dec = model.tr.decoder
    cache = dec.gen_cache(memory)
    out = []
    for _ in range(steps):
        h, cache = dec(model.tgt_emb(tok), memory, None, smask, cache)
        logits = model.out(h[:, -1])
        out.append(full(logits))
        tok = paddle.argmax(logits, -1, keepdim=True)
    return np.stack(out)


class MHANet(nn.Layer):
    """nn.MultiHeadAttention with need_weights (kdim / vdim when ``kv_dims``), the weights in the loss."""

    def __init__(self, kv_dims=True):
        super().__init__()
        self.kv_dims = kv_dims
        kw = {"kdim": 6, "vdim": 5} if kv_dims else {}
        self.mha = nn.MultiHeadAttention(8, 2, need_weights=True, **kw)
        self.head = nn.Linear(8, 3)

    def forward(self, q, kv, mask):
        k, v = (kv[..., :6], kv[..., :5]) if self.kv_dims else (kv, kv)
        o, w = self.mha(q, k, v, attn_mask=mask)
        return self.head(o).mean(1) + (w * w).sum([1, 2, 3]).unsqueeze(-1)


def mha_inputs(kv_width):
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 4, 5, 8)).astype("float32")
    kv = rng.standard_normal((2, 4, 7, kv_width)).astype("float32")
    mask = rng.random((2, 4, 1, 5, 7)) > 0.3
    mask[..., 0] = True
    return q, kv, mask


def mha_loss(masks, mesh=None):
    step = [0]

    def lossf(model, q, kv):
        m = paddle.to_tensor(masks[step[0]])
        step[0] += 1
        if mesh is not None and ap.is_dist(q):
            m = ap.shard_tensor(m, mesh, [ap.Shard(0)])
        return (model(q, kv, m) ** 2).mean()
    return lossf


class RNNNet(nn.Layer):
    """Token ids -> Embedding(padding_idx) -> a 2-layer bidirectional RNN given ``sequence_length`` -> head."""

    def __init__(self, cls, time_major=False):
        super().__init__()
        self.emb = nn.Embedding(12, 6, padding_idx=0)
        self.rnn = cls(6, 5, num_layers=2, direction="bidirect", time_major=time_major)
        self.time_major = time_major
        self.head = nn.Linear(10, 3)

    def forward(self, ids, lens):
        e = self.emb(ids)
        if self.time_major:
            e = e.transpose([1, 0, 2])
        o, _ = self.rnn(e, sequence_length=lens)
        if self.time_major:
            o = o.transpose([1, 0, 2])
        return self.head(o.sum(1))


def rnn_data():
    """(ids with the lengths appended as a last column, labels) for 2 steps of batch 4."""
    rng = np.random.default_rng(5)
    ids = rng.integers(1, 12, (2, 4, 6))
    lens = np.array([[6, 3, 1, 4], [2, 6, 5, 3]])
    for s in range(2):
        for i, n in enumerate(lens[s]):
            ids[s, i, n:] = 0
    return np.concatenate([ids, lens[..., None]], -1), rng.integers(0, 3, (2, 4))


def rnn_loss(model, x, y):
    return F.cross_entropy(model(x[:, :6], x[:, 6].astype("int32")), y)


# ---- conv / norm / pool zoo ---------------------------------------------------------------------------------------
class ConvZoo(nn.Layer):
    """Conv1D (SAME, dilation, groups) + GroupNorm; Conv3D NDHWC groups + InstanceNorm3D; Conv2D NHWC SAME dilated,
    Conv2DTranspose NHWC groups + output_padding, LayerNorm over 3 dims, MaxPool2D(return_mask) + max_unpool2d,
    Upsample bilinear, interpolate nearest, AdaptiveAvgPool2D to (3, 2)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1D(4, 8, 3, padding="SAME", dilation=2, groups=2)
        self.gn = nn.GroupNorm(4, 8)
        self.c3 = nn.Conv3D(2, 4, 3, padding=1, groups=2, data_format="NDHWC")
        self.inorm = nn.InstanceNorm3D(4)
        self.c2 = nn.Conv2D(4, 6, 3, padding="SAME", dilation=2, data_format="NHWC")
        self.ct = nn.Conv2DTranspose(6, 4, 3, stride=2, padding=1, output_padding=1, groups=2, data_format="NHWC")
        self.ln = nn.LayerNorm([8, 8, 4])
        self.pool = nn.MaxPool2D(2, return_mask=True)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
        self.ap = nn.AdaptiveAvgPool2D((3, 2))
        self.head = nn.Linear(8 * 6 + 4 * 6 + 4, 3)

    def forward(self, x):
        b = x.shape[0]
        s1 = self.gn(self.c1(x.reshape([b, 4, 16])))
        v = self.c3(x.reshape([b, 2, 2, 2, 8]).transpose([0, 2, 3, 4, 1])).transpose([0, 4, 1, 2, 3])
        v = self.inorm(v)
        t = self.ln(self.ct(F.relu(self.c2(x.reshape([b, 4, 4, 4]).transpose([0, 2, 3, 1])))))
        p, mask = self.pool(t.transpose([0, 3, 1, 2]))
        u = F.interpolate(self.up(p), size=[6, 6], mode="nearest") + F.max_unpool2d(p, mask, 2)[:, :, 1:7, 1:7]
        feats = [self.ap(s1.reshape([b, 8, 4, 4])).flatten(1), self.ap(u).flatten(1), v.mean([2, 3, 4])]
        return self.head(paddle.concat(feats, 1))


def zoo_data():
    rng = np.random.default_rng(6)
    return rng.standard_normal((2, 4, 64)).astype("float32"), rng.integers(0, 3, (2, 4))


# ---- hapi ---------------------------------------------------------------------------------------------------------
HX = np.random.default_rng(7).standard_normal((24, 1, 12, 12)).astype("float32")
HY = np.random.default_rng(8).integers(0, 4, (24, 1)).astype("int64")


class HData(paddle.io.Dataset):
    def __init__(self, lo, hi):
        self.lo, self.hi = lo, hi

    def __len__(self):
        return self.hi - self.lo

    def __getitem__(self, i):
        return HX[self.lo + i], HY[self.lo + i]


def hapi_net():
    paddle.seed(3)
    return nn.Sequential(nn.Conv2D(1, 4, 3, padding=1), nn.BatchNorm2D(4), nn.ReLU(), nn.MaxPool2D(2),
                         nn.Conv2D(4, 4, 3, groups=2), nn.Flatten(), nn.Linear(64, 4))


class Seen(paddle.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, step, logs=None):
        self.seen.append(float(np.asarray(logs["loss"]).reshape(-1)[0]))


def hapi_one_process():
    """hapi's steps written out (global batch 8, 2 epochs of 2 batches), then the eval-mode predictions and
    accuracy of the held-out rows."""
    net = hapi_net()
    opt = make_opt("momentum", net.parameters())
    losses = []
    for _ in range(2):
        for i in range(0, 16, 8):
            loss = F.cross_entropy(net(paddle.to_tensor(HX[i:i + 8])), paddle.to_tensor(HY[i:i + 8]))
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
    net.eval()
    pred = net(paddle.to_tensor(HX[16:])).numpy()
    return losses, {**state(net), "predict": pred, "acc": np.array((pred.argmax(-1) == HY[16:, 0]).mean())}


def hapi_distributed(dp):
    net = hapi_net()
    opt = make_opt("momentum", net.parameters())
    s = ap.Strategy()
    s.data_parallel.degree = dp
    net, opt = ap.parallelize(net, opt, strategy=s)
    model = paddle.Model(net)
    model.prepare(opt, nn.CrossEntropyLoss(), paddle.metric.Accuracy())
    seen = Seen()
    model.fit(HData(0, 16), epochs=2, batch_size=8 // dp, shuffle=False, verbose=0, callbacks=[seen])
    ev = model.evaluate(HData(16, 24), batch_size=8 // dp, verbose=0)
    pred = model.predict(HData(16, 24), batch_size=8 // dp, verbose=0, stack_outputs=True)[0]
    return seen.seen, {**state(net), "predict": pred, "acc": np.array(ev["acc"])}
