"""Every Strategy field on every entry point is effective or rejected (autoparallel/entry_points.py).

The fields are enumerated from the Strategy dataclasses, so a new field fails here until it has a probe.
A probe runs an entry point (simulated world, a 4-layer GPT, one to three training steps: one where the
observable is settled by the first step, two or three where it is read from later steps) with a base
strategy and with the field changed, and reads an observable effect from the run: parameter shards, the
pipeline's executed actions, optimizer-state bytes, saved activation bytes, losses, the loss scale, files on
disk, an error raised by the checked batch size. "Effective" means the observable differs; "rejected"
means the entry point raises naming the field. ``ap.DataParallel`` + ``ap.Optimizer`` runs the same probes
as ``ap.parallelize``: one machinery, two spellings.
"""
from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from autoparallel import layer_state
import autoparallel as ap
from autoparallel import entry_points as ep
from autoparallel.parallel.recompute import SavedBytes

B, T, VOCAB = 4, 8, 64


def model():
    from examples.models import GPT, GPTConfig

    paddle.seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, hidden=32, layers=4, heads=4, max_positions=16))


def data(i):
    rng = np.random.default_rng(i)
    return paddle.to_tensor(rng.integers(0, VOCAB, (B, T))), paddle.to_tensor(rng.integers(0, VOCAB, (B, T)))


def make_strategy(values: dict):
    s = ap.Strategy()
    for name, v in values.items():
        *path, leaf = name.split(".")
        obj = s
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, leaf, v)
    return s


@dataclass
class Run:
    model: Any = None
    opt: Any = None
    losses: list = field(default_factory=list)
    scaled: list = field(default_factory=list)      # the loss as scaled for backward
    saved_bytes: int = 0                            # activations kept for backward in the first step
    out: str = ""
    draw: Any = None                                # paddle.rand right after the entry point
    error: str = ""
    notes: list = field(default_factory=list)       # what a probe's setup recorded
    entry: str = ""
    forwards: int = 0                               # calls of the model's forward (micro-batches)


def _loss(m, x, y):
    return F.cross_entropy(m(x), y).mean()


def _build(entry, s, m):
    opt = paddle.optimizer.AdamW(1e-2, parameters=m.parameters())
    if entry == ep.PARALLELIZE:
        return ap.parallelize(m, opt, strategy=s, seq_len=T if s.auto_mode == "full" else None)
    if entry == ep.DATA_PARALLEL:
        dm = ap.DataParallel(m, strategy=s)
        return dm, ap.Optimizer(opt)
    from paddle.static import InputSpec

    spec = [InputSpec([B, T], "int64"), InputSpec([B, T], "int64")]
    return ap.to_static(m, None, lambda out, y: F.cross_entropy(out, y).mean(), opt, strategy=s,
                        input_spec=spec), None


def run(entry, values: dict, world: int, steps: int = 2, setup=None) -> Run:
    r = Run(entry=entry)
    s = make_strategy(values)
    buf = io.StringIO()
    try:
        with ap.simulate(world_size=world), contextlib.redirect_stdout(buf):
            r.model, r.opt = _build(entry, s, model())
            r.draw = paddle.rand([4]).numpy()
            net = r.model.network if hasattr(r.model, "network") else r.model
            if hasattr(net, "register_forward_pre_hook"):             # not the pipeline runtime
                net.register_forward_pre_hook(lambda *_: setattr(r, "forwards", r.forwards + 1))
            if setup is not None:
                setup(r)
            for i in range(steps):
                x, y = data(i)
                _step(entry, r, x, y, i)
    except (ValueError, NotImplementedError, TypeError) as e:
        r.error = f"{type(e).__name__}: {e}"
    r.out = buf.getvalue()
    return r


_BASE_RUNS: dict = {}


def run_cached(entry, values, world, steps, setup=None) -> Run:
    """Base runs are shared by the probes that start from the same strategy."""
    key = (entry, repr(sorted(values.items())), world, steps, setup)
    if key not in _BASE_RUNS:
        _BASE_RUNS[key] = run(entry, values, world, steps, setup)
    return _BASE_RUNS[key]


