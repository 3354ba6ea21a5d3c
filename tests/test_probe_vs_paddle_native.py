"""The same user programs on 2 real gloo ranks through paddle's own auto-parallel (``import paddle.distributed as
dist``, dygraph on CPU) and through ``import autoparallel as dist`` (job ``vs_paddle_native`` of the shared 2-rank
launch, dist_scripts/vs_paddle_native_worker.py; programs in vs_paddle_native_programs.py and
vs_paddle_native_training.py). Global values, and the local shard of every tensor the user placed, must agree with
paddle's on every rank; placements are reported only. Where paddle raises on CPU or computes a wrong value, ours
is checked against numpy instead; each such difference is documented in docs/vs_paddle_native.md."""
import os

import pytest

from dist_scripts import shared_launch

HERE = os.path.join(os.path.dirname(__file__), "dist_scripts")
JOB = shared_launch.job(__name__, "vs_paddle_native", os.path.join(HERE, "vs_paddle_native_worker.py"), 2,
                        timeout=150)

from vs_paddle_native_programs import ORACLES, PROGRAMS          # noqa: E402  (after the job's declaration)
from vs_paddle_native_worker import (OURS_DIFFER, PADDLE_RAISES, PADDLE_WRONG, _close, compare,   # noqa: E402
                                     layout_local, oracle_diffs)

BY_NAME = {p.__name__: p for p in PROGRAMS}

@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


def _ours(ranks, name):
    outs = [r[name]["ap"] for r in ranks]
    for r, o in enumerate(outs):
        assert "error" not in o, f"rank {r}: {o.get('trace', o.get('error'))}"
    return outs


def _check_layout(name, outs):
    """A reshard program: the global value is its input, each rank's shard the layout's slice of it."""
    want = BY_NAME[name].expect
    for r, o in enumerate(outs):
        got = o["out"]
        assert _close(got["value"], want), (name, r)
        assert _close(got["local"], layout_local(want, got["placements"], _mesh_shape(name), r)), (name, r)


def _mesh_shape(name):
    return (2, 1) if name.endswith("_2x1") else (1, 2) if name.endswith("_1x2") else (2,)


def _check_oracle(name, outs):
    for r, o in enumerate(outs):
        assert oracle_diffs(name, o, r) == [], (name, r)


PADDLE_NOT_RUN = {n for n, p in BY_NAME.items() if getattr(p, "paddle_skip", None)}
CHECKED_OTHERWISE = set(PADDLE_RAISES) | PADDLE_WRONG | set(OURS_DIFFER) | PADDLE_NOT_RUN


@pytest.mark.parametrize("name", [n for n in BY_NAME if n not in CHECKED_OTHERWISE])
def test_equal_to_paddle_native(ranks, name):
    for r, res in enumerate(ranks):
        assert compare(res[name]) == [], f"rank {r}: {compare(res[name])}\n{res[name]['ap'].get('trace', '')}"


@pytest.mark.parametrize("name", sorted(PADDLE_RAISES))
def test_where_paddle_raises_on_cpu_ours_is_numpys(ranks, name):
    for res in ranks:
        assert PADDLE_RAISES[name] in res[name]["paddle"].get("error", ""), res[name]["paddle"]
    outs = _ours(ranks, name)
    if hasattr(BY_NAME[name], "expect"):
        _check_layout(name, outs)
    elif name in ORACLES:
        _check_oracle(name, outs)


@pytest.mark.parametrize("name", sorted(PADDLE_WRONG))
def test_where_paddle_is_wrong_ours_is_numpys(ranks, name):
    assert any(compare(res[name]) for res in ranks), f"{name}: paddle now agrees; move it to the equal programs"
    outs = _ours(ranks, name)
    if hasattr(BY_NAME[name], "expect"):
        _check_layout(name, outs)
    else:
        _check_oracle(name, outs)
    if name == "shard_tensor_1d_Pavg_Pmax":           # ours: every rank of a Partial(max) holds the value
        assert all(_close(o["Pmax"]["local"], o["Pmax"]["value"]) for o in outs)


@pytest.mark.parametrize("name", [n for n in BY_NAME if n.startswith("bad_")])
def test_where_paddle_refuses_ours_raises_a_typed_error(ranks, name):
    for res in ranks:
        p, o = res[name]["paddle"], res[name]["ap"]
        if name == "bad_to_local_other_placements":              # paddle returns the local value as is
            assert "error" not in p
        else:
            assert "error" in p or "skipped" in p, p
        assert o.get("error", "").split(":")[0] in ("ValueError", "TypeError"), o


@pytest.mark.parametrize("name", sorted(PADDLE_NOT_RUN - set(OURS_DIFFER)))
def test_where_paddle_crashes_or_hangs_ours_is_numpys(ranks, name):
    """paddle is not run (it would abort, segfault or hang the job: the reason is the program's paddle_skip)."""
    assert ranks[0][name]["paddle"] == {"skipped": BY_NAME[name].paddle_skip}
    _check_oracle(name, _ours(ranks, name))


