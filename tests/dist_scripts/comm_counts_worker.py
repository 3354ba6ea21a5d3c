"""Every rank of 4 (gloo): collectives of one training step under ap.parallelize (dp=2, tp=2, with and without
sequence parallelism) on PaddleFormers' Llama and the project's GPT and LLaMA, counted on the tensor-parallel
groups forward and backward -- per layer as the difference between a 2-layer and a 1-layer model -- by
wrapping paddle.distributed (what gloo runs: a reduce_scatter is emulated as an all_reduce there) and at the
transport (the logical kind, comm/counter.py's count_collectives); loss and gradients against one process;
and a negative control with the shared gradient reduction disabled (one all_reduce per consumer)."""
import collections
import dataclasses

import numpy as np
import paddle
import paddle.distributed as dist

from autoparallel import layer_state
import autoparallel as ap
from autoparallel.testing import paddleformers_runs as pc
from autoparallel.comm import fanout
from autoparallel.comm.counter import count_collectives, count_comm
from autoparallel.testing import paddleformers_models as pf
from autoparallel.testing.launch import write_result

KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")


def on_groups(kinds, paddle_log, groups) -> dict:
    """{"logical": {kind: n}, "paddle": {name: n}} counted on ``groups`` (sorted rank tuples): the transport's
    collectives (comm/counter.py's ``count_collectives``, as the simulated tests count them) and paddle's calls."""
    logical = {k: n for k, n in kinds.counts(dist.get_rank(), groups).items() if k in KINDS}
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
    mesh = layer_state.mesh_of(model)
    tp_groups = {tuple(sorted(g)) for g in mesh.all_groups("model")}
    with count_collectives() as kf, count_comm() as pf_log:
        loss = loss_fn(model)
    with count_collectives() as kb, count_comm() as pb_log:
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
