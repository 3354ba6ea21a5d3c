"""auto_mode="full" next to what the user fixed: Strategy fields the search can honour (degrees, sequence
parallelism, ZeRO stage, recompute), a mesh passed to ap.parallelize and a tp_plan narrow the search and are
applied (layouts and values checked against one process); fields it cannot honour are refused by name; a model
the planner does not read as blocks cannot silently drop a fixed value."""
import numpy as np
import pytest

from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

import paddle  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel.planner.auto import choose  # noqa: E402
from test_auto_full_models import T, _run  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


def full_strategy(global_batch=4, **fields):
    s = ap.Strategy()
    s.auto_mode = "full"
    s.global_batch_size = global_batch
    for name, value in fields.items():
        section, _, leaf = name.partition("__")
        setattr(getattr(s, section), leaf, value) if leaf else setattr(s, section, value)
    return s


def train(model, opt, steps=2):
    """(losses, {name: parameter}) after ``steps`` steps on test_auto_full_models' batch."""
    return _run(model, opt, steps)


@pytest.fixture(scope="module")
def reference():
    model = pf.build("llama", fill_zeros=True)
    return train(model, paddle.optimizer.AdamW(1e-3, parameters=model.parameters()))


def assert_same(got, ref):
    np.testing.assert_allclose(got[0], ref[0], rtol=RTOL, atol=ATOL)
    for n, p in ref[1].items():
        np.testing.assert_allclose(got[1][n], p, rtol=RTOL, atol=ATOL, err_msg=n)


def parallel_run(strategy, name="llama", **kwargs):
    """(chosen Strategy, plan text, {name: placements}, training result) on 4 simulated ranks."""
    with ap.simulate(world_size=4):
        model = pf.build(name, fill_zeros=True)
        opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=strategy, seq_len=T, **kwargs)
        layouts = {n: [str(x) for x in p.placements] for n, p in model.named_parameters()}
        return ap.chosen_strategy(model), str(ap.chosen_plan(model)), layouts, train(model, opt)


def test_fixed_zero3_is_kept_applied_and_trains_like_one_process(reference):
    """sharding.stage=3 was silently replaced by the planner's choice (no ZeRO)."""
    chosen, text, _, got = parallel_run(full_strategy(sharding__enable=True, sharding__stage=3))
    assert chosen.sharding.enable and chosen.sharding.stage == 3
    assert "fixed by the strategy, mesh or tp_plan: sharding.stage=3" in text
    assert_same(got, reference)


def test_mesh_passed_in_fixes_the_degrees_and_trains_like_one_process(reference):
    """Global batch 4 alone gives dp=4; a [2, 2] mesh fixes dp=2 x tp=2 (before: the plan ignored the mesh and
    parallelize refused it with "shape [dp, tp] = [4, 1]")."""
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
    chosen, text, layouts, got = parallel_run(full_strategy(), mesh=mesh)
    assert (chosen.data_parallel.degree, chosen.tensor_parallel.degree) == (2, 2)
    assert layouts["model.layers.0.self_attn.q_proj.weight"] == ["R", "S(1)"]
    assert "data_parallel.degree=2, tensor_parallel.degree=2" in text
    assert_same(got, reference)


@pytest.mark.parametrize("fields,check", [
    ({"recompute__enable": True}, lambda c: c.recompute.enable and c.recompute.granularity == "full"),
    ({"sequence_parallel__enable": True}, lambda c: c.sequence_parallel.enable and c.tensor_parallel.degree > 1),
    ({"data_parallel__degree": 2}, lambda c: c.data_parallel.degree == 2 and c.tensor_parallel.degree == 2),
    ({"tensor_parallel__degree": 4}, lambda c: c.tensor_parallel.degree == 4 and c.data_parallel.degree == 1),
    ({"sharding__enable": True, "sharding__stage": 2}, lambda c: c.sharding.enable and c.sharding.stage == 2),
], ids=["recompute", "sp", "dp", "tp", "zero2"])
def test_fixed_fields_narrow_the_search(fields, check):
    with ap.simulate(world_size=4):
        chosen, result = choose(pf.build("llama"), full_strategy(**fields), 4, seq_len=T)
    assert check(chosen) and "fixed by the strategy" in result.explanation


@pytest.mark.parametrize("fields,fragment", [
    ({"pipeline_parallel__micro_batches": 8}, "pipeline_parallel.micro_batches=8"),
    ({"micro_batch_size": 2}, "micro_batch_size=2"),
    ({"sharding__enable": True, "sharding__offload": True}, "sharding.offload=True"),
    ({"recompute__granularity": "selective"}, "recompute.granularity='selective' without recompute.enable=True"),
])
def test_fields_the_search_cannot_keep_are_refused_by_name(fields, fragment):
    with pytest.raises(ValueError, match="auto_mode='full' chooses") as e:
        choose(pf.build("llama"), full_strategy(**fields), 4, seq_len=T)
    assert fragment in str(e.value)