def test_shard_tensor_honours_stop_gradient_which_paddle_ignores_for_a_tensor(ranks):
    for res in ranks:
        p, o = res["shard_tensor_inputs"]["paddle"], res["shard_tensor_inputs"]["ap"]
        assert p["z.stop_gradient"]["value"] == 1.0 and o["z.stop_gradient"]["value"] == 0.0
        assert compare({"paddle": {k: v for k, v in p.items() if k != "z.stop_gradient"},
                        "ap": {k: v for k, v in o.items() if k != "z.stop_gradient"}}) == []


@pytest.mark.parametrize("name", ["reshard_R_to_Pavg", "reshard_R_to_Pmax", "reshard_S0_to_Pavg"])
def test_reshard_to_partial_avg_or_max_keeps_the_reduce_type(ranks, name):
    for r, res in enumerate(ranks):
        p, o = res[name]["paddle"]["out"], res[name]["ap"]["out"]
        assert p["placements"] == "[P(sum)]" and o["placements"] == f"[P({name[-3:].lower()})]"
        assert _close(o["value"], p["value"]) and _close(o["value"], BY_NAME[name].expect)
        assert _close(o["local"], BY_NAME[name].expect), r          # every rank holds the value


def test_a_plan_key_naming_no_layer_is_refused_where_paddle_ignores_it(ranks):
    for res in ranks:
        assert "error" not in res["parallelize_plan_typo"]["paddle"]          # trains with every layer replicated
        err = res["parallelize_plan_typo"]["ap"]["error"]
        assert err.startswith("PlanError: tensor-parallel plan pattern 'llama.layers.*.self_attn.q_proj' matches no "
                              "layer of LlamaForCausalLM"), err


def test_paddles_auto_parallel_module_is_not_offered_for_our_tensors():
    """``dist.auto_parallel.api.dtensor_from_local`` (where paddle 3.3.1 keeps it) with ``import autoparallel as dist``:
    the hint said to call paddle's module itself, whose functions do not take these tensors."""
    import autoparallel as ap

    with pytest.raises(AttributeError, match="here at the top level .*ap.dtensor_from_local"):
        ap.auto_parallel


def test_set_mesh_is_refused_by_name(ranks):
    for res in ranks:
        assert res["set_get_mesh"]["paddle"] == {"same": {"value": 1.0, "shape": []}}
        assert res["set_get_mesh"]["ap"]["error"].startswith("AttributeError: module 'autoparallel' does not provide "
                                                             "paddle.distributed.set_mesh: pass the mesh")


def test_dtensor_from_local_agrees_uneven_shards_over_the_ranks(ranks):
    """Each rank used to take its own local size times 2 as the global one (rank 0 [8, 3], rank 1 [6, 3]): the
    next collective aborted the process (gloo ``op.preamble.length <= op.nbytes``)."""
    from vs_paddle_native_programs import A73

    for r, o in enumerate(_ours(ranks, "from_local_uneven")):
        assert o["x"]["shape"] == [7, 3] and _close(o["x"]["value"], A73)
        assert _close(o["x"]["local"], A73[:4] if r == 0 else A73[4:])
    for res in ranks:
        err = res["from_local_not_a_layout"]["ap"]["error"]
        assert err.startswith("ValueError: dtensor_from_local: the local shards along dim 0 have sizes [3, 4]"), err
        assert "global_shape=" in err


def test_placements_are_reported_for_every_program(ranks):
    """Not required equal (the rules may choose differently), but read: every distributed output names one."""
    for res in ranks:
        for name, o in res.items():
            for side in ("paddle", "ap"):
                for k, v in o[side].items():
                    if isinstance(v, dict) and "local" in v:
                        assert v["placements"].startswith("["), (name, side, k)


def test_momentum_which_paddle_refuses_trains_as_one_process(ranks):
    import paddle
    import paddle.nn.functional as F
    from vs_paddle_native_training import BATCHES, MLP

    paddle.seed(5)
    model = MLP()
    opt = paddle.optimizer.Momentum(0.1, parameters=model.parameters(), grad_clip=paddle.nn.ClipGradByGlobalNorm(0.3))
    losses = []
    for x, y in BATCHES:
        loss = F.mse_loss(model(paddle.to_tensor(x)), paddle.to_tensor(y))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    for res in ranks:
        assert "only supports AdamW and SGD" in res["optimizer_momentum_dp"]["paddle"]["error"]
        ours = res["optimizer_momentum_dp"]["ap"]
        assert _close(ours["losses"]["value"], losses), (ours["losses"], losses)
        for n, p in model.named_parameters():
            assert _close(ours[n]["value"], p.numpy()), n


def test_parallelize_plan_over_a_size_one_mp_dim_checks_its_keys():
    """paddle runs a plan over a size-1 'mp' dim (every layer stays whole; job program parallelize_dp2_plan); ours
    refused it with ValueError. A key naming no layer is still refused."""
    import paddle
    from vs_paddle_native_training import MLP

    import autoparallel as ap
    from autoparallel.parallel.tensor_parallel import PlanError

    with ap.simulate(2):
        mesh = ap.ProcessMesh([[0], [1]], dim_names=["dp", "mp"])
        model = MLP()
        opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
        with pytest.raises(PlanError, match="fcx"):
            ap.parallelize(model, opt, mesh, {"mp_config": {"parallelize_plan": {"fcx": ap.ColWiseParallel()}}})
