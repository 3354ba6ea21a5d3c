"""Real gloo ranks: examples/train_common.py under DP4, TP4, DP2xTP2, DP2xTP2+SP and gradient accumulation
(GPT) and DP2xTP2 (+SP) (LLaMA) against the single-process run of the same script; negative controls;
collectives per layer; two "nodes" on one machine. Two launches in all."""
import json
import os
import pathlib

import numpy as np
import pytest

from autoparallel.testing.launch import launch
from dist_scripts import shared_launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_scripts", "train_worker.py")

STEPS = 8
COMMON = ["--steps", str(STEPS), "--seed", "0", "--batch-size", "8", "--seq-len", "16", "--lr", "3e-3"]
LLAMA = ["--model", "llama-tiny"]
TIED = ["--model", "gpt-tiny-tied"]
JOBS = [
    {"name": "gpt_dp4", "argv": ["--dp", "4"] + COMMON},
    {"name": "gpt_tp4", "argv": ["--tp", "4"] + COMMON, "probe": "forward_comm"},
    {"name": "gpt_dp2tp2", "argv": ["--dp", "2", "--tp", "2"] + COMMON},
    {"name": "gpt_dp2tp2_sp", "argv": ["--dp", "2", "--tp", "2", "--sp"] + COMMON, "probe": "forward_comm"},
    {"name": "gpt_dp2tp2_ga4", "argv": ["--dp", "2", "--tp", "2", "--grad-accum", "4"] + COMMON},
    {"name": "gpt_dp2tp2_recompute_full", "argv": ["--dp", "2", "--tp", "2", "--recompute", "full"] + COMMON},
    {"name": "gpt_dp4_recompute_selective", "argv": ["--dp", "4", "--recompute", "selective"] + COMMON},
    # input embedding and LM head are one vocab-parallel matrix: both gradients land in its shards
    {"name": "tied_dp2tp2", "argv": ["--dp", "2", "--tp", "2"] + COMMON + TIED},
    {"name": "llama_dp2tp2", "argv": ["--dp", "2", "--tp", "2"] + COMMON + LLAMA},
    {"name": "llama_dp2tp2_sp", "argv": ["--dp", "2", "--tp", "2", "--sp"] + COMMON + LLAMA},
    # probe: gradient accumulation on pure DP issues no collective on the non-final micro-step
    {"name": "llama_dp4_ga2", "argv": ["--dp", "4", "--grad-accum", "2"] + COMMON[:1] + ["3"] + COMMON[2:] + LLAMA,
     "probe": "accumulation_comm"},
    {"name": "neg_wrong_batch", "argv": ["--dp", "4"] + COMMON, "negative": "wrong_batch"},
    {"name": "neg_no_reduce", "argv": ["--dp", "4"] + COMMON, "negative": "no_reduce"},
]
JOB = shared_launch.job(__name__, "train", WORKER, 4, args=lambda out: [out, json.dumps(JOBS)])


def reference(model):
    """The single-process run of the example script (plain paddle, no launcher)."""
    import train_common

    args = train_common.make_parser(model).parse_args(COMMON)
    log, m, _ = train_common.train(args)
    return [s["loss"] for s in log["steps"]], {n: p.numpy() for n, p in m.named_parameters()}


@pytest.fixture(scope="module")
def refs():
    return {"gpt": reference("gpt-tiny"), "llama": reference("llama-tiny"), "tied": reference("gpt-tiny-tied")}


@pytest.fixture(scope="module")
def run():
    out, ranks = shared_launch.results(JOB)
    for r in ranks:
        for name, job in r["jobs"].items():
            assert "error" not in job, f"rank {r['rank']} job {name}:\n{job['error']}"
    return pathlib.Path(out), ranks


def _family(job: str) -> str:
    return job.split("_")[0] if job.startswith(("llama", "tied")) else "gpt"


def matches(job, ranks, out, refs, steps=STEPS):
    """(losses equal at every step, final parameters equal), rtol 1e-4 plus a small atol."""
    ref_losses, ref_params = refs[_family(job)]
    losses = [r["jobs"][job]["losses"][:steps] for r in ranks]
    ok_loss = all(np.allclose(l, ref_losses[:steps], rtol=1e-4, atol=1e-6) for l in losses)
    params = np.load(os.path.join(out, job + ".npz"))
    ok_params = set(params.files) == set(ref_params) and all(
        np.allclose(params[n], ref_params[n], rtol=1e-4, atol=5e-5) for n in ref_params)
    return ok_loss, ok_params


@pytest.mark.parametrize("job", [j["name"] for j in JOBS if not j["name"].startswith(("neg", "llama_dp4"))])
def test_losses_and_parameters_match_single_process(run, refs, job):
    out, ranks = run
    ok_loss, ok_params = matches(job, ranks, out, refs)
    ref = refs[_family(job)][0]
    got = ranks[0]["jobs"][job]["losses"]
    assert ok_loss, f"{job}: losses {np.round(got, 5).tolist()} vs single process {np.round(ref, 5).tolist()}"
    assert ok_params, f"{job}: final parameters differ from the single-process run"
    assert ref[-1] < ref[0] - 0.5                          # it does learn


