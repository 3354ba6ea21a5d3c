"""The training state of a pipelined ZeRO run under the model's (un-pipelined) names, for ``ap.training_state``.

Each stage sub-mesh's ZeRO optimizer gives its parameters and optimizer states as global tensors
(checkpoint/zero_state.py: every rank writes its chunk's boxes, so a checkpoint loads into any other layout);
the pipeline adds what checkpoint/pipeline_state.py does for a plain pipeline: on real ranks every entry of the
model is listed, other stages' entries as ``HeldElsewhere``; a parameter held by stages on several pipeline
ranks (a tied embedding / LM head) is written by the lowest of them only and read by all. Parameters no ZeRO
optimizer steps (frozen ones) are saved as the plain pipeline saves them.
"""
from __future__ import annotations

from autoparallel.checkpoint.leaves import ELSEWHERE, ShardedLeaf


class _Named:
    """The ``named_parameters()`` view zero_training_state reads: one ZeRO optimizer's parameters."""

    def __init__(self, pairs):
        self.pairs = list(pairs)

    def named_parameters(self):
        return iter(self.pairs)


class _FirstHolder(ShardedLeaf):
    """A ZeRO leaf of a parameter held by several pipeline ranks: saved by the lowest only, loaded by all."""

    def __init__(self, leaf, writes: bool):
        self.leaf, self.writes = leaf, writes
        self.shape, self.dtype = leaf.shape, leaf.dtype

    def saved_boxes(self) -> list:
        return self.leaf.saved_boxes() if self.writes else []

    def wanted_boxes(self) -> list:
        return self.leaf.wanted_boxes()

    def assign(self, loaded: list) -> None:
        self.leaf.assign(loaded)

    def held_boxes(self) -> list:
        return self.leaf.held_boxes()

    def layout_json(self) -> dict:
        return self.leaf.layout_json()


def pipeline_zero_state(popt, pipe) -> dict:
    from autoparallel.checkpoint.state import model_state
    from autoparallel.checkpoint.zero_state import zero_training_state

    names = {id(p): n for n, p in pipe.named_parameters()}
    model, opt = dict(model_state(pipe)), {}
    for z in popt.zeros:
        st = zero_training_state(z, _Named((names[id(p)], p) for p in z.params))
        model.update(st["model"])
        opt.update(st["optimizer"])
    if pipe.ranks is None:                       # one process runs every stage
        return {"model": model, "optimizer": opt}
    return _on_real_ranks(pipe, model, opt)


def _on_real_ranks(pipe, held_model, held_opt) -> dict:
    from autoparallel.checkpoint.pipeline_state import _all_parameters, _holders, _on_holders

    holders = _holders(pipe)
    acc_names = sorted({a for accs in held_opt.values() for a in accs})
    model, opt = {}, {}
    for name, p in _all_parameters(pipe):
        if name not in held_model:
            model[name] = ELSEWHERE
            if not p.stop_gradient:
                opt[name] = {a: ELSEWHERE for a in acc_names}
            continue
        first = pipe.pp_rank == holders[name][0]
        model[name] = _place(pipe, holders[name], held_model[name], first, _on_holders)
        if name in held_opt:
            opt[name] = {a: _place(pipe, holders[name], t, first, _on_holders) for a, t in held_opt[name].items()}
    return {"model": model, "optimizer": opt}


def _place(pipe, pp_ranks, leaf, first: bool, on_holders):
    if isinstance(leaf, ShardedLeaf):
        return _FirstHolder(leaf, first) if len(pp_ranks) > 1 else leaf
    return on_holders(pipe, pp_ranks, leaf)
