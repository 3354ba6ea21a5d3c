"""The planner prices a frozen model (LoRA): gradients, their data-parallel sync, ZeRO-1/2's re-gather, optimizer
states and master copies count only the trainable share of the parameters, the weights all of them; values by
hand. ``auto_mode="full"`` reads the share from ``stop_gradient``; an all-trainable model (every published run)
is priced as before (the control: the same formulas with share 1)."""
import dataclasses

import pytest

import autoparallel as ap
from autoparallel.planner import auto
from autoparallel.planner.cluster import ClusterSpec, DeviceSpec, LinkSpec
from autoparallel.planner.config import ParallelConfig
from autoparallel.planner.model_read import read_model
from autoparallel.planner.model_spec import parse_model
from autoparallel.planner.options import PlannerOptions, options_for_cluster
from autoparallel.planner.profiles import cpu_default
from autoparallel.planner.search import evaluate_config

from models import PRESETS, build  # noqa: E402

SMALL = parse_model("hidden=64,layers=4,heads=4,vocab=1000,seq=32")
F = 0.01
LORA = dataclasses.replace(SMALL, trainable_fraction=F)
PSI = 84416                     # parameters of the first stage of dp2 tp2 pp2 (test_planner_formulas.py)


def toy_cluster(devices=8):
    device = DeviceSpec("toy", (("bfloat16", 1e12),), 1e9, 1e11)
    link = LinkSpec(latency_s=0.0, bandwidth_Bps=1e10)
    return ClusterSpec("toy", 1, devices, device, link, link, overlap=0.0)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("model, f", [(LORA, F), (SMALL, 1.0)], ids=["lora", "all trainable"])
def test_state_memory_of_a_frozen_model_by_hand(model, f, zero):
    opts = PlannerOptions(memory_reserve_fraction=0.0, zero_master_copy=True)
    cand = evaluate_config(model, toy_cluster(), 16, 32, ParallelConfig(dp=2, tp=2, pp=2, sharding=zero,
                                                                        micro_batch=4), opts)
    d = 2
    # bf16 weights (all; split at ZeRO-3); fp32 gradients of the trainable share (whole: 2 micro-batches
    # accumulate locally before one reduce-scatter) + ZeRO-1's master-chunk gradient; AdamW m, v, fp32 master 12 B per trainable element (1/d under ZeRO) +
    # the eager runtime's separate fp32 master chunk at ZeRO-1/2
    want = {"params": 2 * PSI / (d if zero == 3 else 1),
            "grads": 4 * f * PSI + (4 * f * PSI / d if zero == 1 else 0),
            "optimizer": 12 * f * PSI / (d if zero else 1) + (4 * f * PSI / d if zero in (1, 2) else 0)}
    for key, value in want.items():
        assert cand.memory_gb[key] * 1e9 == pytest.approx(value, rel=1e-12), key


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_gradient_sync_of_a_frozen_model_by_hand(zero):
    opts = PlannerOptions(memory_reserve_fraction=0.0)
    config = ParallelConfig(dp=4, tp=1, pp=1, sharding=zero, micro_batch=2)
    got = {f: evaluate_config(m, toy_cluster(4), 8, 32, config, opts).time_s["dp_comm"]
           for m, f in ((LORA, F), (SMALL, 1.0))}
    psi, d, bw = SMALL.params, 4, 1e10
    for f, t in got.items():
        grads = 4 * f * psi            # fp32 gradient bytes of the trainable parameters, no latency
        sync = (2 if zero == 0 else 1) * (d - 1) / d * grads / bw    # all_reduce, or reduce_scatter at ZeRO
        gather = (d - 1) / d * 2 * f * psi / bw if zero else 0.0     # ZeRO-1/2 all_gather the stepped bf16 chunks
        assert t == pytest.approx(sync + gather, rel=1e-9), (f, zero)
    assert got[F] < got[1.0] / 50


def test_auto_full_reads_the_trainable_share_from_stop_gradient():
    config = dataclasses.replace(PRESETS["gpt-tiny"], vocab_size=256)
    model = build(config)
    total = sum(p.numel().item() for p in model.parameters())
    assert read_model(model, 16, "gpt").trainable_fraction == 1.0            # the control: all trainable
    train = 0
    for name, p in model.named_parameters():
        p.stop_gradient = "norm" not in name and "ln" not in name
        train += 0 if p.stop_gradient else p.numel().item()
    assert 0 < train < total / 20
    spec = read_model(model, 16, "gpt")
    assert spec.trainable_fraction == pytest.approx(train / total, rel=1e-12)
    assert f"trainable: {train:,} of {total:,}" in spec.source
    s = ap.Strategy()
    s.auto_mode, s.global_batch_size = "full", 8
    _, result = auto.choose(model, s, 4, seq_len=16, cluster=cpu_default())
    assert result.model.trainable_fraction == spec.trainable_fraction
    best = result.best
    opts = options_for_cluster(result.cluster)
    frozen = evaluate_config(spec, result.cluster, 8, 16, best.config, opts)
    full = evaluate_config(dataclasses.replace(spec, trainable_fraction=1.0), result.cluster, 8, 16, best.config, opts)
    assert best.memory_gb["optimizer"] == pytest.approx(frozen.memory_gb["optimizer"], rel=1e-12)
    assert frozen.memory_gb["optimizer"] < full.memory_gb["optimizer"] / 5


def test_model_strings_take_a_trainable_share():
    assert parse_model("hidden=64,layers=4,heads=4,vocab=1000,seq=32,trainable=0.01") == LORA
    assert parse_model("llama2-7b,trainable=0.003").trainable_fraction == 0.003
    for bad in ("llama2-7b,trainable=x", "llama2-7b,trainable=1.5"):
        with pytest.raises(ValueError, match="trainable"):
            parse_model(bad)