def test_negative_controls_fail_the_same_comparison(run, refs):
    out, ranks = run
    assert matches("neg_wrong_batch", ranks, out, refs) == (False, False)
    ok_loss, ok_params = matches("neg_no_reduce", ranks, out, refs)
    assert not ok_loss and not ok_params
    assert matches("neg_no_reduce", ranks, out, refs, steps=1)[0]       # step 0 precedes any update


def test_mesh_and_memory(run):
    _, ranks = run
    assert ranks[0]["jobs"]["gpt_dp2tp2"]["mesh"]["ranks"] == [[0, 1], [2, 3]]
    assert ranks[0]["jobs"]["gpt_tp4"]["mesh"]["ranks"] == [[0, 1, 2, 3]]
    dp = ranks[0]["jobs"]["gpt_dp4"]["memory"]
    tp = ranks[0]["jobs"]["gpt_tp4"]["memory"]
    assert len(dp) == 4 and all(m["peak_rss"] > 0 for m in dp)
    for d, t in zip(dp, tp):                               # TP4 holds about a quarter of the weights
        assert t["params"] < 0.3 * d["params"] and t["grads"] == t["params"]
        assert t["optimizer_states"] < 0.3 * d["optimizer_states"]


def test_tensor_parallel_forward_collectives(run):
    _, ranks = run
    for r in ranks:
        probe = r["jobs"]["gpt_tp4"]["probe"]
        layers, outside = probe["per_layer"], probe["outside"]
        assert outside == []
        for name, calls in layers.items():
            if name.endswith(("attn.proj", "mlp.fc2")) or name == "wte":      # row-parallel / vocab-parallel
                assert calls == ["all_reduce"], (name, calls)
            else:
                assert calls == [], (name, calls)
        assert sum(n.endswith(("attn.proj", "mlp.fc2")) for n in layers) == 4


def test_sequence_parallel_forward_collectives(run):
    """Under SP each row-parallel output is reduce-scattered onto sequence shards (on gloo: one all_reduce,
    then a local slice) and each column-parallel input all-gathered back: pairs instead of all_reduces."""
    _, ranks = run
    for r in ranks:
        probe = r["jobs"]["gpt_dp2tp2_sp"]["probe"]
        layers = probe["per_layer"]
        assert probe["outside"] == []
        for name, calls in layers.items():
            if name.endswith(("attn.proj", "mlp.fc2")) or name == "wte":
                assert calls == ["all_reduce"], (name, calls)          # emulated reduce_scatter
            elif name.endswith(("attn.qkv", "mlp.fc1")) or name == "lm_head":
                assert calls == ["all_gather"], (name, calls)
            else:
                assert calls == [], (name, calls)                       # norms run on sequence shards
        assert probe["total"]["all_gather"][0] == probe["total"]["all_reduce"][0] == 5


def test_no_gradient_reduction_on_non_final_micro_steps(run):
    _, ranks = run
    for r in ranks:
        probe = r["jobs"]["llama_dp4_ga2"]["probe"]
        assert probe["backward"][0] == []                    # the non-final micro-step: no communication
        assert probe["backward"][1] == ["all_reduce"]        # the final one's hooks: the one fused bucket
        assert probe["step"] == []                           # nothing left for the optimizer step


def test_two_nodes_on_one_machine(refs, tmp_path):
    """Two launcher invocations (--nnodes 2 --master ... --rank i --nproc_per_node 2) under DP2xTP2: the
    same losses as one process; TP groups inside a node, DP across nodes."""
    log = tmp_path / "log.json"
    job = {"name": "gpt_dp2tp2", "argv": ["--dp", "2", "--tp", "2", "--log-json", str(log)] + COMMON}
    ranks = launch(WORKER, 4, [str(tmp_path), json.dumps([job])], nnodes=2, timeout=300)
    res = [r["jobs"]["gpt_dp2tp2"] for r in ranks]
    assert all("error" not in j for j in res), res
    assert matches("gpt_dp2tp2", ranks, tmp_path, refs) == (True, True)
    mesh = res[0]["mesh"]["ranks"]
    pods = {r["rank"]: r["pod"] for r in ranks}
    assert mesh == [[0, 1], [2, 3]] and len(set(pods.values())) == 2
    assert all(pods[a] == pods[b] for a, b in mesh)                         # model dim inside a node
    assert all(pods[mesh[0][t]] != pods[mesh[1][t]] for t in range(2))       # data dim across nodes
    written = json.loads(log.read_text())
    assert len(written["steps"]) == STEPS and len(written["memory_per_rank"]) == 4
    assert {"loss", "time"} <= set(written["steps"][0])
