"""``auto_mode="full"`` in ``ap.parallelize``: the planner chooses the strategy for the actual world.

    s = ap.Strategy(); s.auto_mode = "full"; s.global_batch_size = 8
    model, opt = ap.parallelize(model, opt, strategy=s, seq_len=16)   # prints the plan's explanation

Steps: the model is traced into a ModelSpec (``ModelSpec.from_trace``: parameters, FLOPs, op counts);
the cluster is the calibrated profile named by the ``cluster`` argument, else by the environment variable
``AP_CLUSTER_PROFILE`` (a JSON written by ``autoparallel calibrate``), else the built-in profile of this
world's backend (``profiles.default_profile``: gloo -> the CPU profile measured on the development machine,
nccl -> nodes of 8 A100-80GB), resized to the world; the search covers what the eager runtime executes:
dp / tp / sp / ZeRO stage 0-3 / recompute none, selective, full / micro-batching, and pipeline stages
(1F1B, or VPP) with ZeRO stage 0-2 inside the stages (sharded over each stage's data ranks, so dp > 1;
the pipeline runtime refuses stage 3) and no recompute; no optimizer offload on a CPU profile (the host
is the device). The fastest configuration that also passes the runtime's own checks (``runtime_refusal``:
``Strategy.validate``, and for pipelines ``parallel/pipeline/wiring._check_composable``) wins; it becomes
an ``auto_mode="semi"`` Strategy keeping the user's AMP, checkpoint, batch and seed settings, and
parallelize runs its normal apply steps with it. What the user fixed next to auto_mode="full" (degrees,
sequence parallelism, ZeRO stage, recompute, a mesh's dim sizes, a tp_plan needing tp > 1) narrows the search;
any other planner field set is refused by name (planner/user_fixed.py). The returned
``ap.chosen_strategy(model)`` / ``ap.chosen_plan(model)`` give the chosen Strategy and its PlanResult.
"""
from __future__ import annotations

import os

from autoparallel.core.cluster import ClusterSpec, parse_cluster
from autoparallel.planner.search import divisors

ENV_PROFILE = "AP_CLUSTER_PROFILE"
CANDIDATES = 64                    # ranked candidates checked against Strategy.validate, best first
SHOWN = 5                          # candidates kept in the returned (and printed) PlanResult
PIPELINE_ZERO = [0, 1, 2]          # ZeRO stages the pipeline runtime runs inside its stages (parallel/pipeline/zero.py)


def resolve_cluster(cluster, world: int, backend: str) -> ClusterSpec:
    """The cluster the planner prices, resized to ``world`` ranks (see the module docstring)."""
    from autoparallel.planner.profiles import default_profile, for_world

    if cluster is None and os.environ.get(ENV_PROFILE):
        path = os.environ[ENV_PROFILE]
        if not os.path.isfile(path):
            raise FileNotFoundError(f"${ENV_PROFILE}={path!r} names no file; expected a profile JSON written by "
                                    f"'autoparallel calibrate'")
        cluster = path
    base = default_profile(backend) if cluster is None else parse_cluster(cluster)
    return for_world(base, world)


def infer_seq_len(model, seq_len):
    """``seq_len`` if given, else the model config's ``seq_len`` or ``max_positions``."""
    if seq_len is not None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        return seq_len
    c = getattr(model, "config", None)
    for name in ("seq_len", "max_positions", "max_position_embeddings"):
        value = getattr(c, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"auto_mode='full' prices a sequence length: pass seq_len= to ap.parallelize (the model "
                     f"{type(model).__name__} has no config.seq_len or config.max_positions)")


def _searches(world: int, layers: int, pipeline_ok: bool, cpu: bool, selective_ok: bool = True,
              inside_ok: bool = True) -> list:
    """Constraint sets covering what the eager runtime executes (see the module docstring); selective
    recompute only for models whose attention core it can find (``_selective_ok``); pipelines with data or
    tensor parallelism (hence ZeRO) inside the stages only where the runtime lays them out (``_inside_ok``)."""
    offload = [0] if cpu else [0, 1]
    recompute = ["none", "selective", "full"] if selective_ok else ["none", "full"]
    spaces = [dict(pp=[1], offload=offload, ep=[1], recompute=recompute)]
    stages = [p for p in divisors(world) if 1 < p <= layers]
    if pipeline_ok and stages:               # the runtime splits blocks evenly and runs experts replicated
        inside = {} if inside_ok else dict(dp=[1], tp=[1], sharding=[0])
        spaces.append(dict(dict(pp=stages, sharding=PIPELINE_ZERO, recompute=["none"], offload=offload,
                                split=["even"], ep=[1]), **inside))
    return spaces


