"""Search over dp, tp, pp, vpp, sp, ZeRO stage, recompute, micro-batch and offload.

The valid configurations are generated as numpy arrays (structural knobs dp/tp/pp/micro-batch/vpp in
a small loop, the others by a cartesian product), priced at once by ``cost_model.evaluate``,
filtered by memory and ranked by step time, then memory, then the configuration tuple — so the
result is deterministic. ``exhaustive`` enumerates the same space one configuration at a time with
the scalar validity rules (``invalid_reason``); tests check both agree.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, fields, replace

import numpy as np

from autoparallel.config.fields import integral
from autoparallel.planner.config import RECOMPUTE, SPLITS, ParallelConfig
from autoparallel.planner.cost_model import GRID_KEYS, MEMORY_TERMS, TIME_TERMS, evaluate, memory_floors
from autoparallel.planner.dualpipe import problem as dualpipe_problem
from autoparallel.planner.result import GB, Candidate

_RC_CODE = {name: i for i, name in enumerate(RECOMPUTE)}
_SPLIT_CODE = {name: i for i, name in enumerate(SPLITS)}


@dataclass(frozen=True)
class SearchSpace:
    dp: tuple = None              # allowed data-parallel degrees (None: every valid one)
    tp: tuple = None              # allowed tensor-parallel degrees
    pp: tuple = None              # allowed pipeline degrees
    vpp: tuple = None             # allowed virtual stages per device
    sp: tuple = (0, 1)            # sequence parallelism off/on
    sharding: tuple = (0, 1, 2, 3)   # ZeRO stages
    recompute: tuple = RECOMPUTE  # recompute granularities
    offload: tuple = (0, 1)       # optimizer offload off/on
    micro_batch: tuple = None     # allowed micro-batch sizes
    ep: tuple = None              # allowed expert-parallel degrees (MoE models; dense models: 1)
    split: tuple = SPLITS         # pipeline stage splits
    dualpipe: tuple = (0,)        # DualPipe off/on; on only when asked for (planner-only, as fp8: docs/planner.md)

    @classmethod
    def from_constraints(cls, constraints: dict) -> "SearchSpace":
        """``{"tp": [4, 8], "recompute": "full", ...}``: a value or a list of allowed values per knob."""
        names = {f.name for f in fields(cls)}
        values = {}
        for key, allowed in (constraints or {}).items():
            if key not in names:
                raise ValueError(f"unknown search constraint {key!r}: expected one of {sorted(names)}")
            values[key] = _allowed(key, allowed)
        return cls(**values)

    def allows(self, key: str, value) -> bool:
        allowed = getattr(self, key)
        return allowed is None or value in allowed

    def constrained(self) -> dict:
        default = SearchSpace()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}


_CHOICES = {"recompute": RECOMPUTE, "split": SPLITS, "dualpipe": (0, 1), "sp": (0, 1), "sharding": (0, 1, 2, 3),
            "offload": (0, 1)}
_FLAGS = ("sp", "offload", "dualpipe")


def _allowed(key: str, allowed) -> tuple:
    """One constraint's allowed values: a value or a list of them; degrees are positive ints (numpy's too),
    the other knobs one of their choices."""
    if isinstance(allowed, (str, bool, np.bool_)) or integral(allowed) is not None:
        allowed = (allowed,)
    try:
        allowed = tuple(integral(a) if integral(a) is not None else a for a in allowed)
    except TypeError:
        raise TypeError(f"constraint {key!r} must be a value or a list of values, got {type(allowed).__name__} "
                        f"{allowed!r:.60}") from None
    if not allowed:
        raise ValueError(f"constraint {key!r} allows no value")
    if key in _FLAGS:                                    # an on/off knob: True/False are 1/0
        allowed = tuple(int(a) if isinstance(a, bool) else a for a in allowed)
    legal = _CHOICES.get(key)
    if legal is not None:
        bad = [a for a in allowed if a not in legal or isinstance(a, (bool, float))]
        if bad:
            raise ValueError(f"{key} must be among {legal}, got {bad}")
        return allowed
    bad = [a for a in allowed if not isinstance(a, int) or a < 1]
    if bad:
        raise ValueError(f"constraint {key!r} takes positive integers (degrees, sizes), got {bad}")
    return allowed


MAX_DIVISORS_OF = 2 ** 40


def divisors(n: int) -> list:
    """The divisors of ``n``, sorted, from its prime factors (trial division: O(sqrt n) at worst, for a
    prime; instant for the products of small primes batch sizes and device counts are)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 < n <= MAX_DIVISORS_OF:
        raise ValueError(f"divisors: expected an integer in [1, 2**40] (a batch size or a device count), got {n!r}")
    n, out, p = int(n), [1], 2
    while p * p <= n:
        k = 0
        while n % p == 0:
            n //= p
            k += 1
        if k:
            out = [d * p ** e for d in out for e in range(k + 1)]
        p += 1 if p == 2 else 2
    if n > 1:
        out += [d * n for d in out]
    return sorted(out)


