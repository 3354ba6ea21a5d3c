"""A pipeline's state under the model's (un-pipelined) names: each stage's ranks save their stage.

Stages keep the model's parameter names (``blocks.4.attn.qkv.weight``), so a pipeline checkpoint and an
un-pipelined one have the same entries. In a real job every rank's state lists every entry of the model:

* its own stages' parameters and optimizer states, as DistTensors on the mesh of the pipeline ranks
  holding that parameter x the stage's ``[data, model]`` mesh, ``Replicate`` over the pipeline dim: a
  parameter shared by two stages (a tied embedding and LM head) is written once, by the first holder,
  and loaded by both; data-parallel replicas write once, tensor-parallel shards each their own box;
* other stages' entries as ``HeldElsewhere`` (saved by their ranks, checked but not read on load).

In one process (every stage here) the state is the plain model's.
"""
from __future__ import annotations

import numpy as np

from autoparallel.checkpoint.leaves import ELSEWHERE


def pipeline_training_state(pipe, optimizer=None) -> dict:
    from autoparallel.checkpoint.state import model_state, optimizer_state, paddle_optimizer

    held_model = model_state(pipe)
    held_opt = optimizer_state(paddle_optimizer(optimizer), pipe, optimizer) if optimizer is not None else None
    if pipe.ranks is None:                           # one process runs every stage
        state = {"model": held_model}
        if held_opt is not None:
            state["optimizer"] = held_opt
        return state
    holders = _holders(pipe)
    acc_names = sorted({a for accs in (held_opt or {}).values() for a in accs})
    model, opt = {}, {}
    for name, p in _all_parameters(pipe):
        if name in held_model:
            model[name] = _on_holders(pipe, holders[name], held_model[name])
            if held_opt is not None and name in held_opt:
                opt[name] = {a: _on_holders(pipe, holders[name], t) for a, t in held_opt[name].items()}
        else:
            model[name] = ELSEWHERE
            if held_opt is not None and not p.stop_gradient:
                opt[name] = {a: ELSEWHERE for a in acc_names}
    state = {"model": model}
    if held_opt is not None:
        state["optimizer"] = opt
    return state


def _all_parameters(pipe) -> list:
    """(model name, parameter) of every stage, in stage order, each name once."""
    out, seen = [], set()
    for st in pipe.stages:
        for name, p in st.named_parameters():
            if name not in seen:
                seen.add(name)
                out.append((name, p))
    return out


def _holders(pipe) -> dict:
    """{model name: sorted pipeline ranks whose stages hold it}."""
    pp = pipe.plan.pp
    out: dict = {}
    for st in pipe.stages:
        for name, _ in st.named_parameters():
            out.setdefault(name, set()).add(st.index % pp)
    return {n: sorted(rs) for n, rs in out.items()}


def _on_holders(pipe, pp_ranks, leaf):
    """``leaf`` (this rank's tensor or a DistTensor on its stage's [data, model] mesh) as a DistTensor on
    [holding pipeline ranks, data, model], replicated over the first dim."""
    from autoparallel.dist_tensor import DistTensor, as_dist, is_dist
    from autoparallel.mesh import ProcessMesh
    from autoparallel.placement import Replicate
    from autoparallel.spec import DistSpec, normalize_dtype

    ranks = np.asarray(pipe.ranks)[list(pp_ranks)]
    mesh = ProcessMesh(ranks.tolist(), ["pipe", "data", "model"], create_groups=False)
    if is_dist(leaf):
        dt = as_dist(leaf)
        inner, shape, dtype, local = list(dt.spec.placements), dt.spec.shape, dt.spec.dtype, dt.locals[pipe.rank]
        if len(inner) != 2:
            raise ValueError(f"a pipeline stage tensor lives on a [data, model] mesh, got {dt.spec}")
    else:
        inner, shape, dtype, local = [Replicate(), Replicate()], list(leaf.shape), normalize_dtype(leaf.dtype), leaf
    return DistTensor({pipe.rank: local}, DistSpec(mesh, [Replicate()] + inner, shape, dtype))