def _selective_ok(model) -> bool:
    """Selective recompute re-runs the attention core, a module-level function of the blocks' attention module
    (parallel/recompute.py looks it up by name); a model without one takes none or full recompute only."""
    from autoparallel.planner.from_trace import _core_module, _find_blocks

    _, blocks = _find_blocks(model)
    return _core_module(blocks[0])[0] is not None


def _inside_ok(model, simulated: bool) -> bool:
    """Data / tensor parallelism inside pipeline stages: one simulated world refuses it when stages on different
    pipeline ranks share a parameter (a tied embedding and LM head: ``wiring._simulated_stage_meshes``); real
    ranks sum such gradients across the stages. Checked with the runtime's own two-stage split."""
    from autoparallel.lazy_init import has_lazy

    if not simulated or has_lazy(model):        # a lazy model runs no pipeline (ap.parallelize refuses it)
        return True
    from autoparallel.parallel.pipeline.shared_params import shared_parameters
    from autoparallel.parallel.pipeline.stage import build_stages, plan_pipeline

    try:
        plan = plan_pipeline(model, 2, 2, "1F1B", 1, None, "params")
    except (ValueError, TypeError):             # no pipeline split at all: the pipeline search is off anyway
        return True
    return not shared_parameters(build_stages(plan.pieces, plan.bounds), 2)


def _pipeline_ok(model) -> bool:
    """The pipeline runtime splits models with embed(ids), head(x) and a LayerList of blocks."""
    import paddle

    pieces = callable(getattr(model, "embed", None)) and callable(getattr(model, "head", None))
    return pieces and any(isinstance(l, paddle.nn.LayerList) for _, l in model.named_sublayers())


def to_strategy(candidate, user):
    """The candidate as an auto_mode="semi" Strategy with the user's AMP, checkpoint and seed."""
    from autoparallel.strategy import Strategy

    s = Strategy.from_dict(candidate.to_strategy_dict())
    s.amp = user.amp.to_dict()
    s.checkpoint = user.checkpoint.to_dict()
    s.seed = user.seed
    from autoparallel.planner.generic import keep_accumulation

    return keep_accumulation(s, user)


def choose(model, strategy, world: int, seq_len=None, cluster=None, backend: str = "gloo", simulated: bool = False,
           applied: bool = False, mesh=None, tp_plan=None):
    """(chosen Strategy, PlanResult) for ``model`` on ``world`` ranks (``simulated``: of one ``ap.simulate``
    world, whose pipeline runtime lays out no parameter shared by stages on two stage meshes; ``applied``: the
    plan is applied next, so a ``paddle.LazyGuard`` model, which ap.parallelize does not pipeline, gets none).
    Fields the user fixed and the degrees of ``mesh`` narrow the search or are refused (planner/user_fixed.py);
    a ``tp_plan`` needs tensor parallelism, so only tp > 1 is searched."""
    from autoparallel.planner.user_fixed import check_kept, fixed_constraints, with_tp_plan

    fixed = fixed_constraints(strategy, mesh, world)
    if tp_plan:
        fixed = with_tp_plan(fixed, tp_plan, world)
    chosen, result = _choose(model, strategy, world, seq_len, cluster, backend, simulated, applied, fixed,
                             bool(tp_plan))
    check_kept(chosen, fixed)
    return chosen, result


