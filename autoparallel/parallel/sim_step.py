"""The optimizer step of the simulated world: every rank's copy of a parameter is updated.

In ``ap.simulate`` a DistParameter is the lowest held rank's shard and its other ranks' shards live in
``p.locals``. The user's paddle optimizer only knows the parameter objects, so it updates the lowest rank's
copy; ``RankCopies`` steps each other rank's copies with an optimizer of the same kind and
hyperparameters (``clone_optimizer``) over parameters sharing their storage, so every rank keeps its own
moments exactly as the real N-rank run does, and a simulated run of N steps equals the real one.
A real rank holds one shard per parameter: nothing to do there. Only paddle's own optimizers are
mirrored (a duck-typed optimizer steps the copies it knows about itself).
"""
from __future__ import annotations

from autoparallel.dist_tensor import is_dist
from autoparallel.local_mode import local_mode
from autoparallel.parallel.optim_clone import copy_group_clips, sync_lr
from autoparallel.param_carry import follow_optimizer_attrs


def other_rank_copies(params) -> dict:
    """{rank: [(parameter, that rank's local tensor)]} for the copies the paddle optimizer does not see
    (a copy sharing its storage with one already updated is updated once; empty shards need nothing)."""
    out: dict = {}
    for p in params:
        if not is_dist(p):
            continue
        seen = {_buffer(p)}
        for r, t in sorted(p.locals.items()):
            if t is p or not int(t.numel()) or _buffer(t) in seen:
                continue
            seen.add(_buffer(t))
            out.setdefault(r, []).append((p, t))
    return out


def _buffer(t):
    return (t.data_ptr(), tuple(t.shape)) if t._is_initialized() else (id(t),)


class RankCopies:
    """Per-rank optimizers over the other ranks' copies; ``step()`` after the paddle optimizer's step."""

    def __init__(self, inner, params):
        self.inner = inner
        self.params = [p for p in params if is_dist(p)]
        self.owner = {}                                 # shadow name -> its distributed parameter
        self.opts = {}                                  # rank -> (paddle optimizer, [(local, shadow)])
        for r, pairs in sorted(other_rank_copies(params).items()):
            self.opts[r] = self._make(r, pairs)

    def load_state(self, state_dict: dict, rank_states: dict | None = None) -> None:
        """``set_state_dict`` of the user's optimizer (the lowest rank's copies) for every other rank's copies: a
        replicated parameter's states are every rank's; a copy holding another shard than the lowest rank's has
        states this dict does not hold, so that load is refused. ``rank_states``: {rank: that rank's own state
        dict} (optimizer_state_forms.py lays a whole or distributed state out on every rank)."""
        for r, (opt, links) in self.opts.items():
            if rank_states is not None:
                state_dict = rank_states[r]
            sub = {k: v for k, v in state_dict.items() if not any(k.startswith(p.name + "_") for p in self.params)}
            for t, s in links:
                p = self.owner[s.name]
                if rank_states is None and not _same_shard(p, r):
                    raise NotImplementedError(
                        f"optimizer.set_state_dict in the simulated world: {p.name} is split "
                        f"({', '.join(map(str, p.placements))}) and the state dict holds the lowest rank's shard's "
                        f"states only; restore a run with ap.training_state / ap.save_state_dict and "
                        f"ap.load_state_dict (or on real ranks, where each rank loads its own)")
                sub.update({s.name + k[len(p.name):]: v for k, v in state_dict.items() if k.startswith(p.name + "_")})
            with local_mode():
                opt.set_state_dict(sub)

    def _make(self, r, pairs):
        from autoparallel.compat import EagerParamBase
        from autoparallel.parallel.optim_clone import clone_optimizer

        shadows, names, links = [], {}, []
        for p, t in pairs:
            s = EagerParamBase.from_tensor(t)             # shares t's storage: the update lands in t
            s.name = f"{p.name}.sim_r{r}"
            s.stop_gradient = p.stop_gradient
            follow_optimizer_attrs(p, s)
            names[s.name] = p.name
            self.owner[s.name] = p
            shadows.append(s)
            links.append((t, s))
        return clone_optimizer(self.inner, shadows, names, whole=True), links

    def step(self) -> None:
        with local_mode():
            for opt, links in self.opts.values():
                opt._grad_clip = getattr(self.inner, "_grad_clip", None)   # as each real rank clips its copy
                copy_group_clips(self.inner, opt)       # (norm clips the ap optimizer applied are off now)
                sync_lr(self.inner, opt)
                for t, s in links:
                    s.stop_gradient = t.stop_gradient      # frozen (or unfrozen) since the last step
                    follow_optimizer_attrs(self.owner[s.name], s)     # its regularizer, lr scale as now
                    if t.grad is None:
                        s.clear_gradient(False)
                    else:
                        s._copy_gradient_from(t.grad)
                opt.step()

    def state_tensors(self, rank: int) -> list:
        from autoparallel.parallel.optim_clone import state_tensors

        return state_tensors(self.opts[rank][0])


def _same_shard(p, r) -> bool:
    """Whether rank ``r`` holds the same part of ``p`` as the lowest rank holding it."""
    low = min(p.locals)
    a, b = p.mesh.coords_of(r), p.mesh.coords_of(low)
    return all(a[i] == b[i] or not (pl.is_shard() or pl.is_block_shard()) for i, pl in enumerate(p.placements))
