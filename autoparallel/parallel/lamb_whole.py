"""Lamb over sharded (tensor-parallel) parameters: the trust ratio of the whole parameter.

paddle's fused Lamb updates a parameter by ``w -= lr * ratio * r`` with ``r = m_hat / (sqrt(v_hat) + eps) + wd * w``
and ``ratio = ||w|| / ||r||`` (1 when a norm is 0, or when ``wd == 0`` and not ``always_adapt``). On a shard it
would use the shard's norms. Here paddle's Lamb steps every shard as usual (moments, beta powers, learning rate,
groups and weight-decay exclusion exactly as paddle does), then each shard's update ``delta`` is rescaled by
``whole ratio / shard ratio``, with ``r`` recomputed from the updated moments and both norms taken over every
distinct element of the parameter (parallel/clip.py: one small all_reduce each). Master weights (multi_precision)
are not covered (refused by the caller).
"""
from __future__ import annotations

import paddle

from autoparallel.dist_tensor import is_dist
from autoparallel.local_mode import local_mode


def sharded(p) -> bool:
    return is_dist(p) and any(pl.is_shard() or pl.is_block_shard() for pl in p.placements)


class WholeNormLamb:
    """Built before the step (keeps each held shard's old value), ``apply()`` after every rank's copy stepped."""

    def __init__(self, inner, params):
        self.inner, self.copies = inner, None
        self.params = [p for p in params if sharded(p) and not p.stop_gradient]
        with local_mode(), paddle.no_grad():
            self.old = {(id(p), r): t.clone() for p in self.params for r, t in p.locals.items()
                        if t._is_initialized()}

    def apply(self, copies=None) -> None:
        """``copies``: the simulated world's other-rank optimizers (parallel/sim_step.py), None on a real rank."""
        from autoparallel.parallel.clip import global_norm

        self.copies = copies
        for p in self.params:                       # the same order on every rank: the norms are collectives
            owners = self._owners(p)
            sharded_dims = {p.mesh.dim_names[i] for i, pl in enumerate(p.placements) if pl.is_shard() or pl.is_block_shard()}
            old = {r: self.old[(id(p), r)] for r in p.locals}
            with local_mode(), paddle.no_grad():
                rs = {r: self._direction(p, r, old[r], *owners[r]) for r in p.locals}
            w_norm = global_norm([(old, p.mesh, sharded_dims)])
            r_norm = global_norm([(rs, p.mesh, sharded_dims)])
            adapt = self._adapts(p)
            whole = _ratio(w_norm, r_norm, adapt)
            done = set()
            with local_mode(), paddle.no_grad():
                for r, t in sorted(p.locals.items()):
                    buf = owners[r][2]
                    if buf in done:                     # a copy sharing storage with one corrected already
                        continue
                    done.add(buf)
                    local = _ratio(_norm(old[r]), _norm(rs[r]), adapt)
                    t.set_value(old[r] - (old[r] - t) * (whole / local))

    def _owners(self, p) -> dict:
        """{rank: (paddle optimizer, accumulator key, storage id)} of each held copy of ``p``."""
        from autoparallel.parallel.sim_step import _buffer

        out, by_buf = {}, {}
        for r, t in sorted(p.locals.items()):
            if t is p:
                out[r] = (self.inner, p.name, _buffer(t))
        opts = self.copies.opts if self.copies is not None else {}
        for r, (opt, links) in opts.items():
            for local, shadow in links:
                if local is p.locals.get(r):
                    out[r] = (opt, shadow.name, _buffer(local))
        for r, o in out.items():
            by_buf.setdefault(o[2], o)
        for r, t in p.locals.items():                  # copies stepped through another rank's storage
            if r not in out:
                out[r] = by_buf[_buffer(t)]
        return out

    def _direction(self, p, r, old, opt, key, _buf):
        """paddle's ``r = m_hat / (sqrt(v_hat) + eps) + wd * w`` from the moments the step wrote (the beta
        powers have moved on by one step)."""
        acc = opt._accumulators
        m, v = acc["moment1"][key], acc["moment2"][key]
        b1 = float(acc["beta1_pow_acc"][key].numpy().reshape(-1)[0]) / opt._beta1
        b2 = float(acc["beta2_pow_acc"][key].numpy().reshape(-1)[0]) / opt._beta2
        out = (m / (1 - b1)) / ((v / (1 - b2)).sqrt() + opt._epsilon)
        wd = self._decay(p)
        return out + old.astype(out.dtype) * wd if wd else out

    def _decay(self, p) -> float:
        fun = self.inner._exclude_from_weight_decay_fn
        return 0.0 if fun is not None and fun(p) else float(self.inner._lamb_weight_decay)

    def _adapts(self, p) -> bool:
        return bool(getattr(self.inner, "always_adapt", False)) or self._decay(p) > 0


def _norm(t) -> float:
    from autoparallel.parallel.clip import square_sum

    return square_sum(t) ** 0.5 if int(t.numel()) else 0.0


def _ratio(w_norm: float, r_norm: float, adapt: bool) -> float:
    return w_norm / r_norm if adapt and w_norm > 0 and r_norm > 0 else 1.0
