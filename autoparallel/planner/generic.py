"""``auto_mode="full"`` on a model the language-model reading cannot price (a CNN, a ViT taking images, a
vision-language model, an encoder-decoder fed two inputs, any model the token-id trace does not read).

    chosen, result = data_parallel_choice(model, strategy, world, cluster, reason, seq_len)

With a sequence length and LayerLists of blocks (a vision tower + a text decoder, an encoder + a decoder), the
model is priced as the sum of its stacks (planner/stacks.py) for every dp x tp the batch and the default plans
(names, then structure: parallel/tp_structure.py) allow, and the cheapest wins; no pipeline, ZeRO or recompute
is considered there. Otherwise: data parallelism over every rank, parameters replicated, as one process would
train it (a batch that does not split that far: as much data parallelism as it allows, times tensor
parallelism where the model's default plan applies). Data parallelism is exact for every model dispatch runs
(batch-coupled layers such as BatchNorm reduce their statistics over the whole batch). The reason the reading
failed, and the priced table, are printed in the explanation, so nothing about the choice is silent. The
global batch must split over dp: otherwise the error names the batch sizes that would.
"""
from __future__ import annotations

from dataclasses import dataclass

from autoparallel.planner.result import PlanResult


@dataclass(frozen=True)
class UnreadModel:
    """What a PlanResult names as its model when the model was not read into a ModelSpec."""
    name: str
    params: int

    def short_dims(self) -> str:
        return f"{self.params:,} parameters, not read as a stack of blocks"


def data_parallel_choice(model, strategy, world: int, cluster, reason: str, seq_len: int = None):
    """(auto_mode="semi" Strategy, PlanResult explaining why) for ``model``: with ``seq_len`` and LayerLists of
    blocks, the cheapest dp x tp of the model priced as the sum of its stacks (planner/stacks.py); otherwise
    dp=world, or dp x tp with the model's default tensor-parallel plan when the global batch does not split
    over every rank."""
    import math

    from autoparallel.strategy import Strategy

    from autoparallel.planner.model_read import allowed_tp

    batch = strategy.global_batch_size
    name = type(model).__name__
    _refuse_undistributable(model)
    priced, stacks_text = _priced(model, world, batch, cluster, seq_len, allowed_tp)
    dp, tp, why = (priced[0].dp, priced[0].tp, "") if priced else _degrees(model, world, batch, allowed_tp)
    if dp is None:
        ok = ", ".join(str(world * k) for k in (1, 2, 4))
        raise ValueError(f"auto_mode='full': {name} is not a model the planner reads as a stack of blocks "
                         f"({reason}), so it runs data parallel over all {world} ranks, which needs "
                         f"strategy.global_batch_size divisible by {world}; got {batch} (e.g. {ok}){why}")
    chosen = Strategy.from_dict({"data_parallel": {"degree": dp}, "tensor_parallel": {"degree": tp},
                                 "pipeline_parallel": {"degree": 1}, "global_batch_size": batch,
                                 "gradient_accumulation_steps": 1})
    chosen.amp = strategy.amp.to_dict()
    chosen.checkpoint = strategy.checkpoint.to_dict()
    chosen.seed = strategy.seed
    keep_accumulation(chosen, strategy)
    params = sum(math.prod(p.shape) for p in model.parameters())
    how = (f"data parallel over all {world} ranks (dp={world}, tp=1, pp=1, no ZeRO), parameters replicated"
           if tp == 1 else f"dp={dp} x tp={tp} ({_why_tp(priced, batch, world)}tensor parallel with the model's "
                           f"default plan), pp=1, no ZeRO")
    explanation = (f"model {name}: not read as a stack of blocks ({reason})\n{stacks_text}"
                   f"chosen: {how}, {batch // dp} samples per data-parallel rank; other tensor or pipeline layouts "
                   f"for this model need auto_mode='semi' with tp_plan= / split_points=")
    result = PlanResult(model=UnreadModel(name, params), cluster=cluster, global_batch_size=batch,
                        seq_len=int(seq_len or 0), candidates=[], explanation=explanation, feasible=True,
                        evaluated=max(len(priced), 1), seconds=0.0,
                        mode="fixed")
    return chosen, result


def keep_accumulation(chosen, user):
    """The user's ``gradient_accumulation_steps`` > 1 is the shape of their loop (that many forwards and
    backwards per optimizer step): the chosen strategy keeps it (micro-batch size from the global batch)
    rather than the planner's own count, which the loop would not match. A pipeline runs its micro-batches
    inside one step, so there the planner's count stays."""
    if user.gradient_accumulation_steps > 1 and chosen.pipeline_parallel.degree == 1:
        chosen.gradient_accumulation_steps = user.gradient_accumulation_steps
        chosen.micro_batch_size = None
    return chosen


def _why_tp(priced, batch: int, world: int) -> str:
    split = "" if batch % world == 0 else f"the batch of {batch} does not split {world} ways; "
    return split + ("the cheapest priced; " if priced else "")


def _priced(model, world: int, batch: int, cluster, seq_len, allowed_tp):
    """([Priced] cheapest first, explanation lines) of the model as the sum of its stacks; ([], "") when it
    has no LayerList of blocks or no sequence length is known."""
    from autoparallel.planner.options import options_for_cluster
    from autoparallel.planner.stacks import find_stacks, price_grid, read_stacks

    if not seq_len or not find_stacks(model):
        return [], ""
    allowed = allowed_tp(model, world)
    table = price_grid(model, cluster, batch, seq_len, world, allowed,
                       options_for_cluster(cluster).gemm_efficiency)
    if not table:
        return [], ""
    tp = table[0].tp if table[0].tp > 1 else min((p.tp for p in table if p.tp > 1), default=2)
    lines = [f"  {s.short()}" for s in read_stacks(model, tp)]
    lines += [f"  {p.short()}" for p in table]
    lines += [f"  tp={k} refused: {why}" for k, why in allowed.items() if why is not None]
    return table, (f"priced as the sum of its stacks ({seq_len} tokens per sample in every stack; the split "
                   f"by the default plan shown at tp={tp}):\n" + "\n".join(lines) + "\n")


def _degrees(model, world: int, batch: int, allowed_tp):
    """(dp, tp, "") with dp = world when the batch splits that way, else the largest dp dividing both and
    tp = world / dp if the model's default tensor-parallel plan takes it; (None, None, why) otherwise."""
    if batch % world == 0:
        return world, 1, ""
    dp = max(d for d in range(1, world + 1) if world % d == 0 and batch % d == 0)
    why = allowed_tp(model, world).get(world // dp)
    if why is None:
        return dp, world // dp, ""
    return None, None, f"; dp={dp} x tp={world // dp} is refused: {why}"


def _refuse_undistributable(model) -> None:
    """Layers that cannot run on distributed tensors (a sparse-gradient embedding) fail at the first forward
    of any plan; say so when planning, naming the layer."""
    import paddle

    for lname, layer in model.named_sublayers():
        if isinstance(layer, paddle.nn.Embedding) and getattr(layer, "_sparse", False):
            raise NotImplementedError(f"auto_mode='full': {type(model).__name__}.{lname} is an Embedding with "
                                      f"sparse=True, whose sparse gradient cannot be reduced across ranks; build "
                                      f"it with sparse=False (the same values)")