def _step(entry, r, x, y, i):
    if entry == ep.TO_STATIC:
        with SavedBytes() as sb:
            r.losses.append(r.model.train_step((x, y)))
        if i == 0:
            r.saved_bytes = sb.bytes
        return
    if isinstance(r.model, ap.PipelineModule):
        r.losses.append(r.model.train_batch(x, y))
        r.opt.step()
        r.opt.clear_grad()
        return
    with SavedBytes() as sb:
        loss = _loss(r.model, x, y)
    if i == 0:
        r.saved_bytes = sb.bytes
    scaled = r.opt.scale(loss) if hasattr(r.opt, "scale") else loss
    r.scaled.append(float(scaled))
    scaled.backward()
    r.opt.step()
    r.opt.clear_grad()
    r.losses.append(float(loss))


# ---- observables ------------------------------------------------------------------------------------------
def _params(r):
    m = r.model.network if hasattr(r.model, "network") else r.model
    return dict(m.named_parameters())


def local_shapes(r):
    return r.error or {n: tuple(p.shape) for n, p in _params(r).items()}


def outcome(r):
    return r.error or "ran"


def kind(r):
    return r.error or type(r.model).__name__


def losses(r):
    return r.error or tuple(np.round(r.losses, 6))


def scaled(r):
    return r.error or tuple(np.round(r.scaled, 3))


def saved(r):
    return r.error or r.saved_bytes


def planned(r):
    """The planner's explanation (eager), the completed plan's listing (to_static)."""
    if r.error:
        return r.error
    return str(r.model) if r.entry == ep.TO_STATIC else "planned for" in r.out


def accumulation(r):
    """Gradients divided by the steps (eager losses); micro-batches per step (to_static)."""
    return r.error or (r.forwards if r.entry == ep.TO_STATIC else losses(r))


def actions(r):
    return r.error or tuple((a.kind, a.stage, a.microbatch) for a in r.model.records if a.rank == 0)


def stage0_params(r):
    return r.error or sorted(n for n, _ in r.model.stages[0].named_parameters())


def state_bytes(r):
    """Rank 0's optimizer-state and parameter bytes (ZeRO shards them, stage 3 frees parameters)."""
    if r.error:
        return r.error
    o = r.opt if r.opt is not None else r.model.optimizer
    while True:
        if hasattr(o, "memory_bytes"):
            return tuple(sorted(o.memory_bytes(0).items()))
        nxt = o.__dict__.get("optimizer") or o.__dict__.get("_inner")
        if nxt is None:
            break
        o = nxt
    from autoparallel.parallel.optim_clone import state_tensors

    return (("optimizer_states", sum(int(t.numel()) * t.element_size() for t in state_tensors(o))),)


def seeded(r):
    """The draw right after the entry point equals paddle's stream seeded with 123."""
    if r.error:
        return r.error
    paddle.seed(123)
    return bool(np.allclose(r.draw, paddle.rand([4]).numpy()))


def sp_norm_input(r):
    """The placements of the activation entering a block's second norm (eager, recorded during the run);
    the completed plan's per-op placements and collectives (to_static)."""
    return r.error or (str(r.model) if r.entry == ep.TO_STATIC else r.notes[0])


def record_norm_input(r):
    m = r.model.network if hasattr(r.model, "network") else r.model
    m.blocks[0].ln2.register_forward_pre_hook(lambda _l, inp: r.notes.append(str(getattr(inp[0], "placements", ""))))


def host_copies(monkeypatch):
    """Offload on a CPU-only machine: the host is the device, so count the copies to host memory."""
    count = [0]
    orig = paddle.Tensor._copy_to

    def counting(self, place, blocking=True):
        if isinstance(place, paddle.CPUPlace):
            count[0] += 1
        return orig(self, place, blocking)

    monkeypatch.setattr(paddle.Tensor, "_copy_to", counting)
    return count


