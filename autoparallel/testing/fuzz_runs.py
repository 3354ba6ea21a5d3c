"""Differential runs of the fuzz generators: one process vs autoparallel in the simulated world, same seed,
same data; the outcome of one (model seed, strategy seed) pair."""
from __future__ import annotations

import dataclasses

import numpy as np
import paddle
import paddle.nn.functional as F

from autoparallel.testing.fuzz_models import (build_model, draw_batch, draw_model, draw_strategy, linear_names,
                                              make_optimizer)

# float32: a reordered sum of n terms differs by ~n * 6e-8 relative; gradients here sum <= 64 rows x 48
# features (~4e-6), and 2-3 AdamW steps at lr 1e-2 with epsilon 1e-4 move a parameter by <= 3e-2, so an
# agreeing run is within 1e-5 absolute; 2e-4 / 1e-4 leave a margin of 10x while a wrong reduction (x2, /world)
# or a lost step (>= 1e-3) still fails.
RTOL, ATOL = 2e-4, 1e-4
STEPS = 2


@dataclasses.dataclass
class Outcome:
    model_seed: int
    strategy_seed: int
    model: object
    strategy: object
    status: str = "ok"           # ok | wrong | crash | refused (a typed error naming what is unsupported)
    detail: str = ""


def _micro(spec, step, accumulate):
    x, y = draw_batch(spec, step)
    n = len(x) // accumulate
    return [(x[i * n:(i + 1) * n], y[i * n:(i + 1) * n]) for i in range(accumulate)]


def _loss(model, x, y):
    return F.cross_entropy(model(x), y).mean()


def reference(spec, sspec):
    """One process, the user's hand accumulation loop (loss / accumulate); losses and state {name: ndarray}."""
    model = build_model(spec)
    opt = make_optimizer(sspec, model.parameters())
    losses = []
    for step in range(STEPS):
        total = 0.0
        for x, y in _micro(spec, step, sspec.accumulate):
            loss = _loss(model, paddle.to_tensor(x), paddle.to_tensor(y)) / sspec.accumulate
            loss.backward()
            total += float(loss)
        opt.step()
        opt.clear_grad()
        losses.append(total)
    return losses, {k: v.numpy() for k, v in model.state_dict().items()}


def _strategy(sspec):
    import autoparallel as ap

    s = ap.Strategy()
    w, kind = sspec.world, sspec.kind
    if kind == "full":
        s.auto_mode = "full"
        s.global_batch_size = 8                  # the planner needs the samples per optimizer step
    elif kind == "tp":
        s.data_parallel.degree, s.tensor_parallel.degree = 1, w
    elif kind == "dp_tp":
        s.data_parallel.degree, s.tensor_parallel.degree = w // 2, 2
    else:
        s.data_parallel.degree = w
    for part in (kind,) + sspec.extra:
        if part.startswith("zero"):
            s.sharding.enable, s.sharding.stage = True, int(part[-1])
    if "recompute" in (kind,) + sspec.extra:
        s.recompute.enable = True
    s.gradient_accumulation_steps = sspec.accumulate
    return s


def _placement(text):
    import autoparallel as ap

    return {"S(0)": ap.Shard(0), "S(1)": ap.Shard(1), "R": ap.Replicate()}[text]


def _shard_layer(model, opt, sspec):
    import autoparallel as ap

    mesh = ap.ProcessMesh(list(range(sspec.world)), dim_names=["x"])
    plan = dict(sspec.shard_fn)

    def shard_fn(name, sub, m):
        if name in plan:
            sub.weight = ap.shard_tensor(sub.weight, m, [_placement(plan[name])])

    model = ap.shard_layer(model, mesh, shard_fn)
    return model, ap.shard_optimizer(opt), mesh


def distributed(spec, sspec):
    """The same program under ``ap.simulate(world_size=sspec.world)``; losses and full state."""
    import autoparallel as ap

    with ap.simulate(world_size=sspec.world):
        model = build_model(spec)
        opt = make_optimizer(sspec, model.parameters())
        mesh = None
        if sspec.kind == "shard_layer":
            model, opt, mesh = _shard_layer(model, opt, sspec)
        else:
            extra = {"seq_len": 8} if sspec.kind == "full" else {}
            model, opt = ap.parallelize(model, opt, strategy=_strategy(sspec), **extra)
        losses = []
        for step in range(STEPS):
            total = 0.0
            for x, y in _micro(spec, step, sspec.accumulate):
                x, y = paddle.to_tensor(x), paddle.to_tensor(y)
                if mesh is not None:       # the hand loop: data split over the mesh, loss / accumulate
                    x, y = (ap.shard_tensor(a, mesh, [_placement(sspec.data)]) for a in (x, y))
                    loss = _loss(model, x, y) / sspec.accumulate
                    total += float(loss)
                else:                      # the strategy's accumulation divides the gradients
                    loss = _loss(model, x, y)
                    total += float(loss) / sspec.accumulate
                loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(total)
        state = {k: np.asarray(v.numpy()) for k, v in ap.full_state_dict(model).items()}
    return losses, state


def compare(ref, got) -> str:
    """'' when losses and every state entry agree, else what differs first."""
    if not np.allclose(got[0], ref[0], rtol=RTOL, atol=ATOL):
        return f"losses {got[0]} vs one process {ref[0]}"
    if sorted(got[1]) != sorted(ref[1]):
        return f"state keys differ: {sorted(set(got[1]) ^ set(ref[1]))}"
    for k, want in ref[1].items():
        have = got[1][k]
        if have.shape != want.shape or not np.allclose(have, want, rtol=RTOL, atol=ATOL):
            err = np.abs(have - want).max() if have.shape == want.shape else f"shape {have.shape}"
            return f"{k}: max |diff| {err}"
    return ""


REFUSALS = (NotImplementedError, ValueError, TypeError)
_PADDLE_ARGUMENT = "(InvalidArgument)"           # paddle's own parser: a crash, not a refusal by name


def run_pair(model_seed: int, strategy_seed: int) -> Outcome:
    spec = draw_model(model_seed)
    sspec = draw_strategy(strategy_seed, linear_names(build_model(spec)))
    out = Outcome(model_seed, strategy_seed, spec, sspec)
    ref = reference(spec, sspec)
    try:
        got = distributed(spec, sspec)
    except REFUSALS as e:
        if _PADDLE_ARGUMENT in str(e):
            out.status, out.detail = "crash", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            return out
        out.status, out.detail = "refused", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return out
    except Exception as e:  # noqa: BLE001 - a fuzzer records every crash
        out.status, out.detail = "crash", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        return out
    diff = compare(ref, got)
    if diff:
        out.status, out.detail = "wrong", diff
    return out