def tp_divides_model(model, tp: int) -> bool:
    """tp splits the heads and hidden evenly (``Strategy.validate``'s rule), and the key/value heads unless there
    are fewer of them than tp (the plans then replicate k / v). FFN and expert widths need not divide: the plans
    shard them by ceil-division (model_read.tp_refusal), priced here as width / tp."""
    return (model.heads % tp == 0 and model.hidden % tp == 0
            and (model.kv_heads % tp == 0 or model.kv_heads < tp))


def expert_degrees(model, dp: int) -> list:
    """Expert-parallel degrees for ``dp`` data-parallel ranks: divisors of both dp and the expert count."""
    if not model.is_moe:
        return [1]
    return [e for e in divisors(dp) if model.experts % e == 0]


def _split_duplicate(model, seq_len, c):
    """Outside the search space (though runnable): a split equal to an earlier one in SPLITS (same blocks per
    stage, and the same vpp allowed there), or a vpp that does not divide the largest stage."""
    from autoparallel.planner.stages import head_equivalent, split_layers

    eq = head_equivalent(model, seq_len)
    counts = split_layers(model.layers, c.pp, c.split, eq)
    for earlier in SPLITS[:SPLITS.index(c.split)]:
        if (split_layers(model.layers, c.pp, earlier, eq) == counts
                and c.vpp in vpp_choices(counts, 10 ** 9, earlier == "ends")):
            return f"split={c.split} gives the same blocks per stage as split={earlier} ({list(counts)})"
    if c.vpp not in vpp_choices(counts, 10 ** 9, c.split == "ends"):
        return (f"vpp={c.vpp} must divide the {max(counts)} blocks of the largest stage ({list(counts)}) so its "
                f"virtual stages are equal")
    return None


def _split_problem(model, seq_len, pp, vpp, split):
    from autoparallel.planner.stages import head_equivalent, split_layers, split_problem

    return split_problem(split_layers(model.layers, pp, split, head_equivalent(model, seq_len)), vpp, split == "ends")


def invalid_reason(model, world, global_batch, seq_len, config: ParallelConfig, options) -> str:
    """Why ``config`` cannot run this model on ``world`` devices (None when it can)."""
    c = config
    if c.world != world:
        return f"dp·tp·pp = {c.dp}·{c.tp}·{c.pp} = {c.world}, but the cluster has {world} devices"
    if not tp_divides_model(model, c.tp):
        return (f"tp={c.tp} must divide heads ({model.heads}) and hidden ({model.hidden}), and kv_heads "
                f"({model.kv_heads}) unless they are fewer than tp")
    if c.pp > model.layers:
        return f"pp={c.pp} exceeds the {model.layers} layers"
    if c.split not in SPLITS:
        return f"split must be one of {'|'.join(SPLITS)}, got {c.split!r}"
    if c.pp > 1 or c.split != "even":
        if c.pp == 1:
            return f"split={c.split} needs pipeline parallelism (pp > 1)"
        problem = _split_problem(model, seq_len, c.pp, c.vpp, c.split)
        if problem:
            return f"pipeline split {c.split!r} of {model.layers} blocks over pp={c.pp}, vpp={c.vpp}: {problem}"

    if c.ep > 1:
        if not model.is_moe:
            return f"ep={c.ep} needs a mixture-of-experts model ({model.name} is dense)"
        if c.dp % c.ep or model.experts % c.ep:
            return f"ep={c.ep} must divide dp ({c.dp}) and the {model.experts} experts"
    if global_batch % (c.dp * c.micro_batch):
        return (f"global batch {global_batch} is not divisible by dp·micro_batch = {c.dp}·{c.micro_batch} = "
                f"{c.dp * c.micro_batch}")
    m = global_batch // (c.dp * c.micro_batch)
    if c.pp > 1 and m < c.pp:
        return f"a {c.pp}-stage pipeline needs at least {c.pp} micro-batches per step (1F1B's steady state), got {m}"
    if c.vpp > 1:
        if c.pp == 1:
            return f"vpp={c.vpp} needs pipeline parallelism (pp > 1)"
        if m % c.pp:
            return f"the interleaved schedule needs micro-batches ({m}) divisible by pp ({c.pp})"
        if c.vpp > options.max_vpp:
            return f"vpp={c.vpp} exceeds max_vpp={options.max_vpp}"
    if c.dualpipe not in (0, 1):
        return f"dualpipe must be 0 or 1, got {c.dualpipe!r}"
    if c.dualpipe:
        problem = dualpipe_problem(c.pp, c.vpp, m)
        if problem:
            return problem
    if c.sp and c.tp == 1:
        return "sequence parallelism (sp=1) needs tp > 1"
    if c.sp and seq_len % c.tp:
        return f"sequence parallelism needs seq_len ({seq_len}) divisible by tp ({c.tp})"
    if c.sharding and c.dp == 1:
        return f"ZeRO stage {c.sharding} shards over data parallelism and needs dp > 1"
    if c.offload and c.sharding == 0:
        return "offload moves ZeRO-sharded optimizer states to the host and needs sharding >= 1"
    return None