def ckpt_dirs(root):
    def observe(r):
        if r.error:
            return r.error
        out = []
        for d in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            sub = os.path.join(root, d)
            out.append((d, sorted(x for x in os.listdir(sub) if x.startswith("step"))) if os.path.isdir(sub) else d)
        return out
    return observe


# ---- probes: field -> (world, base values, changed value, observable) ------------------------------------
@dataclass
class Probe:
    world: int
    base: dict
    value: Any
    observe: Callable
    also: dict = field(default_factory=dict)        # other fields the change needs (a switch, a schedule)
    steps: int = 2                                  # 1: shapes, plan, first-step actions / bytes / activations
    setup: Callable = None                          # called after the entry point, before the steps
    static_base: dict = None                        # the base for ap.to_static when it differs


PP = {"pipeline_parallel.degree": 2, "pipeline_parallel.micro_batches": 2}
FP16 = {"amp.enable": True, "amp.dtype": "float16"}
OVERFLOW = dict(FP16, **{"amp.init_loss_scaling": 2.0**60})
CK = "ck"                                          # relative to the test's working directory


def probes():
    return {
        "auto_mode": Probe(2, {"global_batch_size": B}, "full", planned, static_base={}, steps=1),
        "data_parallel.degree": Probe(2, {}, 1, outcome, steps=1),              # checked against the world
        "tensor_parallel.degree": Probe(2, {}, 2, local_shapes, steps=1),
        "pipeline_parallel.degree": Probe(2, {}, 2, kind, {"pipeline_parallel.micro_batches": 2}, steps=1),
        "pipeline_parallel.micro_batches": Probe(2, {"pipeline_parallel.degree": 2}, 4, actions, steps=1),
        "pipeline_parallel.schedule": Probe(2, PP, "ZB-H1", actions, steps=1),
        "pipeline_parallel.vpp_degree": Probe(2, PP, 2, actions, {"pipeline_parallel.schedule": "VPP"}, steps=1),
        "pipeline_parallel.split_points": Probe(2, PP, ["blocks.3"], stage0_params, steps=1),
        "sequence_parallel.enable": Probe(2, {"tensor_parallel.degree": 2}, True, sp_norm_input,
                                          setup=record_norm_input, steps=1),
        "sharding.enable": Probe(2, {}, True, state_bytes, steps=1),
        "sharding.stage": Probe(2, {"sharding.enable": True}, 3, state_bytes, steps=1),
        "sharding.degree": Probe(4, {"sharding.enable": True}, 2, state_bytes, steps=1),
        "sharding.offload": Probe(2, {"sharding.enable": True}, True, None),   # host copies (monkeypatched)
        "recompute.enable": Probe(1, {}, True, saved, steps=1),
        "recompute.checkpoint_every_n_layers": Probe(1, {"recompute.enable": True}, 2, saved, steps=1),
        "recompute.granularity": Probe(1, {"recompute.enable": True}, "selective", saved, steps=1),
        "amp.enable": Probe(1, {}, True, losses),
        "amp.dtype": Probe(1, {"amp.enable": True}, "float16", losses),
        "amp.level": Probe(1, {"amp.enable": True}, "O2", losses),
        "amp.init_loss_scaling": Probe(1, FP16, 1024.0, scaled),
        "amp.incr_every_n_steps": Probe(1, FP16, 1, scaled, steps=3),
        "amp.decr_every_n_nan_or_inf": Probe(1, OVERFLOW, 2, scaled, steps=3),
        "amp.incr_ratio": Probe(1, dict(FP16, **{"amp.incr_every_n_steps": 1}), 4.0, scaled, steps=3),
        "amp.decr_ratio": Probe(1, OVERFLOW, 0.25, scaled, steps=3),
        "amp.use_dynamic_loss_scaling": Probe(1, dict(FP16, **{"amp.incr_every_n_steps": 1}), False, scaled,
                                              steps=3),
        "checkpoint.enable": Probe(1, {}, True, ckpt_dirs(CK), {"checkpoint.dir": CK,
                                                                "checkpoint.save_interval_steps": 1}),
        "checkpoint.save_interval_steps": Probe(1, {"checkpoint.enable": True, "checkpoint.dir": CK}, 1,
                                                ckpt_dirs(CK)),
        "checkpoint.dir": Probe(1, {"checkpoint.enable": True, "checkpoint.save_interval_steps": 1}, "ck2",
                                ckpt_dirs(".")),
        "checkpoint.keep_last": Probe(1, {"checkpoint.enable": True, "checkpoint.dir": CK,
                                          "checkpoint.save_interval_steps": 1}, 1, ckpt_dirs(CK), steps=3),
        "gradient_accumulation_steps": Probe(1, {}, 2, accumulation),
        "micro_batch_size": Probe(2, {}, 1, outcome, steps=1),                 # the batch of 4 is not 2 x 1
        "global_batch_size": Probe(2, {}, 2 * B, outcome, steps=1),            # nor 8
        "seed": Probe(1, {}, 123, seeded, steps=1),
    }


