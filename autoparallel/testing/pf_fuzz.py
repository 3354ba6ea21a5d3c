"""Random PaddleFormers configs x random strategies: a seed draws a family of ``pf.MODELS`` with small dims that
need not divide the mesh (odd vocab, intermediate and sequence sizes, kv heads below the TP degree, heads TP
does not divide, batches DP does not divide; padded batches, sliding windows) and a strategy (dp, tp, dp x tp,
sequence parallel, ZeRO 1/2/3, recompute, ``auto_mode="full"``; world 2 or 4). ``run_pair(seed)`` trains 2
AdamW steps in one process and under ``ap.parallelize`` in ``ap.simulate``; losses and every state entry are
compared by ``fuzz_runs.compare``.

    python -m autoparallel.testing.pf_fuzz 0 300 /tmp/pf_fuzz.jsonl     # seeds 0..299, one JSON line a pair
"""
from __future__ import annotations

import dataclasses
import json
import random
import signal
import time

import numpy as np

from autoparallel.testing import fuzz_runs
from autoparallel.testing import paddleformers_models as pf

STEPS = 2
# AdamW moves an element by lr * m / (sqrt(v) + eps): a float-order difference delta in a gradient near zero moves
# it by up to lr * delta / eps. Qwen3-Next's gated-delta layers carry deltas of ~3e-5 (one process splitting its
# own batch shows as much), which lr 1e-2 / eps 1e-4 turned into 8e-4 on an embedding row (docs/fuzzing.md);
# lr 1e-3 / eps 1e-3 keep it near delta, below fuzz_runs.ATOL, while a gradient x2 on one parameter still fails
# the comparison (test_fuzz_pf_configs' negative control).
LR, EPSILON = 1e-3, 1e-3
MOE_KEYS = {"qwen2_moe": "num_experts", "qwen3_moe": "num_experts", "qwen3_next": "num_experts",
            "gpt_oss": "num_local_experts", "deepseek_v3": "n_routed_experts", "glm4_moe": "n_routed_experts"}
WINDOWED = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")     # use_sliding_window / sliding_window / max_window_layers
BIAS_KEYS = {"ernie4_5": "use_bias", "qwen2_moe": "qkv_bias", "qwen2": None, "phi3": None}   # default: attention_bias


@dataclasses.dataclass(frozen=True)
class PFConfig:
    seed: int
    family: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int               # intermediate size (odd)
    vocab: int             # odd
    tie: bool
    bias: bool
    layers: int            # 1..3
    seq: int               # odd
    batch: int
    ignored: bool          # some labels -100
    extra: tuple = ()      # family-specific (key, value) pairs
    pad: str = ""          # "left" / "right": padded samples of random lengths with a 2-D attention_mask

    def overrides(self) -> dict:
        out = dict(hidden_size=self.hidden, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                   head_dim=self.head_dim, intermediate_size=self.ffn, vocab_size=self.vocab,
                   tie_word_embeddings=self.tie, num_hidden_layers=self.layers,
                   max_position_embeddings=max(32, 2 * self.seq))
        key = BIAS_KEYS.get(self.family, "attention_bias")
        if key:
            out[key] = self.bias
        out.update(dict(self.extra))
        return out


def draw_config(seed: int) -> PFConfig:
    r = random.Random(seed)
    family = r.choice(sorted(pf.MODELS))
    heads = r.choice([1, 2, 3, 4, 4, 6, 8, 8, 12])       # mostly divisible by tp 2 and 4, sometimes not
    kv_heads = r.choice([k for k in (1, 2, 3, 4, 6, 8, 12) if heads % k == 0])   # kv 6 over tp 4: uneven
    head_dim = r.choice([4, 6, 8])
    hidden = heads * head_dim if r.random() < 0.5 else 2 * r.randint(4, 20)
    if family == "llama":                   # Llama asserts hidden == heads * head_dim when head_dim is given
        hidden = heads * head_dim
    layers = r.randint(1, 3)
    ffn = 2 * r.randint(4, 24) + 1
    extra = _family_extra(r, family, heads, layers, ffn)
    if family == "deepseek_v3":             # MLA: one kv head per head; its head_dim is the rope dim
        kv_heads, head_dim = heads, extra["qk_rope_head_dim"]
    cfg = PFConfig(seed, family, hidden, heads, kv_heads, head_dim, ffn,
                   2 * r.randint(20, 70) + 1, r.random() < 0.5, r.random() < 0.5, layers,
                   2 * r.randint(1, 6) + 1, r.randint(1, 7), r.random() < 0.3, tuple(sorted(extra.items())))
    return _padding_and_windows(cfg, random.Random(70_000 + seed))


def _padding_and_windows(cfg: PFConfig, r) -> PFConfig:
    """Padded batches and sliding windows, drawn apart so the fields above stay what a seed gave."""
    extra = dict(cfg.extra)
    if cfg.family in WINDOWED and r.random() < 0.4:       # the first max_window_layers layers attend fully
        extra.update(use_sliding_window=True, sliding_window=r.randint(2, 6),
                     max_window_layers=r.randint(0, cfg.layers - 1))
    return dataclasses.replace(cfg, pad=r.choice(["", "", "left", "right"]), extra=tuple(sorted(extra.items())))


