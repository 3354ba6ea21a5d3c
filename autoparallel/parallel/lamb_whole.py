"""Lamb over sharded parameters (tensor-parallel shards, ZeRO chunks): the trust ratio of the whole parameter.

paddle's fused Lamb updates a parameter by ``w -= lr * ratio * r`` with ``r = m_hat / (sqrt(v_hat) + eps) + wd * w``
and ``ratio = ||w|| / ||r||`` (1 when a norm is 0, or when ``wd == 0`` and not ``always_adapt``). On a piece of the
parameter it would use the piece's norms. Here paddle's Lamb steps every piece as usual (moments, beta powers,
learning rate, groups and weight-decay exclusion exactly as paddle does), then each piece's update ``delta`` is
rescaled by ``whole ratio / piece ratio``, with ``r`` recomputed from the updated moments and both norms taken
over every distinct element of the parameter (parallel/clip.py: one small all_reduce each). Zero padding of a
ZeRO chunk adds nothing to either norm and does not move. Master weights (multi_precision) are not covered
(refused by the caller).
"""
from __future__ import annotations

import paddle

from autoparallel.dist_tensor import is_dist
from autoparallel.local_mode import local_mode


def sharded(p) -> bool:
    return is_dist(p) and any(pl.is_shard() or pl.is_block_shard() for pl in p.placements)


def _sharded_dims(p) -> set:
    return {p.mesh.dim_names[i] for i, pl in enumerate(p.placements) if pl.is_shard() or pl.is_block_shard()}


class WholeNormLamb:
    """Over a ShardedOptimizer's tensor-parallel parameters. Built before the step (keeps each held shard's old
    value); ``apply()`` after every rank's copy stepped."""

    def __init__(self, inner, params):
        self.inner = inner
        self.params = [p for p in params if sharded(p) and not p.stop_gradient]
        with local_mode(), paddle.no_grad():
            self.old = {(id(p), r): t.clone() for p in self.params for r, t in p.locals.items()
                        if t._is_initialized()}

    def apply(self, copies=None) -> None:
        """``copies``: the simulated world's other-rank optimizers (parallel/sim_step.py), None on a real rank."""
        for p in self.params:                       # the same order on every rank: the norms are collectives
            owners = _owners(p, self.inner, copies)
            if not all(_stepped(*o[:2]) for o in owners.values()):
                continue                            # no gradient yet (unused): paddle did not step it
            pieces = {r: (t, self.old[(id(p), r)]) + owners[r][:2] for r, t in p.locals.items()}
            first = {}
            for r, o in sorted(owners.items()):
                first.setdefault(o[2], r)           # copies sharing storage are corrected once
            rescale(pieces, p.mesh, _sharded_dims(p), decay(self.inner, p), adapts(self.inner, p),
                    {r for r, o in owners.items() if first[o[2]] != r})


class ZeroLamb:
    """Over a ZeroOptimizer's master chunks (each rank steps its chunk with its own Lamb)."""

    def __init__(self, zero):
        self.zero = zero
        with local_mode(), paddle.no_grad():
            self.old = {(id(p), r): m.clone() for r in zero.held for p in zero.params
                        for m in [zero.master[r].get(id(p))] if m is not None and not m.stop_gradient
                        and not p.stop_gradient}     # frozen since sharding: its chunk is not stepped

    def apply(self) -> None:
        z = self.zero
        for p in z.params:                          # the same order on every rank
            if not z.held or any((id(p), r) not in self.old for r in z.held):
                continue                            # frozen, or no chunk: the same on every rank
            pieces = {r: (z.master[r][id(p)], self.old[(id(p), r)], z.inner_opts[r], z.master[r][id(p)].name)
                      for r in z.held}
            if not all(_stepped(o, k) for _, _, o, k in pieces.values()):
                continue                            # no gradient yet (unused): paddle did not step it
            rescale(pieces, z.groups.zmesh, {z.groups.shard_dim} | _sharded_dims(p), decay(z._inner, p),
                    adapts(z._inner, p))