PROBES = probes()
CASES = [(n, e) for n in ep.strategy_fields() for e in ep.ENTRY_POINTS]


def test_every_field_has_a_probe_and_a_classification():
    fields = ep.strategy_fields()
    assert len(fields) > 30 and "sharding.offload" in fields and "amp.dtype" in fields
    assert sorted(PROBES) == sorted(fields), "classify the new Strategy field in entry_points.TABLE and probe it here"
    assert sorted(ep.TABLE) == sorted(fields)
    for name in fields:
        assert set(ep.TABLE[name]) == set(ep.ENTRY_POINTS)
        assert set(ep.TABLE[name].values()) <= {ep.EFFECTIVE, ep.REJECTED}, name


@pytest.mark.parametrize("name,entry", CASES, ids=[f"{n}-{e}" for n, e in CASES])
def test_field_is_effective_or_rejected(name, entry, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from autoparallel import auto_checkpoint

    auto_checkpoint.reset()
    p = PROBES[name]
    if entry == ep.TO_STATIC and p.static_base is not None:
        p = Probe(p.world, p.static_base, p.value, p.observe, p.also, p.steps, p.setup)
    changed = dict(p.base, **p.also, **{name: p.value})
    if ep.TABLE[name][entry] == ep.REJECTED:
        r = run(entry, changed, p.world, p.steps)
        assert name in r.error and ("NotImplementedError" in r.error or "ValueError" in r.error), r.error
        return
    observe = p.observe
    if name == "sharding.offload":
        counter = host_copies(monkeypatch)
        observe = lambda r: r.error or counter[0]             # noqa: E731
        before = observe(run(entry, p.base, p.world, p.steps))
        counter[0] = 0
        after = observe(run(entry, changed, p.world, p.steps))
    else:
        cached = not name.startswith("checkpoint.")           # checkpoint runs write in this test's directory
        if not cached:                                         # each run its own root: a root belongs to one run
            os.makedirs("base")
            monkeypatch.chdir(tmp_path / "base")
        before = observe(run_cached(entry, p.base, p.world, p.steps, p.setup) if cached
                         else run(entry, p.base, p.world, p.steps, p.setup))
        if not cached:
            os.makedirs(tmp_path / "changed")
            monkeypatch.chdir(tmp_path / "changed")
        after = observe(run(entry, changed, p.world, p.steps, p.setup))
    assert not (isinstance(before, str) and before.startswith(("ValueError", "NotImplementedError", "TypeError"))
                and name not in ("data_parallel.degree", "micro_batch_size", "global_batch_size")), before
    assert before != after, f"strategy.{name}={p.value!r} had no observable effect on {entry}: {before!r}"
    if name in ("data_parallel.degree", "micro_batch_size", "global_batch_size"):
        assert name in after                                   # the refused batch / world names the field
    if name == "seed":
        assert after is True


def test_parallelize_without_optimizer_refuses_optimizer_fields():
    for values in ({"sharding.enable": True}, {"gradient_accumulation_steps": 2},
                   {"checkpoint.enable": True}):
        with ap.simulate(world_size=2):
            with pytest.raises(ValueError, match=f"without an optimizer cannot honour strategy "
                                                 f"{next(iter(values))}"):
                ap.parallelize(model(), None, strategy=make_strategy(values))
    with ap.simulate(world_size=2):
        ap.parallelize(model(), None, strategy=make_strategy({"recompute.enable": True}))   # model-side: fine


def test_optimizer_over_another_models_parameters_is_refused():
    with ap.simulate(world_size=2):
        a, b = model(), model()
        opt = paddle.optimizer.AdamW(parameters=b.parameters())
        n = len(b.parameters())
        with pytest.raises(ValueError, match=f"{n} of the optimizer's {n} parameters are not parameters of the GPT"):
            ap.parallelize(a, opt)
        dm = ap.DataParallel(model())
        mixed = paddle.optimizer.AdamW(parameters=dm.parameters() + [b.parameters()[0]])
        with pytest.raises(ValueError, match=f"1 of the optimizer's {n + 1} parameters"):
            ap.Optimizer(mixed)
        sub = paddle.optimizer.AdamW(parameters=dm.parameters()[:3])        # a subset is fine (fine-tuning)
        assert len(ap.Optimizer(sub).parameters) == 3


def test_optimizer_strategy_must_match_the_data_parallel_one():
    with ap.simulate(world_size=2):
        m = model()
        opt = paddle.optimizer.AdamW(parameters=m.parameters())
        dm = ap.DataParallel(m, strategy=make_strategy({"sharding.enable": True}))
        with pytest.raises(ValueError, match="differs from the strategy ap.DataParallel built"):
            ap.Optimizer(opt, strategy=make_strategy({"gradient_accumulation_steps": 2}))
        assert dm is m
        with pytest.raises(ValueError, match="found no model built by ap.DataParallel"):
            other = model()
            ap.Optimizer(paddle.optimizer.AdamW(parameters=other.parameters()),
                         strategy=make_strategy({"recompute.enable": True}))


@pytest.mark.parametrize("nccl", [True, False])
def test_backward_use_async_allreduce(monkeypatch, nccl):
    """Backward-launched reductions: asynchronous where the backend overlaps unless the flag says False;
    on gloo (no overlap) the flag is accepted and changes nothing."""
    from autoparallel.parallel import grads

    monkeypatch.setattr(grads, "overlaps", lambda: nccl)
    launched = []
    orig = grads.reduce_bucket

    def record(bucket, async_op=False):
        launched.append(async_op)
        return orig(bucket, False)                            # the simulated world reduces in place

    monkeypatch.setattr(grads, "reduce_bucket", record)
    with ap.simulate(world_size=2):
        m, _ = ap.parallelize(model(), None)
        opt = ap.shard_optimizer(paddle.optimizer.AdamW(parameters=m.parameters()))
        seen = {}
        for i, flag in enumerate([None, None, True, False]):     # buckets launch from backward from step 2 on
            launched.clear()
            x, y = data(i)
            _loss(m, x, y).backward(use_async_allreduce=flag)
            seen[flag] = list(launched)
            opt.step()
            opt.clear_grad()
        assert seen[None] and seen[True] and seen[False]
        assert set(seen[None]) == {nccl} and set(seen[True]) == {nccl} and set(seen[False]) == {False}
        with pytest.raises(TypeError, match="use_async_allreduce must be True, False or None"):
            _loss(m, *data(0)).backward(use_async_allreduce="yes")


def test_init_parallel_env():
    world = ap.init_parallel_env()                            # one process, not launched: a world of one
    assert world.world_size == 1 and world.rank == 0 and not world.is_simulated
    with ap.simulate(world_size=4) as sim:
        assert ap.init_parallel_env() is sim                   # nothing to initialise


def test_the_documented_table_is_the_code_table():
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "entry_points.md")).read()
    assert ep.markdown_table() in doc


