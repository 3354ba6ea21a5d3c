"""Every rank of 4 (gloo): collectives of one training step under ap.parallelize (dp=2, tp=2, with and without
sequence parallelism) on PaddleFormers' Llama and the project's GPT and LLaMA, counted on the tensor-parallel
groups forward and backward -- per layer as the difference between a 2-layer and a 1-layer model -- by
wrapping paddle.distributed (what gloo runs: a reduce_scatter is emulated as an all_reduce there) and the
transport (the logical kind); loss and gradients against one process; and a negative control with the
shared gradient reduction disabled (one all_reduce per consumer)."""
import collections
import contextlib
import dataclasses
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
import autoparallel as ap  # noqa: E402
import paddleformers_common as pc  # noqa: E402
from autoparallel.comm import fanout, transport  # noqa: E402
from autoparallel.comm.counter import count_comm  # noqa: E402
from autoparallel.testing import paddleformers_models as pf  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402

KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")


@contextlib.contextmanager
def count_kinds():
    """{(kind, sorted group ranks): calls} of the transport's collectives (the logical kind)."""
    log = collections.Counter()
    saved = {k: getattr(transport.RealTransport, k) for k in KINDS}

    def wrap(kind, fn):
        def run(self, xs, ranks, *a, **k):
            log[(kind, tuple(sorted(ranks)))] += 1
            return fn(self, xs, ranks, *a, **k)
        return run

    for k, fn in saved.items():
        setattr(transport.RealTransport, k, wrap(k, fn))
    try:
        yield log
    finally:
        for k, fn in saved.items():
            setattr(transport.RealTransport, k, fn)


def on_groups(kinds, paddle_log, groups) -> dict:
    """{"logical": {kind: n}, "paddle": {name: n}} counted on ``groups`` (sorted rank tuples)."""
    logical = collections.Counter()
    for (kind, ranks), n in kinds.items():
        if ranks in groups:
            logical[kind] += n
    real = collections.Counter(name for (name, _, _), ranks in zip(paddle_log.calls, paddle_log.groups)
                               if tuple(ranks) in groups)
    return {"logical": dict(logical), "paddle": dict(real)}


def paddleformers(name):
    def make(layers):
        model = pf.build(name, num_hidden_layers=layers)
        ids, labels = pf.batch(0)

        def loss_fn(m):
            return pf.loss_of(m(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
        return model, loss_fn
    return make


pf_llama = paddleformers("llama")


def project(preset):
    def make(layers):
        from examples.models import PRESETS, build

        paddle.seed(0)
        model = build(dataclasses.replace(PRESETS[preset], layers=layers))
        rng = np.random.default_rng(0)
        ids = rng.integers(0, 64, (4, 8)).astype("int64")
        labels = rng.integers(0, 64, (4, 8)).astype("int64")
        loss_of = type(model).loss

        def loss_fn(m):
            return loss_of(m(paddle.to_tensor(ids)), paddle.to_tensor(labels))
        return model, loss_fn
    return make


MODELS = {"pf-llama": pf_llama, "gpt": project("gpt-tiny"), "llama": project("llama-tiny"),
          "pf-phi3": paddleformers("phi3")}     # fused [gate | up] and [q | k | v], block-sharded


def grads_of(model) -> dict:
    return {n: pf._grad_np(p) for n, p in model.named_parameters()}


def step(name, layers, sp):
    """One forward + backward under parallelize: counts on the TP groups and the DP groups, loss, gradients."""
    model, loss_fn = MODELS[name](layers)
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
    model, opt = ap.parallelize(model, opt, strategy=pc.strategy(sp=sp))
    mesh = model._ap_mesh
    tp_groups = {tuple(sorted(g)) for g in mesh.all_groups("model")}
    with count_kinds() as kf, count_comm() as pf_log:
        loss = loss_fn(model)
    with count_kinds() as kb, count_comm() as pb_log:
        loss.backward()
    opt.reduce_gradients()
    return {"fwd": on_groups(kf, pf_log, tp_groups), "bwd": on_groups(kb, pb_log, tp_groups),
            "loss": float(loss), "grads": grads_of(model)}


def reference(name, layers):
    model, loss_fn = MODELS[name](layers)
    loss = loss_fn(model)
    loss.backward()
    return float(loss), {n: p.grad.numpy() for n, p in model.named_parameters()}


def sub(a: dict, b: dict) -> dict:
    keys = set(a) | set(b)
    return {k: a.get(k, 0) - b.get(k, 0) for k in keys if a.get(k, 0) - b.get(k, 0)}


def bad_grads(ref, got) -> list:
    rl, rg = ref
    bad = [] if np.isclose(rl, got["loss"], rtol=1e-4, atol=1e-5) else ["loss"]
    return bad + [n for n, g in rg.items() if not np.allclose(got["grads"][n], g, rtol=1e-4, atol=1e-5)]


def case(name, sp):
    one, two = step(name, 1, sp), step(name, 2, sp)
    per_layer = {ph: {lvl: sub(two[ph][lvl], one[ph][lvl]) for lvl in ("logical", "paddle")} for ph in ("fwd", "bwd")}
    return {"case": f"{name} {'sp' if sp else 'tp'}", "per_layer": per_layer,
            "one_layer": {ph: one[ph] for ph in ("fwd", "bwd")},
            "bad": bad_grads(reference(name, 2), two)}


def negative_control():
    with fanout.disabled():
        one, two = step("pf-llama", 1, False), step("pf-llama", 2, False)
    return {"case": "per-use reduction", "bwd": sub(two["bwd"]["logical"], one["bwd"]["logical"]),
            "bad": bad_grads(reference("pf-llama", 2), two)}


def main():
    dist.init_parallel_env()
    out = [case(name, sp) for name in MODELS for sp in (False, True)]
    out.append(negative_control())
    write_result(out)


if __name__ == "__main__":
    main()