def test_infeasible_fixed_values_raise_naming_them():
    model = pf.build("llama")
    with pytest.raises(ValueError, match=r"pipeline_parallel.degree=2 is fixed.*planner's pipeline search"):
        choose(model, full_strategy(pipeline_parallel__degree=2), 4, seq_len=T)
    with pytest.raises(ValueError, match=r"no configuration.*tensor_parallel.degree=3 is outside"):
        choose(model, full_strategy(6, tensor_parallel__degree=3), 3, seq_len=T)
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
    with pytest.raises(ValueError, match=r"mesh \['data', 'model'\] \[2, 2\] gives data_parallel.degree=2, but the "
                                         r"strategy sets data_parallel.degree=4"):
        choose(model, full_strategy(data_parallel__degree=4), 4, seq_len=T, mesh=mesh)
    with pytest.raises(ValueError, match=r"mesh \['data', 'model'\] \[1, 2\] spans 2 ranks, expected all 4"):
        choose(model, full_strategy(), 4, seq_len=T, mesh=ap.ProcessMesh([[0, 1]], dim_names=["data", "model"]))


def test_tp_plan_next_to_full_mode_gets_tensor_parallelism(reference):
    """A tp_plan with global batch 4 (alone: dp=4, tp=1) was refused after planning with "set the degree > 1",
    a field auto_mode='full' does not let the user set; now the search keeps tp > 1 and applies the plan."""
    plan = {"model.layers.*.mlp.up_proj": ap.ColWiseParallel(), "model.layers.*.mlp.gate_proj": ap.ColWiseParallel(),
            "model.layers.*.mlp.down_proj": ap.RowWiseParallel()}
    chosen, _, layouts, got = parallel_run(full_strategy(), tp_plan=plan)
    assert chosen.tensor_parallel.degree > 1
    assert layouts["model.layers.0.mlp.up_proj.weight"][-1] == "S(1)"
    assert_same(got, reference)
    with pytest.raises(ValueError, match=r"tp_plan=.*needs tp > 1, but a world of 1 rank"):
        choose(pf.build("llama"), full_strategy(), 1, seq_len=T, tp_plan=plan)


def test_model_not_read_as_blocks_cannot_drop_a_fixed_value():
    """A CNN runs data parallel (planner/generic.py); ZeRO-3 fixed next to it is not silently dropped."""
    model = paddle.nn.Sequential(paddle.nn.Conv2D(3, 4, 3), paddle.nn.Flatten(), paddle.nn.Linear(4 * 6 * 6, 2))
    with pytest.raises(ValueError, match=r"cannot keep sharding.stage=3 \(the plan has 0\)"):
        choose(model, full_strategy(sharding__enable=True, sharding__stage=3), 4)
    chosen, _ = choose(model, full_strategy(data_parallel__degree=4), 4)
    assert chosen.data_parallel.degree == 4


def test_sequence_longer_than_the_position_table_is_refused_not_run_data_parallel():
    """A GPT with a learned 16-row position table, priced at seq_len=64: the trace fails on the length and the
    planner used to fall back to "not read as a stack of blocks" (plain data parallelism) for a run that fails
    at its first step; now the error names seq_len and the limit."""
    import dataclasses

    from models import PRESETS, build

    model = build(dataclasses.replace(PRESETS["gpt-tiny"], vocab_size=256))
    with pytest.raises(ValueError, match=r"seq_len=64 exceeds GPT's config.max_positions=16.*expected seq_len <= 16"):
        choose(model, full_strategy(), 4, seq_len=64)
    chosen, result = choose(model, full_strategy(), 4, seq_len=16)      # the control: within the table
    assert "traced" in result.explanation.splitlines()[0] and chosen.data_parallel.degree > 1


@pytest.mark.parametrize("batch,steps", [(2, 2), (8, 2), (4, 4)])
def test_kept_accumulation_is_the_priced_micro_batch_count(batch, steps):
    """gradient_accumulation_steps is kept (the loop's shape); the plan printed and priced used to be the
    planner's own micro-batching (one micro-batch of 2 at batch 2) while the runtime ran 2 of 1."""
    chosen, result = choose(pf.build("llama"), full_strategy(batch, gradient_accumulation_steps=steps), 4, seq_len=T)
    config = result.best.config
    assert chosen.gradient_accumulation_steps == steps == config.num_micro_batches(batch)
    assert (chosen.data_parallel.degree, chosen.tensor_parallel.degree) == (config.dp, config.tp)
    assert batch == config.dp * config.micro_batch * steps


def test_accumulation_that_does_not_split_the_batch_is_refused():
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=3 .* does not divide global_batch_size=2"):
        choose(pf.build("llama"), full_strategy(2, gradient_accumulation_steps=3), 4, seq_len=T)
