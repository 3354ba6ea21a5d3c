"""Which Strategy fields each entry point honours: effective or rejected, never silently ignored.

Entry points: ``ap.parallelize(model, opt, strategy=s)``, ``ap.DataParallel(model, strategy=s)`` +
``ap.Optimizer(opt)`` (the same build in two calls) and ``ap.to_static(model, loader, loss_fn, opt,
strategy=s)``. ``TABLE[field][entry]`` is ``EFFECTIVE`` (the field changes what the entry point does) or
``REJECTED`` (a value other than the default raises NotImplementedError naming the field and the entry
points that honour it). Fields are named by their dotted path (``"sharding.stage"``) and enumerated from
the Strategy dataclasses, so a new field must be classified here (tests/test_entry_points.py fails until
it is). docs/entry_points.md shows the table.

Dependent fields (``amp.dtype``, ``sharding.stage``, ...) act only with their section's ``enable``; setting
one while the section is off is refused by ``Strategy.validate``, as is a loss-scaling field with
bfloat16 (no scaling) and a pipeline schedule without a pipeline.
"""
from __future__ import annotations

import dataclasses

from autoparallel.strategy import Strategy

PARALLELIZE, DATA_PARALLEL, TO_STATIC = "parallelize", "DataParallel+Optimizer", "to_static"
ENTRY_POINTS = (PARALLELIZE, DATA_PARALLEL, TO_STATIC)
EFFECTIVE, REJECTED = "effective", "rejected"
CALLS = {PARALLELIZE: "ap.parallelize", DATA_PARALLEL: "ap.DataParallel + ap.Optimizer", TO_STATIC: "ap.to_static"}


def strategy_fields(cls=Strategy, prefix: str = "") -> list:
    """Every leaf field of the Strategy as a dotted path, in declaration order."""
    out = []
    for f in dataclasses.fields(cls):
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            out += strategy_fields(sub, prefix + f.name + ".")
        else:
            out.append(prefix + f.name)
    return out


_TO_STATIC_REJECTS = ("pipeline_parallel.", "amp.", "checkpoint.", "micro_batch_size", "global_batch_size")
_WHY = {
    "pipeline_parallel.": "the captured graph runs one stage",
    "amp.": "the captured graph has no autocast boundaries or loss scaler",
    "checkpoint.": "DistModel has no post-step hook; save with ap.save_state_dict",
    "micro_batch_size": "the batch shape comes from the loader / input_spec",
    "global_batch_size": "the batch shape comes from the loader / input_spec",
}


def _classify(name: str) -> dict:
    to_static = REJECTED if name.startswith(_TO_STATIC_REJECTS) else EFFECTIVE
    return {PARALLELIZE: EFFECTIVE, DATA_PARALLEL: EFFECTIVE, TO_STATIC: to_static}


TABLE = {name: _classify(name) for name in strategy_fields()}

# Fields that act on the optimizer: ap.parallelize without one cannot honour them.
OPTIMIZER_FIELDS = ("sharding.", "gradient_accumulation_steps", "checkpoint.", "amp.init_loss_scaling",
                    "amp.incr_every_n_steps", "amp.decr_every_n_nan_or_inf", "amp.incr_ratio", "amp.decr_ratio",
                    "amp.use_dynamic_loss_scaling")


def get(strategy, name: str):
    v = strategy
    for part in name.split("."):
        v = getattr(v, part)
    return v


def non_default(strategy) -> dict:
    """{dotted field: value} of the fields that differ from a fresh Strategy()."""
    default = Strategy()
    return {n: get(strategy, n) for n in TABLE if get(strategy, n) != get(default, n)}


def _honoured_by(name: str) -> str:
    return " or ".join(CALLS[e] for e in ENTRY_POINTS if TABLE[name][e] == EFFECTIVE)


def _why(name: str) -> str:
    return next((w for k, w in _WHY.items() if name.startswith(k)), "")


def reject_unsupported(strategy, entry: str) -> None:
    """NotImplementedError naming every set field ``entry`` cannot honour and who honours it."""
    if entry not in ENTRY_POINTS:
        raise ValueError(f"unknown entry point {entry!r}; expected one of {ENTRY_POINTS}")
    bad = [(n, v) for n, v in non_default(strategy).items() if TABLE[n][entry] == REJECTED]
    if bad:
        lines = "; ".join(f"strategy.{n}={v!r} ({_why(n)}; honoured by {_honoured_by(n)})" for n, v in bad)
        raise NotImplementedError(f"{CALLS[entry]} cannot honour {lines}")