def _stepped(opt, key) -> bool:
    """Whether paddle's Lamb has stepped the piece ``key`` (it skips a parameter without a gradient, and then has
    no moments for it). Unused parameters have no gradient on any rank, so every rank skips the same ones."""
    return key in opt._accumulators.get("moment1", {})


def _owners(p, inner, copies) -> dict:
    """{rank: (paddle optimizer, accumulator key, storage id)} of each held copy of ``p``."""
    from autoparallel.parallel.sim_step import _buffer

    out = {r: (inner, p.name, _buffer(t)) for r, t in p.locals.items() if t is p}
    for r, (opt, links) in (copies.opts.items() if copies is not None else ()):
        for local, shadow in links:
            if local is p.locals.get(r):
                out[r] = (opt, shadow.name, _buffer(local))
    by_buf = {o[2]: o for _, o in sorted(out.items())}
    for r, t in p.locals.items():                   # copies stepped through another rank's storage
        out.setdefault(r, by_buf[_buffer(t)])
    return out


def rescale(pieces: dict, mesh, sharded_dims: set, wd: float, adapt: bool, skip=()) -> None:
    """``pieces``: {rank: (stepped tensor, its value before the step, its paddle Lamb, accumulator key)} of one
    parameter; ranks in ``skip`` count in the norms but are corrected through another rank's storage."""
    from autoparallel.parallel.clip import global_norm

    with local_mode(), paddle.no_grad():
        rs = {r: _direction(opt, key, old, wd) for r, (_, old, opt, key) in pieces.items()}
    whole = _ratio(global_norm([({r: v[1] for r, v in pieces.items()}, mesh, sharded_dims)]),
                   global_norm([(rs, mesh, sharded_dims)]), adapt)
    with local_mode(), paddle.no_grad():
        for r, (t, old, _, _) in sorted(pieces.items()):
            if r not in skip:
                local = _ratio(_norm(old), _norm(rs[r]), adapt)
                t.set_value(old - (old - t) * (whole / local))


def _direction(opt, key, old, wd):
    """paddle's ``r = m_hat / (sqrt(v_hat) + eps) + wd * w`` from the moments the step wrote (the beta powers have
    moved on by one step)."""
    acc, h = opt._accumulators, hyper(opt, lambda q: q.name == key)
    m, v = acc["moment1"][key], acc["moment2"][key]
    b1 = float(acc["beta1_pow_acc"][key].numpy().reshape(-1)[0]) / _num(h["beta1"])
    b2 = float(acc["beta2_pow_acc"][key].numpy().reshape(-1)[0]) / _num(h["beta2"])
    out = (m / (1 - b1)) / ((v / (1 - b2)).sqrt() + _num(h["epsilon"]))
    return out + old.astype(out.dtype) * wd if wd else out


def decay(inner, p) -> float:
    h = hyper(inner, lambda q: q is p)
    fun = h["exclude_from_weight_decay_fn"]
    return 0.0 if fun is not None and fun(p) else _num(h["lamb_weight_decay"])


def hyper(opt, match) -> dict:
    """The Lamb settings paddle steps the parameter ``match`` picks with: its parameter group's ``beta1``,
    ``beta2``, ``epsilon``, ``lamb_weight_decay``, ``exclude_from_weight_decay_fn``, else the constructor's
    (``opt._beta1`` ... hold whichever group paddle stepped last)."""
    out = dict(opt._default_dict)
    for g in getattr(opt, "_param_groups", None) or ():
        if isinstance(g, dict) and any(match(q) for q in g["params"]):
            out.update({k: g[k] for k in out if k in g})
            break
    return out


def _num(v) -> float:
    return float(v.numpy().reshape(-1)[0]) if hasattr(v, "numpy") else float(v)


def adapts(inner, p) -> bool:
    return bool(getattr(inner, "always_adapt", False)) or decay(inner, p) > 0


def _norm(t) -> float:
    from autoparallel.parallel.clip import square_sum

    return square_sum(t) ** 0.5 if int(t.numel()) else 0.0


def _ratio(w_norm: float, r_norm: float, adapt: bool) -> float:
    return w_norm / r_norm if adapt and w_norm > 0 and r_norm > 0 else 1.0
