"""ZeRO over the data-parallel axis: stage 1 shards optimizer states, stage 2 also gradients, stage 3 also
parameters; ``offload`` keeps master weights and optimizer states in host memory; ``degree < dp`` is
HSDP (shard over groups of ``degree`` data ranks, replicate across them).

    opt = apply_zero(model, optimizer, mesh, stage=2)        # model parallelized on ``mesh`` (DistParameters)
    loss.backward(); opt.step(); opt.clear_grad()

Each rank keeps, for every parameter, its ceil-division chunk of the flattened local data as an fp32 master weight and
steps those chunks with a paddle optimizer of the user's kind and hyperparameters. ``step()`` reduces gradients (stage
1: all_reduce, every rank keeps the full reduced gradient; stage 2/3: reduce_scatter, each rank keeps its chunk and the
full gradient is freed), clips by the global norm when the optimizer has ``ClipGradByGlobalNorm``, steps the chunks and
(stage 1/2) all_gathers them back into the parameters. At stage 3 parameters hold no data between uses: zero_params.py
gathers them around each layer's forward and backward.

From the second step on, backward hooks launch the reductions bucket by bucket in backward order on the final
accumulation micro-step (parallel/reducer.py), ``step()`` finishing the rest; ``overlap=False`` keeps them all at the
step, for what rescales ``p.grad`` before it (the AMP optimizer, a GradScaler: chunks no longer live in ``p.grad``).
"""
from __future__ import annotations

import math
import weakref

import paddle

from autoparallel import backward_start
from autoparallel.comm import collectives as C
from autoparallel.compat import EagerParamBase, expected_place
from autoparallel.comm.world import current_world
from autoparallel.dist_tensor import DistParameter
from autoparallel.dist_tensor_forms import ZERO_OWNERS
from autoparallel.local_mode import local_mode
from autoparallel.memory import live_bytes
from autoparallel.parallel import clip as clipping
from autoparallel.parallel.lamb_whole import ZeroLamb
from autoparallel.parallel.optim_clone import clone_optimizer, state_tensors, sync_lr, whole_tensor_kind
from autoparallel.parallel.param_list import flat_params
from autoparallel.parallel.precision_masters import round_unmastered
from autoparallel.parallel.step_hooks import StepHooks
from autoparallel.parallel.zero_groups import ZeroGroups, apply_groups
from autoparallel.parallel.zero_layout import BucketLayout, split_buckets
from autoparallel.param_carry import follow_optimizer_attrs

STAGES = (1, 2, 3)


def apply_zero(model, optimizer, mesh, stage: int, dp_dim: str = "data", degree: int | None = None,
               offload: bool = False, gradient_accumulation_steps: int = 1, bucket_bytes: int = 25 * 2**20,
               overlap: bool = True):
    """Shard ``optimizer``'s states (and gradients, parameters) of ``model`` over ``dp_dim``; returns the
    optimizer to use instead (step / clear_grad / state_dict / set_state_dict)."""
    if stage not in STAGES:
        raise ValueError(f"sharding stage must be one of {STAGES}, got {stage!r}")
    opt = ZeroOptimizer(model, optimizer, mesh, stage, dp_dim, degree, offload, gradient_accumulation_steps,
                        bucket_bytes, overlap)
    if stage == 3:
        from autoparallel.parallel.zero_params import install_stage3

        install_stage3(model, opt)
    return opt


