"""Builders shared by ckpt_models5_worker.py (real ranks) and tests/test_probe_ckpt_models5.py (one process): tiny
PaddleFormers models, AdamW + StepDecay, the layouts per world size, a few steps, full values as numpy."""
import numpy as np
import paddle
from paddle.utils import unique_name

import autoparallel as ap
from autoparallel.testing import paddleformers_models as pf

# world size -> the layout a run saves in ("src") and the one it loads into ("dst")
LAYOUTS = {2: {"src": {"tp": 2}, "dst": {"dp": 2}},
           4: {"src": {"dp": 2, "tp": 2}, "dst": {"dp": 4, "zero3": True}}}
PRETRAINED = {2: "llama", 4: "qwen3_moe"}      # from_pretrained / save_pretrained
RESUMED = {2: "llama", 4: "qwen3_moe"}         # paddle.save / paddle.load resume
TIED = {2: "qwen3", 4: "llama"}                # ap.save_state_dict of bfloat16 + tied + frozen + non-tensor entries
TIED_CFG = {"tie_word_embeddings": True}
LAZY = {2: "llama", 4: "qwen3"}                # built under paddle.LazyGuard, ZeRO-3 over every rank, then loaded
OTHER_MODEL = {"qwen3": "llama", "llama": "qwen3"}
MISMATCH = {"wrong_shape": {"vocab_size": 160}, "missing_key": {"num_hidden_layers": 3}, "other_model": {}}
UNWRITABLE = "/proc/ap-ckpt-models5"           # its parent exists and nothing can be created in it (root too)
EXTRAS = {"epoch": 3, "note": "run-a", "seen": [1, 2]}
HALF = 2
_NAMES = {}
FROZEN = "model.layers.0.self_attn.o_proj.weight"


def build(name, seed=0, **overrides):
    return pf.build(name, seed, **overrides)


def strategy(dp=1, tp=1, zero3=False):
    s = ap.Strategy()
    s.data_parallel.degree = dp
    s.tensor_parallel.degree = tp
    if zero3:
        s.sharding.enable = True
        s.sharding.stage = 3
    return s


def make(name, seed=0, dtype=None, dp=1, tp=1, zero3=False, **overrides):
    """(model, optimizer, scheduler); the model laid out when ``dp * tp > 1``. One parameter is frozen. Every call
    draws the same paddle names (a fresh process does), so ``opt.state_dict()`` keys match between runs."""
    outer = unique_name.switch()                     # a fresh namespace for this run, as a fresh process has
    try:
        model = build(name, seed, **overrides)
        if dtype:
            model.to(dtype=dtype)
        frozen_param(model).stop_gradient = True
        sched = paddle.optimizer.lr.StepDecay(0.01, step_size=1, gamma=0.7)
        opt = paddle.optimizer.AdamW(sched, parameters=[p for p in model.parameters() if not p.stop_gradient],
                                     weight_decay=0.1)
        if dp * tp > 1:
            model, opt = ap.parallelize(model, opt, strategy=strategy(dp, tp, zero3))
    finally:
        names = unique_name.switch(*outer)
    _NAMES[id(model)] = (model, names)               # the steps draw from it too (the accumulators' names)
    return model, opt, sched


def lazy(name):
    """The model built under ``paddle.LazyGuard`` (no parameter drawn yet)."""
    with paddle.LazyGuard():
        return type(build(name))(pf.config(name))


def frozen_param(model):
    return dict(model.named_parameters())[FROZEN]


def steps(model, opt, sched, start, stop):
    """Losses of steps ``start`` .. ``stop - 1`` (a forward only without an optimizer)."""
    out = []
    for i in range(start, stop):
        ids, labels = pf.batch(i)
        outer = unique_name.switch(*_NAMES[id(model)][1])
        try:
            loss = pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
            if opt is not None:
                loss.backward()
                opt.step()
                opt.clear_grad()
        finally:
            _NAMES[id(model)] = (model, unique_name.switch(*outer))
        if sched is not None:
            sched.step()
        out.append(float(loss))
    return out


def logits(model):
    ids, _ = pf.batch(0)
    with paddle.no_grad():
        out = model(input_ids=paddle.to_tensor(ids))
    value = out[0] if isinstance(out, (tuple, list)) else out.logits
    value = value.full() if hasattr(value, "full") else value
    return np.asarray(value.astype("float32").numpy())


def is_dist(p):
    return getattr(p, "_ap_spec", None) is not None


def full_np(model):
    """{name: float32 ndarray} of the model's global values (collective on real ranks)."""
    return {k: v.astype("float32").numpy() for k, v in ap.full_state_dict(model).items()}


def with_extras(state, empty=False):
    out = dict(state)
    out.update({k: (type(v)() if empty else v) for k, v in EXTRAS.items()})
    return out


def tie_kept(model):
    return model.lm_head.weight is model.model.embed_tokens.weight
