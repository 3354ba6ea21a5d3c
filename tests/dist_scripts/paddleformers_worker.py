"""Every rank of 4 (gloo): PaddleFormers models under ap.parallelize (dp=2, tp=2) for 5 AdamW steps against
one process (losses, final parameters), a split-tie negative control, and Llama's forward collectives
under the seed's shard function and under parallelize, counted by wrapping paddle.distributed."""

import numpy as np
import paddle
import paddle.distributed as dist

import autoparallel as ap  # noqa: E402
from autoparallel import layer_state
from autoparallel.testing import paddleformers_runs as pc
from autoparallel.comm.counter import count_comm  # noqa: E402
from autoparallel.testing import paddleformers_models as pf  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402

MODELS = ("llama", "qwen2", "phi3", "deepseek_v3")
STEPS = 5


def rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12))


def training_case(name, ref):
    losses, final = pc.train(name, STEPS)
    ref_losses, ref_final = ref
    bad = [(n, float(np.abs(final[n] - ref_final[n]).max())) for n in ref_final
           if not np.allclose(final[n], ref_final[n], rtol=1e-4, atol=1e-5)]
    return {"case": f"train {name}", "loss_rel": rel(losses, ref_losses), "bad_params": bad,
            "param_rel": max(rel(final[n], ref_final[n]) for n in ref_final), "names": sorted(final) == sorted(ref_final),
            "losses": losses, "ref_losses": ref_losses}


def split_tie_case(ref):
    """Llama whose head holds a copy of the embedding: training drifts from the tied run."""
    model = pf.build("llama")
    copy = paddle.create_parameter(model.lm_head.weight.shape, "float32")
    copy.set_value(model.lm_head.weight.numpy())
    model.lm_head.weight = copy
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
    model, opt = ap.parallelize(model, opt, strategy=pc.strategy())
    ids, labels = pf.batch(0)
    for _ in range(STEPS):
        loss = pf.loss_of(model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels)))
        loss.backward()
        opt.step()
        opt.clear_grad()
    emb = model.model.embed_tokens.weight.full().numpy()
    return {"case": "split tie", "param_rel": rel(emb, ref[1]["model.embed_tokens.weight"])}


def forward_calls(mode):
    ids, labels = pf.batch(0)
    if mode == "seed":
        mesh = pf.mesh_2x2()
        model = ap.shard_layer(pf.build("llama"), mesh, pf.seed_shard_fn)
        place = [ap.Shard(0), ap.Replicate()]
        kw = {"input_ids": ap.shard_tensor(paddle.to_tensor(ids), mesh, place),
              "labels": ap.shard_tensor(paddle.to_tensor(labels), mesh, place)}
    else:
        model, _ = pc.parallelized("llama")
        kw = {"input_ids": paddle.to_tensor(ids), "labels": paddle.to_tensor(labels)}
    ids_in = kw["input_ids"] if mode == "seed" else \
        ap.shard_tensor(kw["input_ids"], layer_state.mesh_of(model), [ap.Shard(0), ap.Replicate()])
    with count_comm() as decoder_log:                                # the decoder stack alone
        model.model(input_ids=ids_in)
    with count_comm() as log:                                        # embedding, decoder, head and loss
        loss = pf.loss_of(model(**kw))
    return {"case": f"forward {mode}", "decoder_calls": decoder_log.summary(), "calls": log.summary(),
            "loss": float(loss)}


def main():
    dist.init_parallel_env()
    out = []
    refs = {}
    for name in MODELS:
        refs[name] = pc.train(name, STEPS, distributed=False)       # one process: plain paddle on every rank
        out.append(training_case(name, refs[name]))
    out.append(split_tie_case(refs["llama"]))
    out.append(forward_calls("seed"))
    out.append(forward_calls("parallelize"))
    write_result(out)


if __name__ == "__main__":
    main()