def _train_sim(spelling, values, world=4, steps=2):
    s = make_strategy(values)
    with ap.simulate(world_size=world):
        m = model()
        opt = paddle.optimizer.AdamW(1e-2, parameters=m.parameters(), epsilon=1e-4)
        if spelling == "parallelize":
            m, opt = ap.parallelize(m, opt, strategy=s)
        else:
            m = ap.DataParallel(m, strategy=s)
            opt = ap.Optimizer(opt)
        out = []
        for i in range(steps):
            loss = _loss(m, *data(i))
            opt.scale(loss).backward() if hasattr(opt, "scale") else loss.backward()
            opt.step()
            opt.clear_grad()
            out.append(float(loss))
        zero = next((o for o in (opt, getattr(opt, "optimizer", None)) if hasattr(o, "memory_bytes")), None)
        if zero is not None and zero.stage == 3:
            zero.gather(zero.params)
        return out, {n: p.full().numpy() for n, p in m.named_parameters()}, type(opt).__name__


def test_data_parallel_and_optimizer_is_the_same_build_as_parallelize():
    values = {"tensor_parallel.degree": 2, "sequence_parallel.enable": True, "sharding.enable": True,
              "sharding.stage": 3, "sharding.offload": True, "recompute.enable": True, "amp.enable": True,
              "amp.dtype": "float16", "amp.init_loss_scaling": 1024.0}
    a, b = _train_sim("parallelize", values), _train_sim("DataParallel", values)
    assert a[2] == b[2] == "AmpOptimizer"
    np.testing.assert_allclose(a[0], b[0], rtol=1e-6)
    for n in a[1]:
        np.testing.assert_allclose(a[1][n], b[1][n], rtol=1e-6, atol=1e-7, err_msg=n)