class ZeroOptimizer(StepHooks):
    def __init__(self, model, optimizer, mesh, stage, dp_dim, degree, offload, accumulation, bucket_bytes,
                 overlap=True):
        inner = getattr(optimizer, "_inner", optimizer)
        if not hasattr(inner, "_parameter_list"):
            raise TypeError(f"apply_zero expects a paddle optimizer (or an ap optimizer wrapping one), "
                            f"got {type(optimizer).__name__}")
        if not isinstance(accumulation, int) or accumulation < 1:
            raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {accumulation!r}")
        self._inner, self.stage, self.offload, self.model = inner, stage, bool(offload), model
        if getattr(optimizer, "__dict__", {}).get("grad_sync") is not None:
            backward_start.forget(optimizer.grad_sync)      # ZeRO reduces these gradients itself
            optimizer.grad_sync.retired = True
        if overlap:
            backward_start.wait(self)
        self.gradient_accumulation_steps = self.accumulation_divisor = accumulation  # shard_optimizer: 1 (loop divides)
        self.groups = ZeroGroups(mesh, dp_dim, degree)
        on_mesh = lambda p: isinstance(p, DistParameter) and p.mesh == mesh      # noqa: E731
        for p in flat_params(inner):
            if not p.stop_gradient and not on_mesh(p):
                where = p.mesh if isinstance(p, DistParameter) else "no mesh (a plain paddle Parameter)"
                raise ValueError(f"apply_zero expects every trainable parameter on the mesh {mesh}; parameter "
                                 f"{p.name} is on {where}: parallelize the model before sharding")
        # frozen parameters on the mesh are managed too (unfreezing one later trains it, as paddle does); they
        # get a master chunk and a bucket slot when they first train (stage 3: the chunk is their storage)
        self.params = [p for p in flat_params(inner) if on_mesh(p)]
        self._outside = [p for p in flat_params(inner) if not on_mesh(p)]
        self._had_grad: set = set()                     # ids whose gradient paddle would keep (as zeros)
        self.bucket_bytes, self._bucketed = bucket_bytes, None
        self.buckets = self._plan_buckets()
        self.held = current_world().local_ranks(mesh.process_ids)
        self.host = paddle.CPUPlace()
        self.device = expected_place()
        self.master = {r: {} for r in self.held}         # rank -> id(param) -> fp32 chunk Parameter
        self._names = {r: {} for r in self.held}         # rank -> {chunk name: parameter name} (decay hooks)
        self._freed = set()                             # (id(param), rank) whose storage is released
        self.inner_opts = {r: self._make_inner(r) for r in self.held}
        for p in self.params:
            ZERO_OWNERS.set(p, weakref.ref(self))          # user writes reach the master chunks
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        self.overlap, self.reducer = overlap, None      # the Reducer launching buckets from backward hooks
        self._out = None                                # this window's gradient chunks

    # ---- set-up ----------------------------------------------------------------------------------------
    def _layout(self, ps, r) -> BucketLayout:
        return BucketLayout([math.prod(self._shape(p, r)) for p in ps], self.groups.degree)

    def _make_inner(self, r):
        keep = [p for p in self.params if self.stage == 3 or not p.stop_gradient]
        chunks = [self._new_master(p, r) for p in keep]
        return clone_optimizer(self._inner, [m for m in chunks if not m.stop_gradient], self._names[r], whole=True)

    def _new_master(self, p, r, data=None):
        """Rank r's fp32 master chunk of ``p`` (from ``data``, else its local shard). Stage 3: the chunk is also
        its storage; a frozen parameter's is kept in its own dtype, outside the chunk optimizer."""
        with local_mode(), paddle.no_grad():
            if data is None:
                low = self.stage == 3 and p.stop_gradient
                data = self._initial_chunk(p, r, p.dtype if low else None)
                data = data._copy_to(self.host, True) if self.offload else data
            else:
                data = data.astype(_master_dtype(p))
            m = EagerParamBase.from_tensor(data)
        m.name = f"{p.name}.zero_r{r}"
        m.stop_gradient = bool(p.stop_gradient)
        follow_optimizer_attrs(p, m)
        self._names[r][m.name] = p.name
        self.master[r][id(p)] = m
        return m

    def sync_trainable(self) -> None:
        """Parameters unfrozen since the last step get their master chunk now, from their current value (paddle
        creates a parameter's master and moments at its first gradient, too), and join their optimizer."""
        from autoparallel.parallel.zero_frozen import wake

        wake(self)

    def _plan_buckets(self) -> list:
        """Buckets of the trainable parameters (a frozen one costs no slot); remembers which were planned."""
        train = [p for p in self.params if not p.stop_gradient]
        self._bucketed = {id(p) for p in train}
        return split_buckets(train, self.bucket_bytes)

    def reload(self, params) -> None:
        """The user wrote new values into ``params``: their master chunks take them (from the local data)."""
        with local_mode(), paddle.no_grad():
            for p in params:
                for r in self.held:
                    m = self.master[r].get(id(p))
                    if m is not None:
                        c = ZeroOptimizer._initial_chunk(self, p, r, m.dtype)   # the data written, never a
                        # lazy parameter's initialiser chunk (lazy_init/zero.py overrides _initial_chunk)
                        m.set_value(c._copy_to(self.host, True) if self.offload else c)

    def _initial_chunk(self, p, r, dtype=None):
        """Rank r's chunk of ``p``'s local shard (fp32 unless ``dtype``): the master weight's first value."""
        flat = p.locals[r].reshape([-1]).astype(dtype or _master_dtype(p.locals[r]))
        return self._layout([p], r).chunk(flat, 0, self.groups.index(r)).clone()

    # ---- parameters -------------------------------------------------------------------------------------
    def gather(self, params) -> None:
        """All-gather the master chunks of ``params`` into their local data (skips ones already whole)."""
        todo = [p for p in params if id(p) in self.master[self.held[0]]] if self.held else []
        if self.stage == 3:
            todo = [p for p in todo if any((id(p), r) in self._freed for r in self.held)]
        if not todo:
            return
        with local_mode(), paddle.no_grad():
            layout = {r: self._layout(todo, r) for r in self.held}
            xs = {}
            for r in self.held:
                chunks = [self._to_device(self.master[r][id(p)], p.locals[r]) for p in todo]
                xs[r] = layout[r].pack_member(chunks, self.groups.index(r))
            out = apply_groups(xs, self.groups.shard_groups, lambda v, ranks: _gather(v, ranks, layout))
            for r in self.held:
                for p, flat in zip(todo, layout[r].unpack_full(out[r])):
                    _materialize(p.locals[r], flat, self._shape(p, r))
                    self._freed.discard((id(p), r))

    def _shape(self, p, r):
        return list(p.spec.local_shape(p.mesh.coords_of(r)))

    def free(self, params) -> None:
        """Release the local data of ``params`` (stage 3: the chunk lives on as the master weight)."""
        if self.stage != 3:
            return
        for p in params:
            for r in self.held:
                if (id(p), r) not in self._freed:
                    p.locals[r]._clear_data()
                    self._freed.add((id(p), r))

    def is_freed(self, p) -> bool:
        return all((id(p), r) in self._freed for r in self.held)

    def _to_device(self, m, like):
        t = m.astype(like.dtype) if m.dtype != like.dtype else m
        return t._copy_to(self.device, True) if self.offload else t

    # ---- gradients --------------------------------------------------------------------------------------
    def _grad_flats(self, p) -> dict:
        """{held rank: p's flat fp32 gradient}, reduced over partial dims other than the data dim (all held
        ranks at once: the simulated world reduces across them), scaled for the data-parallel mean."""
        gs = {r: p.locals[r].grad for r in self.held}
        if any(g is None for g in gs.values()):
            return {r: None for r in self.held}
        gs = {r: g.reshape([-1]).astype(_master_dtype(g)) for r, g in gs.items()}
        dims = set(getattr(p, "_ap_partial_dims", ()) or ())
        for d in sorted(dims - {self.groups.dp_index}):            # e.g. sequence-parallel norms
            gs = C.mesh_groups_apply(gs, p.mesh, d, lambda v, ranks: C._reduce_raw(v, ranks, "sum"))
        if self.groups.dp_index not in dims:                    # already the full gradient on every data rank
            gs = {r: g * (1.0 / self.groups.dp) for r, g in gs.items()}
        if self.accumulation_divisor > 1:
            gs = {r: g * (1.0 / self.accumulation_divisor) for r, g in gs.items()}
        return gs

    def reduce_gradients(self) -> dict:
        """{rank: {id(param): fp32 gradient chunk}} summed over the data axis. The first call reduces every
        bucket here and (``overlap``) installs a Reducer over the buckets in backward order; later calls
        finish what the hooks did not launch."""
        if self.reducer is not None:
            self.reducer.flush()
            out = self._window()
            late = [p for p in self.params if not p.stop_gradient and id(p) not in self._bucketed]
            for bucket in split_buckets(late, self.bucket_bytes):       # unfrozen since the buckets were planned
                self._reduce_bucket(bucket, out)
            if {id(p) for p in self.params if not p.stop_gradient} != self._bucketed:
                self.buckets = self._plan_buckets()
                self.reducer.detach()
                self._install_reducer().mark_reduced()
        else:
            self.buckets = self._plan_buckets()
            out = self._window()
            for bucket in self.buckets:
                self._reduce_bucket(bucket, out)
            if self.overlap:
                self._install_reducer().mark_reduced()
        return out                          # the window stays until the step (or clear_grad) consumes it

    def _install_reducer(self):
        from autoparallel.parallel.reducer import Reducer

        self.reducer = Reducer(list(reversed(self.buckets)), self._launch, self._to_partial,
                               self.gradient_accumulation_steps)
        return self.reducer

    def before_backward(self, tensors) -> bool:
        """Hooks reduce from the first unscaled backward on (autoparallel/backward_start.py); a GradScaler's loss
        stops them between steps (a warm-up without it installed them), keeping p.grad for the scaler to unscale."""
        scaled = backward_start.scaled(tensors)
        if scaled and self.reducer is not None and self._out is None:
            self.reducer.detach()
            self.reducer, self.overlap = None, False
        elif self.reducer is None and self.overlap and not scaled:
            self._install_reducer()
        return not self.overlap

    def _window(self) -> dict:
        if self._out is None:
            self._out = {r: {} for r in self.held}
        return self._out

    def _launch(self, _i, bucket):
        self._reduce_bucket(bucket, self._window())

    def _to_partial(self, p) -> None:
        """A gradient arrives after ``p`` was reduced. Stage 1: the reduced full gradient goes back to partial
        sums (kept, unscaled, at coordinate 0 of the dims it was summed over) and its chunk is recomputed
        by the next reduction; stage 2/3: its chunk stays and the next reduction adds to it."""
        if self.stage != 1:
            return
        dims = set(getattr(p, "_ap_partial_dims", ()) or ())
        scale = self.accumulation_divisor * (1 if self.groups.dp_index in dims else self.groups.dp)
        summed = dims | {self.groups.dp_index}
        for r in self.held:
            if self._out is not None:
                self._out[r].pop(id(p), None)
            t = p.locals[r]
            if t.grad is not None:
                keep = not any(p.mesh.coords_of(r)[d] for d in summed)
                t.grad.set_value(t.grad * float(scale) if keep else paddle.zeros_like(t.grad))

    def _reduce_bucket(self, bucket, out) -> None:
        with local_mode(), paddle.no_grad():
            done = out.get(self.held[0], {}) if self.held and self.stage == 1 and self.reducer is None else {}
            # stage 1 without hooks: a gradient reduced in this window already is the full one (not again)
            ps = [p for p in bucket if self.held and p.locals[self.held[0]].grad is not None and id(p) not in done
                  and not p.stop_gradient]
            if not ps:
                return
            layout = {r: self._layout(ps, r) for r in self.held}
            per_param = [self._grad_flats(p) for p in ps]
            flats = {r: [g[r] for g in per_param] for r in self.held}
            xs = {r: layout[r].pack_full(flats[r]) for r in self.held}
            if self.stage == 1:
                xs = apply_groups(xs, self.groups.shard_groups, lambda v, ranks: C._reduce_raw(v, ranks, "sum"))
            else:
                xs = apply_groups(xs, self.groups.shard_groups, lambda v, ranks: C._reduce_scatter_raw(
                    v, ranks, 0, [_width(layout, v)] * len(ranks), "sum"))
            xs = apply_groups(xs, self.groups.replica_groups, lambda v, ranks: C._reduce_raw(v, ranks, "sum"))
            for r in self.held:
                k = self.groups.index(r)
                if self.stage == 1:
                    full = layout[r].unpack_full(xs[r])
                    for p, f in zip(ps, full):
                        t = p.locals[r]
                        t.grad.set_value(f.reshape(t.grad.shape).astype(t.grad.dtype))
                    chunks = [layout[r].chunk(f, j, k) for j, f in enumerate(full)]
                else:
                    chunks = layout[r].unpack_member(xs[r], k)
                    for p in ps:
                        p.locals[r].clear_gradient(False)
                for p, c in zip(ps, chunks):
                    old = out[r].get(id(p))
                    out[r][id(p)] = c if old is None else old + c

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> None:
        self._check_unfrozen()
        self.sync_trainable()
        grads = self.reduce_gradients()
        self._out = None
        self._zero_kept_grads(grads)
        self._clip(grads)
        whole = ZeroLamb(self) if whole_tensor_kind(self._inner) else None     # Lamb: the whole parameter's ratio
        with local_mode():
            for r in self.held:
                for p in self.params:
                    m = self.master[r].get(id(p))
                    g = grads[r].get(id(p))
                    if m is None:                       # frozen since the start: no master chunk
                        continue
                    follow_optimizer_attrs(p, m)        # a regularizer / lr scale set after sharding
                    if g is None or p.stop_gradient:    # paddle steps no frozen parameter
                        m.clear_gradient(False)
                        continue
                    m._copy_gradient_from(g._copy_to(self.host, True) if self.offload else g)
                sync_lr(self._inner, self.inner_opts[r])
                self.inner_opts[r].step()
        if whole is not None:
            whole.apply()
        with local_mode():
            for r in self.held:         # multi_precision=False: the master rounded to the parameter's dtype
                round_unmastered(self.master[r], self.params, self._inner)
        if self.stage < 3:              # a frozen parameter's chunk did not move: its local data is current
            for bucket in self.buckets:
                self.gather([p for p in bucket if not p.stop_gradient])
        else:
            self.free(self.params)
            self.__dict__.get("stage3_uses", {}).clear()
        self._after_step()

    def _check_unfrozen(self) -> None:
        woken = [p.name for p in self._outside if not p.stop_gradient]
        if woken:
            raise NotImplementedError(f"ZeRO sharding: {', '.join(woken[:3])} was frozen and off the mesh {self.groups.mesh} "
                                      f"when the optimizer was sharded and is trainable now; distribute it on that "
                                      f"mesh (ap.shard_layer / ap.parallelize) before sharding the optimizer")

    def _zero_kept_grads(self, grads) -> None:
        """paddle's ``clear_grad()`` keeps a zero gradient on a parameter that had one, and the optimizer steps
        it (moments decay, momentum moves it) in a step where it gets no new gradient (an unused branch);
        stage 2/3 drop the full gradients, so the zero chunk is given here. ``clear_grad(set_to_zero=False)``
        drops them in paddle too."""
        for p in self.params:
            for r in self.held:
                g = grads[r].get(id(p))
                if g is not None:
                    self._had_grad.add(id(p))
                elif id(p) in self._had_grad and not p.stop_gradient:
                    m = self.master[r][id(p)]
                    grads[r][id(p)] = paddle.zeros(m.shape, dtype=m.dtype)

    def _clip(self, grads) -> None:
        """paddle's clips on the reduced gradient chunks: norms over whole gradients (each chunk and tensor-
        parallel shard counted once), ``ClipGradByValue`` elementwise (a chunk clips as the whole would); each
        parameter group by its own ``grad_clip`` as paddle clips groups (parallel/group_clips.py)."""
        from autoparallel.parallel.group_clips import clip_sets

        for gc, ps in clip_sets(self._inner):
            if gc is not None:
                self._clip_set(gc, grads, {id(p) for p in ps})

    def _clip_set(self, gc, grads, ids) -> None:
        terms = self._clip_terms(grads, ids)
        if isinstance(gc, paddle.nn.ClipGradByGlobalNorm):
            norm = self.last_grad_norm = clipping.global_norm(terms)
            clipping.scale_([t for locs, _, _ in terms for t in locs.values()],
                            clipping.clip_coefficient(norm, float(gc.clip_norm)))
        elif isinstance(gc, paddle.nn.ClipGradByNorm):
            for term in terms:
                clipping.scale_(list(term[0].values()),
                                clipping.clip_coefficient(clipping.global_norm([term]), float(gc.clip_norm)))
        elif isinstance(gc, paddle.nn.ClipGradByValue):
            with local_mode(), paddle.no_grad():
                for t in [t for locs, _, _ in terms for t in locs.values() if t is not None]:
                    t.set_value(t.clip(min=float(gc.min), max=float(gc.max)))
        else:
            raise NotImplementedError(f"ZeRO sharding supports grad_clip=ClipGradByGlobalNorm, ClipGradByNorm or "
                                      f"ClipGradByValue, got {type(gc).__name__}")

    def _clip_terms(self, grads, ids) -> list:
        z, terms = self.groups.zmesh, []
        for p in self.params:
            if not getattr(p, "need_clip", True) or p.stop_gradient or id(p) not in ids:
                continue
            sharded = {self.groups.shard_dim} | {p.mesh.dim_names[i] for i, pl in enumerate(p.placements)
                                                 if pl.is_shard() or pl.is_block_shard()}
            terms.append(({r: grads[r].get(id(p)) for r in self.held}, z, sharded))
        return terms

    def clear_grad(self, set_to_zero: bool = True) -> None:
        if self.reducer is not None:
            self.reducer.reset()
        self._out = None
        if not set_to_zero:
            self._had_grad.clear()
        with local_mode():
            for p in self.params:
                for t in p.locals.values():
                    t.clear_gradient(set_to_zero and self.stage == 1)
            for r in self.held:
                for m in self.master[r].values():
                    m.clear_gradient(False)

    clear_gradients = clear_grad

    # ---- accounting ---------------------------------------------------------------------------------------
    def memory_bytes(self, rank: int | None = None) -> dict:
        """Bytes this rank holds in parameters, gradients and optimizer states, from live local tensors."""
        r = self.held[0] if rank is None else rank
        params = [p.locals[r] for p in self.params]
        masters = list(self.master[r].values())
        grads = [t.grad for t in params] + [m.grad for m in masters]
        states = state_tensors(self.inner_opts[r])
        if self.stage == 3:
            params = params + masters                   # the chunk is the parameter's storage
        else:
            states = states + masters                   # a separate fp32 copy of the chunk
        return {"params": live_bytes(params), "grads": live_bytes(grads), "optimizer_states": live_bytes(states)}

    def state_places(self) -> list:
        return [t.place for r in self.held for t in state_tensors(self.inner_opts[r]) + list(self.master[r].values())]

    # ---- checkpoints --------------------------------------------------------------------------------------
    def checkpoint_state(self, model=None) -> dict:
        """The model's parameters and this optimizer's states as global tensors named like the unsharded
        run's (``ap.training_state``); save and load it with ``ap.save_state_dict`` / ``ap.load_state_dict``
        (checkpoint/zero_state.py)."""
        from autoparallel.checkpoint.zero_state import zero_training_state

        if model is not None and self.model is not None and model is not self.model:
            raise ValueError(f"this ZeRO optimizer shards the parameters of the {type(self.model).__name__} it "
                             f"was built with, not of the given {type(model).__name__}")
        return zero_training_state(self, model)

    def state_dict(self) -> dict:
        """paddle's form: one process's keys, each state a distributed tensor of the whole parameter's shape
        (parallel/zero_state_dict.py). Collective where a chunk does not fall on whole rows."""
        from autoparallel.parallel.zero_state_dict import state_dict

        return state_dict(self)

    def set_state_dict(self, state_dict) -> None:
        from autoparallel.parallel.zero_state_dict import set_state_dict

        set_state_dict(self, state_dict)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _gather(v, ranks, layout) -> dict:
    """All-gather the packed chunks ``v`` over ``ranks``; a group of one (a one-process world, ZeRO degree
    1) is its own result and needs no collective (nor an initialized process group)."""
    if len(ranks) == 1:
        return dict(v)
    return C._gather_raw(v, ranks, 0, [_width(layout, v)] * len(ranks))


def _master_dtype(t) -> str:
    """float32 master weights and gradient chunks, float64 for a float64 parameter (no precision lost)."""
    return "float64" if t.dtype == paddle.float64 else "float32"


def _width(layout, v) -> int:
    return layout[next(iter(v))].width


def _materialize(t, flat, shape) -> None:
    """Write ``flat`` into ``t``'s storage (re-allocating it when released) without replacing the tensor
    object, so that autograd's saved references to ``t`` see the data."""
    value = flat.reshape(shape).astype(t.dtype)
    if t._is_initialized():
        t.set_value(value)
    else:
        t.get_tensor()._share_data_with(value.get_tensor())