def _family_extra(r, family: str, heads: int, layers: int, ffn: int) -> dict:
    """Dims of the family's own blocks: experts, MLA ranks, linear attention, layer types."""
    extra = {}
    if family in MOE_KEYS:
        experts = r.choice([2, 3, 4])
        extra.update({MOE_KEYS[family]: experts, "num_experts_per_tok": r.randint(1, min(2, experts)),
                      # GPT-OSS sizes its expert biases by intermediate_size, its expert weights by this
                      "moe_intermediate_size": ffn if family == "gpt_oss" else 2 * r.randint(3, 12) + 1})
    if family in ("qwen2_moe", "qwen3_next"):
        extra["shared_expert_intermediate_size"] = 2 * r.randint(3, 12) + 1
    if family in ("deepseek_v3", "glm4_moe"):
        extra["first_k_dense_replace"] = r.randint(0, layers)
    if family == "deepseek_v3":
        experts = extra["n_routed_experts"]
        extra.update(n_group=r.choice([g for g in (1, 2) if experts % g == 0]), topk_group=1,
                     q_lora_rank=r.choice([None, 2 * r.randint(3, 12)]), kv_lora_rank=2 * r.randint(3, 10),
                     qk_rope_head_dim=r.choice([4, 8]), qk_nope_head_dim=r.choice([4, 6, 8]),
                     v_head_dim=r.choice([4, 6, 8, 10]))
    if family == "qwen3_next":
        kh = r.choice([1, 2])
        extra.update(linear_key_head_dim=r.choice([4, 8]), linear_value_head_dim=r.choice([4, 6, 8]),
                     linear_num_key_heads=kh, linear_num_value_heads=kh * r.choice([1, 2]),
                     layer_types=[r.choice(["linear_attention", "full_attention"]) for _ in range(layers)])
    if family in ("gpt_oss", "gemma3"):
        extra["sliding_window"] = r.randint(2, 6)
    return extra


# ---- strategies --------------------------------------------------------------------------------------------
KINDS = ("dp", "tp", "dp_tp", "sp", "zero1", "zero2", "zero3", "recompute", "full")


@dataclasses.dataclass(frozen=True)
class PFStrategy:
    kind: str
    world: int
    dp: int
    tp: int
    sp: bool = False
    zero: int = 0
    recompute: bool = False

    def describe(self) -> str:
        parts = [f"{self.kind} world {self.world}", f"dp {self.dp} x tp {self.tp}"]
        parts += ["sp"] * self.sp + [f"zero{self.zero}"] * bool(self.zero) + ["recompute"] * self.recompute
        return ", ".join(parts)


def draw_strategy(seed: int) -> PFStrategy:
    r = random.Random(50_000 + seed)
    kind = r.choice(KINDS)
    world = 4 if kind == "dp_tp" else r.choice([2, 4])
    if kind == "full":
        return PFStrategy(kind, world, 0, 0)
    tp = world if kind in ("tp", "sp") else 2 if kind == "dp_tp" else r.choice([1, 1, 2]) if world == 4 else 1
    dp = world // tp
    sp = kind == "sp" or (tp > 1 and r.random() < 0.3)
    zero = int(kind[-1]) if kind.startswith("zero") else r.choice([0, 0, 1, 2, 3]) if dp > 1 else 0
    recompute = kind == "recompute" or r.random() < 0.2
    return PFStrategy(kind, world, dp, tp, sp and tp > 1, zero if dp > 1 else 0, recompute)


def make_strategy(sspec: PFStrategy, cfg: PFConfig):
    import autoparallel as ap

    s = ap.Strategy()
    if sspec.kind == "full":
        s.auto_mode = "full"
        s.global_batch_size = cfg.batch
        return s
    s.data_parallel.degree, s.tensor_parallel.degree = sspec.dp, sspec.tp
    s.sequence_parallel.enable = sspec.sp
    if sspec.zero:
        s.sharding.enable, s.sharding.stage = True, sspec.zero
    s.recompute.enable = sspec.recompute
    return s


# ---- runs --------------------------------------------------------------------------------------------------
def draw_batch(cfg: PFConfig, step: int) -> dict:
    """The model's keyword inputs as int64 numpy [batch, seq]: input_ids, labels (with ``ignored`` about a quarter
    -100) and, with ``pad``, an attention_mask (1 on tokens; padding on the left or right, its labels -100)."""
    rng = np.random.default_rng(1000 * cfg.seed + step)
    ids = rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype("int64")
    labels = rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)).astype("int64")
    if cfg.ignored:
        labels[rng.random(labels.shape) < 0.25] = -100
    out = {"input_ids": ids, "labels": labels}
    if cfg.pad:
        lengths = rng.integers(1, cfg.seq + 1, cfg.batch)
        lengths[0] = cfg.seq
        mask = (np.arange(cfg.seq)[None] < lengths[:, None]).astype("int64")
        mask = mask[:, ::-1].copy() if cfg.pad == "left" else mask
        ids *= mask
        labels[mask == 0] = -100
        out["attention_mask"] = mask
    labels[0, -1] = 0                                      # at least one counted label (sample 0 is whole)
    return out