def reject_needing_optimizer(strategy, call: str) -> None:
    """``ap.parallelize(model, None, strategy=s)``: options that act on the optimizer would do nothing."""
    bad = [f"{n}={v!r}" for n, v in non_default(strategy).items() if n.startswith(OPTIMIZER_FIELDS)]
    if bad:
        raise ValueError(f"{call} without an optimizer cannot honour strategy {', '.join(bad)} (they act on the "
                         f"optimizer); pass it: ap.parallelize(model, optimizer, strategy=s), or build in two "
                         f"calls with ap.DataParallel(model, strategy=s) + ap.Optimizer(optimizer)")


def reject_without_model(strategy) -> None:
    """``ap.Optimizer`` over no ap.DataParallel model: only the optimizer's own options can act."""
    allowed = ("gradient_accumulation_steps", "seed")
    bad = [f"{n}={v!r}" for n, v in non_default(strategy).items() if n not in allowed]
    if bad:
        raise ValueError(f"ap.Optimizer(strategy=...) found no model built by ap.DataParallel for the optimizer's "
                         f"parameters, so it cannot honour strategy {', '.join(bad)}; call "
                         f"ap.DataParallel(model, strategy=s) first, or use ap.parallelize(model, opt, strategy=s)")


def check_to_static(strategy, optimizer) -> None:
    """``ap.to_static``: refuse what it cannot honour, apply the seed."""
    reject_unsupported(strategy, TO_STATIC)
    if optimizer is None and strategy.sharding.enable:
        raise ValueError("ap.to_static without an optimizer cannot honour strategy sharding.enable=True (ZeRO "
                         "shards the optimizer's states); pass the optimizer")
    apply_seed(strategy)


def apply_seed(strategy) -> None:
    """``strategy.seed``: seed paddle, numpy and python ``random`` (every rank the same seed)."""
    if strategy.seed is None:
        return
    import random

    import numpy as np
    import paddle

    paddle.seed(strategy.seed)
    np.random.seed(strategy.seed)
    random.seed(strategy.seed)


def check_batch(strategy, degrees, batch: int, what: str) -> None:
    """``micro_batch_size`` / ``global_batch_size``: the batch fed per forward (``what``) must be theirs."""
    if degrees is None or degrees.global_batch_size is None:
        return
    want = degrees.global_batch_size // (1 if degrees.pp > 1 else degrees.num_micro_batches)
    if batch != want:
        given = ", ".join(f"{n}={v}" for n, v in (("micro_batch_size", strategy.micro_batch_size),
                                                   ("global_batch_size", strategy.global_batch_size)) if v)
        raise ValueError(f"{what} has batch size {batch}, but strategy {given} with dp={degrees.dp} and "
                         f"{degrees.num_micro_batches} micro-batches per step expects {want} samples per "
                         f"{'step' if degrees.pp > 1 else 'forward'}")


def batch_hook(model, strategy, degrees) -> None:
    """A forward pre-hook checking the global batch of each forward against the strategy's batch sizes."""
    if degrees is None or degrees.global_batch_size is None:
        return

    def pre(_layer, inputs):
        x = next((t for t in inputs if hasattr(t, "shape") and len(t.shape)), None)
        if x is not None:
            check_batch(strategy, degrees, int(x.shape[0]), f"the input of {type(model).__name__}")
        return None

    model.register_forward_pre_hook(pre)


def checked_train_batch(pipe, strategy, degrees) -> None:
    """The pipeline's ``train_batch(inputs, labels)`` takes the global batch of a step: check it."""
    if degrees is None or degrees.global_batch_size is None:
        return
    run = pipe.train_batch

    def train_batch(inputs, labels=None):
        if inputs is not None and hasattr(inputs, "shape"):
            check_batch(strategy, degrees, int(inputs.shape[0]), "pipe.train_batch's inputs")
        return run(inputs, labels)

    pipe.train_batch = train_batch


def markdown_table() -> str:
    """The table as markdown (docs/entry_points.md): ``python -m autoparallel.entry_points``."""
    head = "| Strategy field | " + " | ".join(CALLS[e] for e in ENTRY_POINTS) + " |"
    rows = [head, "|" + "---|" * (len(ENTRY_POINTS) + 1)]
    for name, by in TABLE.items():
        cells = [by[e] if by[e] == EFFECTIVE else f"**rejected** ({_why(name)})" for e in ENTRY_POINTS]
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