def _choose(model, strategy, world, seq_len, cluster, backend, simulated, applied, fixed, own_plan=False):
    from autoparallel.lazy_init import has_lazy
    from autoparallel.parallel.model_families import model_info
    from autoparallel.planner.api import plan
    from autoparallel.planner.model_read import allowed_tp, read_model
    from autoparallel.planner.user_fixed import accumulation_sizes, describe, narrowed, same_loop

    if strategy.global_batch_size is None:
        raise ValueError("auto_mode='full' needs strategy.global_batch_size (samples per optimizer step over all "
                         "ranks) to choose data parallelism and micro-batching; got None")
    target = resolve_cluster(cluster, world, backend)
    unread = _unreadable(model)
    if unread is None and seq_len is None and not _takes_tokens(model):
        try:
            infer_seq_len(model, seq_len)
        except ValueError as e:                     # a ViT / mixer over patches: the seq_len of token ids is moot
            unread = f"it has no token embedding and {_first_line(e)}"
    if unread is None:
        seq = infer_seq_len(model, seq_len)
        try:
            spec = read_model(model, seq, type(model).__name__)
        except Exception as e:                      # noqa: BLE001 -- the trace ran the model on token ids
            _refuse_too_long(model, seq, e)
            unread = f"its forward on a [1, {seq}] batch of token ids failed: {type(e).__name__}: {_first_line(e)}"
    if unread is not None:
        from autoparallel.planner.generic import data_parallel_choice

        return data_parallel_choice(model, strategy, world, target, unread, _seq_or_none(model, seq_len))
    info = model_info(model)
    limits = allowed_tp(model, world, own_plan)
    tps = [tp for tp, why in limits.items() if why is None]
    results, empty = [], []
    pipeline_ok = _pipeline_ok(model) and not (applied and has_lazy(model))
    sizes = accumulation_sizes(strategy, world)
    if fixed.get("pp", (1,))[0] > 1 and not pipeline_ok:
        raise ValueError(f"auto_mode='full': pipeline_parallel.degree={fixed['pp'][0]} is fixed, but the planner's "
                         f"pipeline search covers only models with embed() / head() methods and a LayerList of blocks "
                         f"(built without paddle.LazyGuard); {type(model).__name__} is not one: expected "
                         f"pipeline_parallel.degree=1, or auto_mode='semi' (split_points=)")
    for constraints in _searches(world, spec.layers, pipeline_ok, target.runtime is not None, _selective_ok(model),
                                 not pipeline_ok or _inside_ok(model, simulated)):
        if sizes and constraints["pp"] == [1]:
            constraints = dict(constraints, micro_batch=list(sizes))
        constraints, outside = narrowed(dict({"tp": tps}, **constraints), fixed)
        if outside:
            empty.append(outside)
            continue
        try:
            results.append(plan(spec, target, strategy.global_batch_size, seq, top=CANDIDATES, **constraints))
        except ValueError as e:                 # e.g. no pipeline configuration divides this batch
            empty.append(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            continue
    valid = []                                  # (step, memory, search, index, strategy), fastest first
    for i, r in enumerate(results):
        for j, c in enumerate(r.candidates):
            chosen = to_strategy(c, strategy)
            if not same_loop(c.config, strategy) or runtime_refusal(chosen, world, info) is not None:
                continue
            valid.append((c.step_time_s, c.memory_per_device_gb, i, j, chosen))
    if valid:
        _, _, i, j, chosen = min(valid, key=lambda v: v[:4])
        others = [min((v for v in valid if v[2] == k), key=lambda v: v[:4]) for k in range(len(results)) if k != i
                  and any(v[2] == k for v in valid)]
        result = _with_winner(results[i], j, [results[v[2]].candidates[v[3]] for v in others])
        return chosen, _with_reading(result, spec, limits, describe(fixed))
    raise ValueError(f"auto_mode='full': no configuration of {spec.name} ({spec.short_dims()}) with global batch "
                     f"{strategy.global_batch_size} fits {world} ranks of {target.name} and passes the strategy "
                     f"checks{_why_empty(empty, limits)}; choose the degrees yourself (auto_mode='semi')")


def _why_empty(empty: list, limits: dict) -> str:
    """The searches' own reasons and the refused tp degrees, for the no-configuration message."""
    refused = [f"tp={tp}: {why}" for tp, why in limits.items() if why is not None]
    parts = empty[:1] + refused                 # the searches repeat one reason (the first names the dp rule)
    return (" (" + "; ".join(parts) + ")") if parts else ""


def runtime_refusal(chosen, world: int, info: dict):
    """Why the runtime would refuse ``chosen`` on ``world`` ranks (its own dry checks, nothing built), or None:
    ``Strategy.validate`` and, with pipeline stages, ``apply_pp``'s ``_check_composable`` (ZeRO stage 3 and
    sharding on one-rank stages refused). tests/test_probe_planner_pp_zero.py checks the whole eager search space
    against these and ``ap.parallelize``'s own checks."""
    from autoparallel.parallel.pipeline.wiring import _check_composable

    try:
        degrees = chosen.validate(world_size=world, model_info=info)
        if degrees.pp > 1:
            _check_composable(chosen, degrees)
    except (ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {_first_line(e)}"
    return None


def _unreadable(model):
    """Why the language-model reading cannot apply to ``model`` (no LayerList of blocks), or None."""
    from autoparallel.planner.from_trace import _find_blocks

    try:
        _find_blocks(model)
    except ValueError as e:
        return _first_line(e)
    return None


def _refuse_too_long(model, seq: int, error) -> None:
    """A forward failing at a sequence longer than the model's configured positions is the sequence length's
    fault, not a model the planner cannot read: the training step would fail the same way."""
    c = getattr(model, "config", None)
    for name in ("max_positions", "max_position_embeddings", "seq_len"):
        limit = getattr(c, name, None)
        if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < seq:
            raise ValueError(f"auto_mode='full': seq_len={seq} exceeds {type(model).__name__}'s config.{name}="
                             f"{limit}, and its forward fails at that length ({type(error).__name__}: "
                             f"{_first_line(error)}); expected seq_len <= {limit}") from error


def _seq_or_none(model, seq_len):
    try:
        return infer_seq_len(model, seq_len)
    except ValueError:
        return None


def _takes_tokens(model) -> bool:
    import paddle

    return any(isinstance(l, paddle.nn.Embedding) for l in model.sublayers())


def _first_line(e) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def _with_winner(result, index, others=()):
    """The PlanResult with the chosen candidate first and the next ones after it (``SHOWN`` in all); the
    explanation also names the best configuration of the other searches (pipelines)."""
    from dataclasses import replace

    cands = [result.candidates[index]] + [c for k, c in enumerate(result.candidates) if k > index]
    note = "" if index == 0 else (f"(the {index} faster configurations fail the strategy checks of this runtime; "
                                  f"#1 below is the fastest that passes)\n")
    tail = "".join(f"\n  best with pipeline stages (ZeRO 0-2 inside the stages, recompute off, as the pipeline "
                   f"runtime composes): {c.config.short()}: {c.step_time_s:.3f} s" for c in others)
    return replace(result, candidates=cands[:SHOWN], explanation=note + result.explanation + tail
                   + zero_in_stages(cands[0]))


def zero_in_stages(candidate) -> str:
    """The line naming a chosen ZeRO-inside-pipeline-stages plan: what is sharded, over which ranks, and the
    memory per rank of the stage that needs most."""
    c = candidate.config
    if c.pp == 1 or c.sharding == 0:
        return ""
    what = "optimizer states" + (" and gradients" if c.sharding == 2 else "")
    return (f"\n  chosen: ZeRO-{c.sharding} inside the {c.pp} pipeline stages: each stage shards its {what} over "
            f"its {c.dp} data ranks (parallel/pipeline/zero.py); {candidate.memory_per_device_gb:.3g} GB per rank "
            f"on the fullest stage")


def _with_reading(result, spec, limits, fixed_line=""):
    """The explanation prefixed by what was read off the model, the tensor-parallel degrees it refuses and
    what the user fixed."""
    from dataclasses import replace

    refused = "".join(f"\n  tp={tp} refused: {why}" for tp, why in limits.items() if why is not None)
    refused += f"\n  {fixed_line}" if fixed_line else ""
    head = f"model {spec.name} ({spec.short_dims()}{_moe_dims(spec)}): {spec.source or 'given'}{refused}\n"
    return replace(result, explanation=head + result.explanation)


def _moe_dims(spec) -> str:
    if not spec.is_moe:
        return ""
    return (f", experts={spec.experts}, top_k={spec.top_k}, expert_ffn={spec.expert_ffn}, "
            f"shared_experts={spec.shared_experts}, dense_layers={spec.dense_layers}")


def plan_strategy(model, strategy, seq_len=None, cluster=None, mesh=None, tp_plan=None):
    """(chosen Strategy, PlanResult) for the current world (degrees fixed by ``mesh``, when given); the
    explanation is printed on rank 0. The caller (``ap.parallelize``) applies the chosen strategy."""
    from autoparallel.comm.world import current_world

    world = current_world()
    chosen, result = choose(model, strategy, world.world_size, seq_len, cluster, world.backend,
                            bool(getattr(world, "is_simulated", False)), applied=True, mesh=mesh, tp_plan=tp_plan)
    if getattr(world, "rank", 0) == 0:
        n = world.world_size
        print(f"auto_mode='full': planned for {n} rank{'s' if n != 1 else ''} on {result.cluster.name}\n{result}\n"
              f"chosen: {chosen}", flush=True)
    return chosen, result