def build(cfg: PFConfig):
    return pf.build(cfg.family, cfg.seed, fill_zeros=True, **cfg.overrides())


def _optimizer(params):
    import paddle

    return paddle.optimizer.AdamW(LR, parameters=params, epsilon=EPSILON)


def train(model, opt, cfg: PFConfig) -> list:
    """``STEPS`` optimizer steps on the config's batches; the losses."""
    import paddle

    losses = []
    for step in range(STEPS):
        inputs = {k: paddle.to_tensor(v) for k, v in draw_batch(cfg, step).items()}
        loss = pf.loss_of(model(**inputs))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def reference(cfg: PFConfig):
    """One process: (losses, {state name: ndarray})."""
    model = build(cfg)
    losses = train(model, _optimizer(model.parameters()), cfg)
    return losses, {k: v.numpy() for k, v in model.state_dict().items()}


def distributed(cfg: PFConfig, sspec: PFStrategy):
    """The same program under ``ap.parallelize`` in ``ap.simulate(world_size=sspec.world)``."""
    import autoparallel as ap

    with ap.simulate(world_size=sspec.world):
        model = build(cfg)
        extra = {"seq_len": cfg.seq} if sspec.kind == "full" else {}
        model, opt = ap.parallelize(model, _optimizer(model.parameters()), strategy=make_strategy(sspec, cfg),
                                    **extra)
        losses = train(model, opt, cfg)
        state = {k: np.asarray(v.numpy()) for k, v in ap.full_state_dict(model).items()}
    return losses, state


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:400] if text else ''}"


def run_pair(seed: int, strategy_seed: int | None = None) -> fuzz_runs.Outcome:
    """The pair of ``seed`` (config and strategy, or the strategy of ``strategy_seed``); see ``run``."""
    return run(draw_config(seed), draw_strategy(seed if strategy_seed is None else strategy_seed))


def run(cfg: PFConfig, sspec: PFStrategy) -> fuzz_runs.Outcome:
    """Outcome status: ok | wrong | crash | refused (a typed error) | skip (one process fails on the config)."""
    out = fuzz_runs.Outcome(cfg.seed, cfg.seed, cfg, sspec)
    try:
        ref = reference(cfg)
    except Exception as e:  # noqa: BLE001 - the reference failing is paddle's or PaddleFormers' limit
        out.status, out.detail = "skip", _first_line(e)
        return out
    try:
        got = distributed(cfg, sspec)
    except fuzz_runs.REFUSALS as e:
        typed = fuzz_runs._PADDLE_ARGUMENT not in str(e)
        out.status, out.detail = ("refused" if typed else "crash"), _first_line(e)
        return out
    except Exception as e:  # noqa: BLE001 - a fuzzer records every crash
        out.status, out.detail = "crash", _first_line(e)
        return out
    diff = fuzz_runs.compare(ref, got)
    if diff:
        out.status, out.detail = "wrong", diff
    return out


def record(out: fuzz_runs.Outcome) -> dict:
    return {"seed": out.model_seed, "status": out.status, "detail": out.detail,
            "config": dataclasses.asdict(out.model), "strategy": out.strategy.describe()}


HANG_SECONDS = 180


def _hang(signum, frame):
    raise TimeoutError(f"hang: no result after {HANG_SECONDS} s")


def main(first: int, last: int, log: str) -> dict:
    """Runs seeds first..last-1 with a tqdm bar, one JSON line per pair in ``log``; returns the status counts."""
    from tqdm import tqdm

    counts = {}
    signal.signal(signal.SIGALRM, _hang)
    with open(log, "a") as f:
        for seed in tqdm(range(first, last)):
            signal.alarm(HANG_SECONDS)
            start = time.time()
            try:
                out = run_pair(seed)
            finally:
                signal.alarm(0)
            counts[out.status] = counts.get(out.status, 0) + 1
            f.write(json.dumps(dict(record(out), seconds=round(time.time() - start, 2)), default=str) + "\n")
            f.flush()
    return counts


if __name__ == "__main__":
    import argparse

    cli = argparse.ArgumentParser(description="Run PaddleFormers config x strategy pairs against one process.")
    cli.add_argument("first", type=int, help="first seed")
    cli.add_argument("last", type=int, help="one past the last seed")
    cli.add_argument("log", help="JSON-lines file, one line per pair")
    a = cli.parse_args()
    if a.last < a.first:
        cli.error(f"expected first <= last, got {a.first} > {a.last}")
    print(main(a.first, a.last, a.log))