def vpp_choices(counts, max_vpp, ends=False):
    """Virtual stages for a split: 1, and every v > 1 dividing the largest stage's blocks (its chunks equal)
    that every stage can hold (``ends``: the first and last stage with one chunk holding only the embedding or
    the head, stages.edge_chunk_allowance); layers need not divide by pp·v."""
    from autoparallel.planner.stages import edge_chunk_allowance

    top = max(counts)
    room = min(n + spare for n, spare in zip(counts, edge_chunk_allowance(counts, ends)))
    return [1] + [v for v in range(2, min(max_vpp, room) + 1) if top % v == 0]


def _pipeline_shapes(model, seq_len, pp, space, options):
    """(vpp, split) pairs whose split leaves no stage or virtual stage empty; a split that gives the same blocks
    per stage and vpp as an earlier one is the same plan and is kept once (``ends`` with the same blocks as
    ``even`` still adds the vpp whose end chunks hold only the embedding or the head)."""
    from autoparallel.planner.stages import head_equivalent, split_layers

    if pp == 1:
        return [(1, "even")] if space.allows("split", "even") else []
    out, seen = [], set()
    for split in SPLITS:
        counts = split_layers(model.layers, pp, split, head_equivalent(model, seq_len))
        if not space.allows("split", split) or min(counts) < 1:
            continue
        for v in vpp_choices(counts, options.max_vpp, split == "ends"):
            if (counts, v) not in seen and space.allows("vpp", v):
                seen.add((counts, v))
                out.append((v, split))
    return out