def test_negative_control_an_ignored_field_fails_the_walk(monkeypatch, tmp_path):
    from autoparallel.parallel import recompute

    monkeypatch.setattr(recompute, "apply_ac", lambda model, *a, **k: model)     # recompute silently dropped
    with pytest.raises(AssertionError, match="recompute.enable=True had no observable effect"):
        test_field_is_effective_or_rejected("recompute.enable", ep.PARALLELIZE, tmp_path, monkeypatch)


def test_parallelize_keywords_the_strategy_would_not_use_are_refused():
    with ap.simulate(world_size=2):
        with pytest.raises(ValueError, match=r"seq_len=16, cluster='1x2:A100-80GB' price the planner's choice"):
            ap.parallelize(model(), None, seq_len=16, cluster="1x2:A100-80GB")
        with pytest.raises(ValueError, match=r"tp_plan=\{'blocks.\*.attn.qkv'\}.*tensor_parallel.degree=1"):
            ap.DataParallel(model(), tp_plan={"blocks.*.attn.qkv": ap.ColWiseParallel()})


def test_lazy_model_under_zero3_is_drawn_chunk_by_chunk_by_either_spelling():
    """ap.DataParallel leaves a paddle.LazyGuard model lazy under ZeRO-3; ap.Optimizer draws each rank's
    chunks, exactly as ap.parallelize does in one call."""
    def lazy_model():
        paddle.seed(0)
        with paddle.LazyGuard():
            return model()

    s = make_strategy({"sharding.enable": True, "sharding.stage": 3})
    masters = []
    with ap.simulate(world_size=2):
        for spelling in ("parallelize", "DataParallel"):
            m = lazy_model()
            opt = paddle.optimizer.AdamW(parameters=m.parameters())
            if spelling == "parallelize":
                m, opt = ap.parallelize(m, opt, strategy=s)
            else:
                m = ap.DataParallel(m, strategy=s)
                assert layer_state.build_of(m).lazy                       # nothing drawn yet
                opt = ap.Optimizer(opt)
            assert type(opt).__name__ == "LazyZeroOptimizer"
            masters.append({(n, r): opt.master[r][id(p)].numpy() for n, p in m.named_parameters() for r in (0, 1)})
    assert masters[0].keys() == masters[1].keys()
    for k in masters[0]:
        np.testing.assert_array_equal(masters[0][k], masters[1][k], err_msg=str(k))