def structural_grid(model, world, global_batch, seq_len, space: SearchSpace, options) -> np.ndarray:
    """The valid structural tuples of ``space``: an (n, 8) int array of (dp, tp, pp, vpp, mb, ep, split, dualpipe)."""
    structural = []
    for tp in divisors(world):
        if not (space.allows("tp", tp) and tp_divides_model(model, tp)):
            continue
        for pp in divisors(world // tp):
            if pp > model.layers or not space.allows("pp", pp):
                continue
            dp = world // (tp * pp)
            if global_batch % dp or not space.allows("dp", dp):
                continue
            shapes = _pipeline_shapes(model, seq_len, pp, space, options)
            eps = [e for e in expert_degrees(model, dp) if space.allows("ep", e)]
            for mb in divisors(global_batch // dp):
                if not space.allows("micro_batch", mb):
                    continue
                m = global_batch // (dp * mb)
                if pp > 1 and m < pp:                   # 1F1B's steady state needs pp micro-batches
                    continue
                duals = [d for d in space.dualpipe if d == 0 or (d == 1 and not dualpipe_problem(pp, 1, m))]
                for v, split in shapes:
                    if v > 1 and m % pp:
                        continue
                    for e, d in itertools.product(eps, duals):
                        if not (d and v > 1):
                            structural.append((dp, tp, pp, v, mb, e, _SPLIT_CODE[split], d))
    return np.array(structural, dtype=np.int64).reshape(-1, 8)


def _knob_rows(space: SearchSpace) -> np.ndarray:
    sps = [s for s in space.sp if s in (0, 1)]
    zeros = [z for z in space.sharding if z in (0, 1, 2, 3)]
    rcs = [_RC_CODE[r] for r in space.recompute]
    offs = [o for o in space.offload if o in (0, 1)]
    return np.array(list(itertools.product(sps, zeros, rcs, offs)), dtype=np.int64).reshape(-1, 4)


def expand_grid(struct: np.ndarray, seq_len, space: SearchSpace, fits: np.ndarray = None):
    """Structural tuples x the valid (sp, ZeRO stage, recompute, offload) choices, as grid arrays (GRID_KEYS).

    ``fits`` (structural tuples x ``_knob_rows(space)``, bool) keeps only the pairs marked True; returns the grid
    and how many valid configurations it left out."""
    knobs = _knob_rows(space)
    n_s, n_k = len(struct), len(knobs)
    s_rep = np.repeat(struct, n_k, axis=0)
    k_rep = np.tile(knobs, (n_s, 1))
    grid = {"dp": s_rep[:, 0], "tp": s_rep[:, 1], "pp": s_rep[:, 2], "vpp": s_rep[:, 3], "mb": s_rep[:, 4],
            "ep": s_rep[:, 5], "split": s_rep[:, 6], "dualpipe": s_rep[:, 7],
            "sp": k_rep[:, 0], "zero": k_rep[:, 1], "recompute": k_rep[:, 2], "offload": k_rep[:, 3]}
    ok = ((grid["sp"] == 0) | ((grid["tp"] > 1) & (seq_len % grid["tp"] == 0)))
    ok &= (grid["zero"] == 0) | (grid["dp"] > 1)
    ok &= (grid["offload"] == 0) | (grid["zero"] >= 1)
    left_out = 0
    if fits is not None:
        fits = fits.reshape(-1)
        left_out = int(np.count_nonzero(ok & ~fits))
        ok &= fits
    return {k: v[ok] for k, v in grid.items()}, left_out


def build_grid(model, world, global_batch, seq_len, space: SearchSpace, options) -> dict:
    """Every valid configuration of ``space`` as a dict of equal-length int arrays (GRID_KEYS)."""
    return expand_grid(structural_grid(model, world, global_batch, seq_len, space, options), seq_len, space)[0]


def grid_of(configs) -> dict:
    """Configurations -> grid arrays."""
    configs = list(configs)
    return {
        "dp": np.array([c.dp for c in configs], dtype=np.int64), "tp": np.array([c.tp for c in configs], dtype=np.int64),
        "pp": np.array([c.pp for c in configs], dtype=np.int64), "vpp": np.array([c.vpp for c in configs], dtype=np.int64),
        "sp": np.array([c.sp for c in configs], dtype=np.int64),
        "zero": np.array([c.sharding for c in configs], dtype=np.int64),
        "recompute": np.array([_RC_CODE[c.recompute] for c in configs], dtype=np.int64),
        "offload": np.array([c.offload for c in configs], dtype=np.int64),
        "mb": np.array([c.micro_batch for c in configs], dtype=np.int64),
        "ep": np.array([c.ep for c in configs], dtype=np.int64),
        "split": np.array([_SPLIT_CODE[c.split] for c in configs], dtype=np.int64),
        "dualpipe": np.array([c.dualpipe for c in configs], dtype=np.int64),
    }


def config_at(grid: dict, i: int) -> ParallelConfig:
    return ParallelConfig(dp=int(grid["dp"][i]), tp=int(grid["tp"][i]), pp=int(grid["pp"][i]),
                          vpp=int(grid["vpp"][i]), sp=int(grid["sp"][i]), sharding=int(grid["zero"][i]),
                          recompute=RECOMPUTE[int(grid["recompute"][i])], offload=int(grid["offload"][i]),
                          micro_batch=int(grid["mb"][i]), ep=int(grid["ep"][i]), split=SPLITS[int(grid["split"][i])],
                          dualpipe=int(grid["dualpipe"][i]))


def candidate_at(ev: dict, grid: dict, i: int, global_batch: int, seq_len: int, capacity: float) -> Candidate:
    memory = {k: float(ev["memory"][k][i]) / GB for k in MEMORY_TERMS}
    return Candidate(
        config=config_at(grid, i), global_batch=int(global_batch), seq_len=int(seq_len),
        num_micro_batches=int(round(float(ev["num_micro_batches"][i]))),
        step_time_s=float(ev["step_time_s"][i]), tokens_per_s=float(ev["tokens_per_s"][i]),
        tflops_per_device=float(ev["tflops_per_device"][i]), mfu=float(ev["mfu"][i]),
        memory_gb=memory, memory_per_device_gb=float(ev["memory_total"][i]) / GB, capacity_gb=capacity / GB,
        host_memory_gb=float(ev["host_bytes"][i]) / GB, host_feasible=bool(ev["host_feasible"][i]),
        stage_layers=tuple(int(x[i]) for x in ev["stage_layers"]),
        link_busy_s={k: float(v[i]) for k, v in ev["link_busy_s"].items()},
        time_s={k[:-2]: float(ev[k][i]) for k in TIME_TERMS}, feasible=bool(ev["feasible"][i]))


def evaluate_config(model, cluster, global_batch, seq_len, config: ParallelConfig, options) -> Candidate:
    """Price one configuration (validity is the caller's business; see ``invalid_reason``)."""
    grid = grid_of([config])
    ev = evaluate(model, cluster, global_batch, seq_len, grid, options)
    return candidate_at(ev, grid, 0, global_batch, seq_len, cluster.device.memory_bytes)


def rank_order(ev: dict, grid: dict, feasible_only: bool = True) -> np.ndarray:
    """Indices sorted by (step time, memory, dp, tp, pp, vpp, sp, zero, recompute, offload, mb, ep, split,
    dualpipe)."""
    pool = np.flatnonzero(ev["feasible"]) if feasible_only else np.arange(len(ev["step_time_s"]))
    keys = [grid[k][pool] for k in reversed(GRID_KEYS)] + [ev["memory_total"][pool], ev["step_time_s"][pool]]
    return pool[np.lexsort(keys)]


@dataclass
class SearchOutcome:
    grid: dict                    # every configuration priced
    evaluation: dict              # cost_model.evaluate output for the grid
    order: np.ndarray             # feasible indices, best first
    seconds: float                # wall time of generation + pricing + ranking
    ruled_out: int = 0            # valid configurations not priced: their memory floor exceeds the device

    @property
    def evaluated(self) -> int:
        return int(len(self.grid["dp"]))

    def top(self, k, global_batch, seq_len, capacity):
        return [candidate_at(self.evaluation, self.grid, int(i), global_batch, seq_len, capacity)
                for i in self.order[:k]]

    def least_memory(self):
        """Index of the configuration that needs the least memory (for infeasibility messages)."""
        if self.evaluated == 0:
            return None
        return int(np.lexsort((self.evaluation["step_time_s"], self.evaluation["memory_total"]))[0])


def _knob_count(struct, seq_len, space: SearchSpace) -> int:
    """How many configurations ``expand_grid`` makes of ``struct`` (without building them)."""
    if not len(struct):
        return 0
    tp, dp = struct[:, 1], struct[:, 0]
    every = np.ones(len(struct), dtype=bool)
    sp_ok = (tp > 1) & (seq_len % tp == 0)
    total = 0
    for sp, zero, _, off in itertools.product(space.sp, space.sharding, space.recompute, space.offload):
        if sp not in (0, 1) or zero not in (0, 1, 2, 3) or off not in (0, 1) or (off and zero == 0):
            continue
        total += int(np.count_nonzero((sp_ok if sp else every) & ((dp > 1) if zero else every)))
    return total


def _fits(model, cluster, global_batch, seq_len, struct, space: SearchSpace, options) -> np.ndarray:
    """(structural tuples x ``_knob_rows(space)``) bool: False where a memory floor (cost_model.memory_floors)
    of that configuration exceeds the device, i.e. where it cannot fit."""
    knobs = _knob_rows(space)
    sp_rc = sorted({(int(k[0]), int(k[2])) for k in knobs})
    zero_off = sorted({(int(k[1]), int(k[3])) for k in knobs})
    cols = {"dp": struct[:, 0], "tp": struct[:, 1], "pp": struct[:, 2], "vpp": struct[:, 3], "mb": struct[:, 4],
            "ep": struct[:, 5], "split": struct[:, 6], "dualpipe": struct[:, 7]}
    by_state, by_act = memory_floors(model, cluster, global_batch, seq_len, cols, options, sp_rc, zero_off)
    cap = cluster.device.memory_bytes
    k_state = np.array([zero_off.index((int(k[1]), int(k[3]))) for k in knobs], dtype=np.int64)
    k_act = np.array([sp_rc.index((int(k[0]), int(k[2]))) for k in knobs], dtype=np.int64)
    return (by_state[:, k_state] <= cap) & (by_act[:, k_act] <= cap)


def _priced(model, cluster, global_batch, seq_len, grid, options):
    if len(grid["dp"]) == 0:
        return {"step_time_s": np.zeros(0), "memory_total": np.zeros(0), "feasible": np.zeros(0, dtype=bool)}
    return evaluate(model, cluster, global_batch, seq_len, grid, options)


def search(model, cluster, global_batch, seq_len, space: SearchSpace, options, prune: bool = True) -> SearchOutcome:
    """Price the valid configurations of ``space`` and rank the feasible ones.

    With ``prune`` (the default), configurations whose memory floor exceeds the device (cost_model.memory_floors:
    their weights and states with the least activations any sp/recompute gives, or their activations with the
    least states any ZeRO/offload gives) are not priced: they cannot fit, so the ranking of the feasible
    configurations is the same as without pruning. When nothing fits, everything is priced, so the
    least-memory configuration of the whole space is reported.
    """
    start = time.perf_counter()
    if cluster.runtime is not None and tuple(space.split) != ("even",) and "even" in space.split:
        space = replace(space, split=("even",))     # the eager runtime splits identical blocks evenly
    if cluster.runtime is not None and 0 in space.dualpipe:
        space = replace(space, dualpipe=(0,))       # its profile prices the runtime's own schedules only
    struct = structural_grid(model, cluster.world_size, global_batch, seq_len, space, options)
    if prune and len(struct) and len(_knob_rows(space)):
        fits = _fits(model, cluster, global_batch, seq_len, struct, space, options)
        keep = fits.any(axis=1)
        grid, ruled_out = expand_grid(struct[keep], seq_len, space, fits[keep])
        ruled_out += _knob_count(struct[~keep], seq_len, space)
        ev = _priced(model, cluster, global_batch, seq_len, grid, options)
        if ev["feasible"].any() or not ruled_out:
            order = rank_order(ev, grid)
            return SearchOutcome(grid, ev, order, time.perf_counter() - start, ruled_out)
    grid = expand_grid(struct, seq_len, space)[0]      # nothing fits: price the whole space for the report
    ev = _priced(model, cluster, global_batch, seq_len, grid, options)
    order = rank_order(ev, grid) if len(grid["dp"]) else np.zeros(0, dtype=np.int64)
    return SearchOutcome(grid, ev, order, time.perf_counter() - start)


def enumerate_valid(model, world, global_batch, seq_len, options, space: SearchSpace = None):
    """Every valid configuration, found one at a time by brute force over all knob values and the
    scalar rules of ``invalid_reason`` (independent of ``build_grid``'s generation)."""
    space = space or SearchSpace()
    for dp, tp, pp in itertools.product(divisors(world), repeat=3):
        if dp * tp * pp != world:
            continue
        for vpp, sp, zero, rc, off, mb, ep, split, dual in itertools.product(
                range(1, options.max_vpp + 1), (0, 1), (0, 1, 2, 3), RECOMPUTE, (0, 1), divisors(global_batch),
                divisors(dp), SPLITS, (0, 1) if space.allows("dualpipe", 1) else (0,)):
            config = ParallelConfig(dp, tp, pp, vpp, sp, zero, rc, off, mb, ep, split, dual)
            if not all(space.allows(k, getattr(config, k)) for k in
                       ("dp", "tp", "pp", "vpp", "sp", "sharding", "recompute", "offload", "micro_batch", "ep",
                        "split", "dualpipe")):
                continue
            if invalid_reason(model, world, global_batch, seq_len, config, options) is None and (
                    config.pp == 1 or _split_duplicate(model, seq_len, config) is None):
                yield config


def exhaustive(model, cluster, global_batch, seq_len, options, space: SearchSpace = None):
    """Reference: price every valid configuration alone and return the best feasible Candidate (or None).

    Slow (one cost-model call per configuration); only for search spaces small enough to enumerate.
    Ranking key as in ``rank_order``: step time, memory, then the configuration tuple.
    """
    best, best_key = None, None
    for c in enumerate_valid(model, cluster.world_size, global_batch, seq_len, options, space):
        grid = grid_of([c])
        ev = evaluate(model, cluster, global_batch, seq_len, grid, options)
        if not ev["feasible"][0]:
            continue
        key = (float(ev["step_time_s"][0]), float(ev["memory_total"][0]), c.dp, c.tp, c.pp, c.vpp, c.sp,
               c.sharding, _RC_CODE[c.recompute], c.offload, c.micro_batch, c.ep, _SPLIT_CODE[c.split], c.dualpipe)
        if best_key is None or key < best_key:
            best = candidate_at(ev, grid, 0, global_batch, seq_len, cluster.device.memory_bytes)
            best_key = key
    return best
