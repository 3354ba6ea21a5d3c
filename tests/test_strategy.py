"""Strategy: checked assignment, cross-field validation, serialisation, printing, command-line flags."""
import argparse
import json

import pytest

import autoparallel as ap
from autoparallel.strategy import (AmpConfig, ResolvedDegrees, ShardingConfig, Strategy, add_strategy_args)


def design_strategy():
    """The strategy block of DESIGN.md, verbatim."""
    s = ap.Strategy()
    s.auto_mode = "semi"
    s.data_parallel.degree = 2; s.tensor_parallel.degree = 4
    s.pipeline_parallel.degree = 2; s.pipeline_parallel.micro_batches = 8
    s.pipeline_parallel.schedule = "1F1B"
    s.sequence_parallel.enable = True
    s.sharding.enable = True; s.sharding.stage = 3; s.sharding.offload = True
    s.recompute.enable = True; s.recompute.checkpoint_every_n_layers = 2
    s.amp.enable = True; s.amp.dtype = "bfloat16"
    return s


def invalid(s, *fragments, **kw):
    """validate() must raise ValueError whose message contains every fragment."""
    with pytest.raises(ValueError) as e:
        s.validate(**kw)
    msg = str(e.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


# -- construction and checked assignment ------------------------------------------------------

def test_public_export_and_design_block():
    assert ap.Strategy is Strategy
    s = design_strategy()
    r = s.validate(world_size=16, model_info={"heads": 32, "kv_heads": 8, "hidden": 4096, "layers": 32, "vocab": 50257})
    assert r == ResolvedDegrees(dp=2, tp=4, pp=2, vpp=1, sharding_degree=2, sharding_stage=3, num_micro_batches=8)
    assert r.world_size == 16


def test_defaults():
    s = Strategy()
    assert s.auto_mode == "semi" and s.data_parallel.degree is None
    assert s.tensor_parallel.degree == 1 and s.pipeline_parallel.degree == 1
    assert s.pipeline_parallel.schedule == "1F1B" and s.pipeline_parallel.split_points == []
    assert not s.sharding.enable and s.sharding.stage == 1 and s.sharding.degree is None
    assert s.gradient_accumulation_steps == 1 and s.seed is None
    assert s.validate() == ResolvedDegrees(1, 1, 1, 1, 1, 0, 1)
    # mutable defaults are not shared between instances
    Strategy().pipeline_parallel.split_points.append("x")
    assert Strategy().pipeline_parallel.split_points == []


@pytest.mark.parametrize("stmt, cls, fragments", [
    ("s.sharding.stagee = 2", AttributeError, ["stagee", "did you mean 'stage'", "enable, stage, degree, offload"]),
    ("s.data_paralel = 2", AttributeError, ["data_paralel", "did you mean 'data_parallel'", "tensor_parallel"]),
    ("s.data_parallel.degre = 2", AttributeError, ["degre", "valid fields: degree"]),
    ("s.amp.dtpye = 'float16'", AttributeError, ["dtpye", "did you mean 'dtype'"]),
    ("s.sharding.stagee", AttributeError, ["stagee", "valid fields"]),                  # reading a typo
])
def test_unknown_attribute(stmt, cls, fragments):
    s = Strategy()
    with pytest.raises(cls) as e:
        exec(stmt)
    for f in fragments:
        assert f in str(e.value)
    assert s == Strategy()                                  # nothing was set


@pytest.mark.parametrize("stmt, cls, fragments", [
    ("s.sharding.stage = 4", ValueError, ["sharding.stage must be 1, 2 or 3, got 4"]),
    ("s.sharding.stage = 0", ValueError, ["1, 2 or 3", "got 0"]),
    ("s.pipeline_parallel.schedule = '2F2B'", ValueError, ["'FThenB', '1F1B', 'VPP' or 'ZB-H1'", "'2F2B'"]),
    ("s.data_parallel.degree = 0", ValueError, ["data_parallel.degree", ">= 1", "got 0"]),
    ("s.tensor_parallel.degree = -2", ValueError, ["tensor_parallel.degree", "got -2"]),
    ("s.tensor_parallel.degree = 2.0", TypeError, ["tensor_parallel.degree", "integer", "2.0"]),
    ("s.tensor_parallel.degree = None", TypeError, ["tensor_parallel.degree", "None"]),
    ("s.pipeline_parallel.degree = True", TypeError, ["pipeline_parallel.degree", "True"]),
    ("s.pipeline_parallel.vpp_degree = 0", ValueError, ["vpp_degree", "got 0"]),
    ("s.pipeline_parallel.split_points = 'blocks.4'", TypeError, ["split_points", "list of layer names"]),
    ("s.sequence_parallel.enable = 1", TypeError, ["sequence_parallel.enable", "True or False", "1"]),
    ("s.recompute.granularity = 'partial'", ValueError, ["'full' or 'selective'", "'partial'"]),
    ("s.recompute.checkpoint_every_n_layers = 0", ValueError, ["checkpoint_every_n_layers", "got 0"]),
    ("s.amp.dtype = 'float32'", ValueError, ["'bfloat16' or 'float16'", "'float32'"]),
    ("s.amp.level = 'O3'", ValueError, ["'O1' or 'O2'", "'O3'"]),
    ("s.amp.init_loss_scaling = 0", ValueError, ["init_loss_scaling", "> 0", "got 0"]),
    ("s.amp.incr_ratio = 1.0", ValueError, ["incr_ratio", "> 1", "got 1"]),
    ("s.amp.decr_ratio = 1.5", ValueError, ["decr_ratio", "< 1", "got 1.5"]),
    ("s.amp.incr_every_n_steps = 0", ValueError, ["incr_every_n_steps", "got 0"]),
    ("s.checkpoint.save_interval_steps = 0", ValueError, ["save_interval_steps", "got 0"]),
    ("s.checkpoint.dir = ''", TypeError, ["checkpoint.dir", "non-empty path"]),
    ("s.checkpoint.keep_last = 0", ValueError, ["keep_last", "got 0"]),
    ("s.gradient_accumulation_steps = 0", ValueError, ["gradient_accumulation_steps must be an integer >= 1, got 0"]),
    ("s.micro_batch_size = 0", ValueError, ["micro_batch_size", "got 0"]),
    ("s.auto_mode = 'manual'", ValueError, ["'semi' or 'full'", "'manual'"]),
    ("s.seed = -1", ValueError, ["seed", ">= 0", "got -1"]),
    ("s.sharding = 3", TypeError, ["sharding must be a ShardingConfig", "int"]),
])
def test_bad_assignment(stmt, cls, fragments):
    s = Strategy()
    with pytest.raises(cls) as e:
        exec(stmt)
    for f in fragments:
        assert f in str(e.value), f"{f!r} not in {str(e.value)!r}"
    assert s == Strategy()                                  # the bad value was not stored


def test_good_assignment_normalises():
    s = Strategy()
    s.amp.init_loss_scaling = 1024                          # ints accepted for float fields, stored as float
    assert s.amp.init_loss_scaling == 1024.0 and isinstance(s.amp.init_loss_scaling, float)
    s.pipeline_parallel.split_points = ("blocks.4", "blocks.8")
    assert s.pipeline_parallel.split_points == ["blocks.4", "blocks.8"]
    s.sharding = {"enable": True, "stage": 2}               # a dict of fields builds the sub-config
    assert isinstance(s.sharding, ShardingConfig) and s.sharding.stage == 2
    s.amp = AmpConfig(enable=True, dtype="float16")
    assert s.amp.dtype == "float16"
    with pytest.raises(ValueError, match="1, 2 or 3"):
        ShardingConfig(stage=5)                             # constructors check too


# -- validate: degrees -------------------------------------------------------------------------

def test_world_size_mismatch():
    s = Strategy()
    s.data_parallel.degree = 2; s.tensor_parallel.degree = 4; s.pipeline_parallel.degree = 2
    s.pipeline_parallel.micro_batches = 2
    invalid(s, "2 x 4 x 2 = 16", "world size 8", world_size=8)
    assert s.validate(world_size=16).dp == 2


def test_dp_inferred_from_world():
    s = Strategy()
    s.tensor_parallel.degree = 2
    r = s.validate(world_size=8)
    assert (r.dp, r.tp, r.pp, r.world_size) == (4, 2, 1, 8)
    assert s.data_parallel.degree is None                   # validate does not modify the strategy
    assert s.validate().dp == 1                             # no world size: an unset dp is 1
    s.tensor_parallel.degree = 3
    invalid(s, "cannot infer data_parallel.degree", "world_size 8", "3 x 1 = 3", world_size=8)


def test_bad_world_size_and_model_info():
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        Strategy().validate(world_size=0)
    with pytest.raises(ValueError, match=r"unknown keys \['head'\]"):
        Strategy().validate(model_info={"head": 8})
    with pytest.raises(ValueError, match=r"model_info\['hidden'\] must be a positive integer or None, got -1"):
        Strategy().validate(model_info={"hidden": -1})
    assert Strategy().validate(model_info={"heads": None, "layers": 2}).tp == 1


@pytest.mark.parametrize("key, value", [("heads", 12), ("kv_heads", 2), ("hidden", 1020)])
def test_tp_must_divide_heads_and_hidden(key, value):
    s = Strategy()
    s.tensor_parallel.degree = 8
    info = {"heads": 32, "kv_heads": 8, "hidden": 4096, key: value}
    invalid(s, "tensor_parallel.degree=8", f"{key}={value}", model_info=info)


def test_vocab_need_not_divide():
    s = Strategy()
    s.tensor_parallel.degree = 4
    assert s.validate(world_size=4, model_info={"heads": 8, "hidden": 512, "vocab": 50257}).tp == 4


def test_pp_at_most_layers():
    s = Strategy()
    s.pipeline_parallel.degree = 4; s.pipeline_parallel.micro_batches = 4
    invalid(s, "pipeline_parallel.degree=4", "layers=2", "at most 2", model_info={"layers": 2})
    s.pipeline_parallel.schedule = "VPP"; s.pipeline_parallel.vpp_degree = 2
    invalid(s, "vpp_degree=2 = 8", "layers=6", model_info={"layers": 6})
    assert s.validate(model_info={"layers": 8}).vpp == 2


# -- validate: pipeline ------------------------------------------------------------------------

def test_vpp_rules():
    s = Strategy()
    s.pipeline_parallel.degree = 2; s.pipeline_parallel.micro_batches = 4
    s.pipeline_parallel.schedule = "VPP"
    invalid(s, "schedule='VPP' needs pipeline_parallel.vpp_degree > 1, got 1")
    s.pipeline_parallel.schedule = "1F1B"; s.pipeline_parallel.vpp_degree = 2
    invalid(s, "vpp_degree=2 needs schedule 'VPP'", "got '1F1B'")
    s.pipeline_parallel.schedule = "VPP"
    assert s.validate(world_size=2).vpp == 2
    s.pipeline_parallel.micro_batches = 3
    invalid(s, "multiple of pipeline_parallel.degree=2", "(3)")


def test_vpp_needs_pipeline():
    s = Strategy()
    s.pipeline_parallel.schedule = "VPP"; s.pipeline_parallel.vpp_degree = 2
    invalid(s, "vpp_degree=2 needs pipeline_parallel.degree > 1, got 1")


@pytest.mark.parametrize("schedule", ["1F1B", "VPP", "ZB-H1"])
def test_steady_schedules_need_pp_micro_batches(schedule):
    s = Strategy()
    s.pipeline_parallel.degree = 4; s.pipeline_parallel.micro_batches = 2
    s.pipeline_parallel.schedule = schedule
    if schedule == "VPP":
        s.pipeline_parallel.vpp_degree = 2
    invalid(s, f"schedule {schedule!r} needs at least pipeline_parallel.degree=4 micro-batches", "got 2")
    s.pipeline_parallel.micro_batches = 4
    assert s.validate(world_size=4).num_micro_batches == 4


def test_fthenb_allows_few_micro_batches():
    s = Strategy()
    s.pipeline_parallel.degree = 4; s.pipeline_parallel.schedule = "FThenB"
    s.pipeline_parallel.micro_batches = 1
    assert s.validate().num_micro_batches == 1


def test_unset_micro_batches_with_pipeline_default_to_degree():
    s = Strategy()
    s.pipeline_parallel.degree = 4                          # the article's config: micro_batches unset
    assert s.validate().num_micro_batches == 4
    s.gradient_accumulation_steps = 8                       # unset micro_batches falls back to accumulation
    assert s.validate().num_micro_batches == 8
    s.gradient_accumulation_steps = 2                       # ... which is then checked like micro_batches
    invalid(s, "needs at least pipeline_parallel.degree=4 micro-batches", "got 2")


def test_grad_accum_and_micro_batches_conflict():
    s = Strategy()
    s.pipeline_parallel.degree = 2; s.pipeline_parallel.micro_batches = 8
    s.gradient_accumulation_steps = 4
    invalid(s, "micro_batches=8", "gradient_accumulation_steps=4", "expected equal")
    s.gradient_accumulation_steps = 8                       # equal values agree
    assert s.validate().num_micro_batches == 8


def test_micro_batches_without_pipeline():
    s = Strategy()
    s.pipeline_parallel.micro_batches = 8
    assert s.num_micro_batches == 1                         # without a pipeline: accumulation steps
    invalid(s, "micro_batches=8 only applies when pipeline_parallel.degree > 1", "gradient_accumulation_steps (got 1)")
    s.gradient_accumulation_steps = 8
    assert s.validate().num_micro_batches == 8


def test_split_points():
    s = Strategy()
    s.pipeline_parallel.split_points = ["blocks.4"]
    invalid(s, "split_points=['blocks.4'] need pipeline_parallel.degree > 1")
    s.pipeline_parallel.degree = 3; s.pipeline_parallel.micro_batches = 3
    invalid(s, "has 1 names, expected pp x vpp - 1 = 2")
    s.pipeline_parallel.split_points = ["blocks.4", "blocks.4"]
    invalid(s, "repeats ['blocks.4']")
    s.pipeline_parallel.split_points = ["blocks.4", "blocks.8"]
    assert s.validate(world_size=3).pp == 3


@pytest.mark.parametrize("pp, micro, ga, expected", [
    (1, None, 1, 1), (1, None, 4, 4), (2, 8, 1, 8), (2, None, 4, 4), (2, 8, 8, 8), (1, 4, 4, 4), (4, None, 1, 4),
])
def test_num_micro_batches(pp, micro, ga, expected):
    s = Strategy()
    s.pipeline_parallel.degree = pp; s.pipeline_parallel.micro_batches = micro
    s.gradient_accumulation_steps = ga
    assert s.num_micro_batches == expected
    assert s.validate().num_micro_batches == expected


# -- validate: sequence parallel, sharding ----------------------------------------------------

def test_sequence_parallel_needs_tp():
    s = Strategy()
    s.sequence_parallel.enable = True
    invalid(s, "sequence_parallel.enable=True needs tensor_parallel.degree > 1", "got tensor_parallel.degree=1")
    s.tensor_parallel.degree = 2
    assert s.validate(world_size=2).tp == 2


def test_sharding_degree_defaults_to_dp():
    s = Strategy()
    s.sharding.enable = True; s.sharding.stage = 2
    r = s.validate(world_size=8)
    assert (r.dp, r.sharding_degree, r.sharding_stage) == (8, 8, 2)


def test_hsdp_degree():
    s = Strategy()
    s.data_parallel.degree = 8; s.sharding.enable = True; s.sharding.stage = 3; s.sharding.degree = 4
    r = s.validate(world_size=8)
    assert (r.dp, r.sharding_degree) == (8, 4)
    s.sharding.degree = 3
    invalid(s, "sharding.degree=3 must divide the data-parallel degree 8", world_size=8)
    s.sharding.degree = 16
    invalid(s, "sharding.degree=16", "degree 8", world_size=8)


def test_hsdp_degree_with_inferred_dp():
    s = Strategy()
    s.tensor_parallel.degree = 2; s.sharding.enable = True; s.sharding.degree = 2
    assert s.validate(world_size=8).sharding_degree == 2      # dp inferred as 4
    s.sharding.degree = 3
    invalid(s, "sharding.degree=3", "data-parallel degree 4", world_size=8)


def test_offload_and_degree_need_sharding():
    s = Strategy()
    s.sharding.offload = True
    invalid(s, "sharding.offload=True needs sharding.enable=True", "got sharding.enable=False")
    s.sharding.offload = False; s.sharding.degree = 2
    invalid(s, "sharding.degree=2 is set but sharding.enable=False")
    s.sharding.enable = True; s.sharding.offload = True
    assert s.validate(world_size=2).sharding_degree == 2


def test_sharding_off_resolves_to_degree_one():
    r = Strategy().validate(world_size=4)
    assert (r.sharding_degree, r.sharding_stage) == (1, 0)


# -- validate: batches ---------------------------------------------------------------------

def test_global_batch_resolution():
    s = Strategy()
    s.data_parallel.degree = 2; s.gradient_accumulation_steps = 4; s.global_batch_size = 64
    r = s.validate(world_size=2)
    assert (r.micro_batch_size, r.global_batch_size) == (8, 64)
    s.global_batch_size = 60
    invalid(s, "global_batch_size=60 must be divisible by dp x num_micro_batches = 2 x 4 = 8", world_size=2)
    s.global_batch_size = None; s.micro_batch_size = 3
    assert s.validate(world_size=2).global_batch_size == 24
    s.global_batch_size = 48
    invalid(s, "global_batch_size=48", "2 x 3 x 4 = 24", world_size=2)


def test_global_batch_uses_pipeline_micro_batches():
    s = Strategy()
    s.data_parallel.degree = 2; s.pipeline_parallel.degree = 2; s.pipeline_parallel.micro_batches = 8
    s.micro_batch_size = 1; s.global_batch_size = 16
    assert s.validate(world_size=4).global_batch_size == 16
    s.global_batch_size = 8
    invalid(s, "2 x 1 x 8 = 16", world_size=4)


def test_several_problems_reported_together():
    s = Strategy()
    s.sequence_parallel.enable = True; s.sharding.offload = True; s.data_parallel.degree = 3
    msg = invalid(s, "3 problems", "sequence_parallel", "sharding.offload", "world size 4", world_size=4)
    assert msg.count("\n  - ") == 3


# -- auto_mode ---------------------------------------------------------------------------------

def test_full_mode_refuses_what_the_planner_chooses():
    s = Strategy()
    s.auto_mode = "full"
    s.global_batch_size = 8; s.amp.enable = True; s.seed = 3       # kept by the planner
    assert s.validate(world_size=8, model_info={"heads": 8, "hidden": 64}) is None
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        s.validate(world_size=-1)                              # arguments are still checked
    assert "chosen by the planner" in str(s)
    s.data_parallel.degree = 2; s.sequence_parallel.enable = True     # kept: constraints of the search
    assert s.validate(world_size=8) is None
    s.micro_batch_size = 2; s.pipeline_parallel.micro_batches = 4      # would be ignored: refused, both named
    with pytest.raises(ValueError, match=r"(?s)chooses pipeline_parallel.micro_batches.*chooses micro_batch_size"):
        s.validate(world_size=8)
    s.auto_mode = "semi"
    invalid(s, "sequence_parallel", world_size=8)


@pytest.mark.parametrize("section,name,value", [
    ("sharding", "stage", 3), ("recompute", "granularity", "selective"), ("recompute", "checkpoint_every_n_layers", 2),
    ("amp", "dtype", "float16"), ("amp", "init_loss_scaling", 1024.0), ("checkpoint", "save_interval_steps", 5),
    ("checkpoint", "dir", "ck")])
def test_dependent_field_without_its_switch_is_refused(section, name, value):
    s = Strategy()
    setattr(getattr(s, section), name, value)
    with pytest.raises(ValueError, match=rf"{section}\.{name}=.* but {section}\.enable=False"):
        s.validate(world_size=1)
    getattr(s, section).enable = True
    if section == "amp" and name == "init_loss_scaling":
        s.amp.dtype = "float16"
    s.validate(world_size=1)                                   # negative control: with the switch on it is valid


def test_loss_scaling_with_bfloat16_and_schedule_without_pipeline_are_refused():
    s = Strategy()
    s.amp.enable = True; s.amp.init_loss_scaling = 1024.0
    with pytest.raises(ValueError, match="loss scaling, which applies to float16 only"):
        s.validate(world_size=1)
    s = Strategy()
    s.pipeline_parallel.schedule = "ZB-H1"
    with pytest.raises(ValueError, match="schedule='ZB-H1' needs pipeline_parallel.degree > 1"):
        s.validate(world_size=1)


# -- serialisation -----------------------------------------------------------------------------

def rich_strategy():
    s = design_strategy()
    s.pipeline_parallel.schedule = "VPP"; s.pipeline_parallel.vpp_degree = 2
    s.pipeline_parallel.split_points = ["blocks.2", "blocks.4", "blocks.6"]
    s.sharding.degree = 2
    s.recompute.granularity = "selective"
    s.amp.dtype = "float16"; s.amp.level = "O2"; s.amp.init_loss_scaling = 1024.0; s.amp.decr_ratio = 0.25
    s.checkpoint.enable = True; s.checkpoint.dir = "/tmp/ckpt"; s.checkpoint.keep_last = 2
    s.micro_batch_size = 2; s.global_batch_size = 32; s.seed = 1234
    return s


def test_dict_round_trip():
    s = rich_strategy()
    d = s.to_dict()
    assert json.loads(json.dumps(d)) == d                   # JSON-safe
    assert d["sharding"] == {"enable": True, "stage": 3, "degree": 2, "offload": True}
    back = Strategy.from_dict(d)
    assert back == s and back.to_dict() == d
    d["pipeline_parallel"]["split_points"].append("blocks.9")
    assert s.pipeline_parallel.split_points == ["blocks.2", "blocks.4", "blocks.6"]   # to_dict copies
    assert Strategy.from_dict(Strategy().to_dict()) == Strategy()


def test_from_dict_partial_and_unknown_keys():
    s = Strategy.from_dict({"tensor_parallel": {"degree": 2}, "seed": 0})
    assert s.tensor_parallel.degree == 2 and s.seed == 0 and s.sharding == ShardingConfig()
    with pytest.raises(ValueError, match=r"Strategy has no field 'data_paralel'.*did you mean 'data_parallel'"):
        Strategy.from_dict({"data_paralel": {"degree": 2}})
    with pytest.raises(ValueError, match=r"sharding has no field 'stagee', 'foo'"):
        Strategy.from_dict({"sharding": {"stagee": 2, "foo": 1}})
    with pytest.raises(ValueError, match="sharding.stage must be 1, 2 or 3, got 7"):
        Strategy.from_dict({"sharding": {"stage": 7}})
    with pytest.raises(TypeError, match="sharding must be a ShardingConfig.*got int"):
        Strategy.from_dict({"sharding": 3})


def test_json_round_trip(tmp_path):
    s = rich_strategy()
    text = s.to_json()
    assert Strategy.from_json(text) == s
    path = tmp_path / "s.json"
    assert s.to_json(str(path)) == text
    assert Strategy.from_json(path) == s and Strategy.from_json(str(path)) == s
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Strategy.from_json(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="invalid strategy JSON"):
        Strategy.from_json("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must be an object, got list"):
        Strategy.from_json(tmp_path / "list.json")


def test_eq_and_copy():
    s = rich_strategy()
    c = s.copy()
    assert c == s and c is not s and c.sharding is not s.sharding
    c.sharding.stage = 1
    assert c != s and s.sharding.stage == 3
    c.pipeline_parallel.split_points.append("blocks.8")
    assert s.pipeline_parallel.split_points == ["blocks.2", "blocks.4", "blocks.6"]
    assert Strategy() == Strategy() and Strategy() != "Strategy()"


# -- printing ----------------------------------------------------------------------------------

def test_str_design_block():
    assert str(design_strategy()) == (
        "Strategy(auto_mode=semi)\n"
        "  dp=2 tp=4+sp pp=2 (1F1B, 8 micro-batches)\n"
        "  sharding: stage 3 over dp, offload\n"
        "  recompute: full every 2 layers\n"
        "  amp: bfloat16 O1")


def test_str_shows_only_enabled_features():
    s = Strategy()
    assert str(s) == "Strategy(auto_mode=semi)\n  dp=auto tp=1 pp=1"
    s.data_parallel.degree = 4; s.gradient_accumulation_steps = 4
    assert str(s) == "Strategy(auto_mode=semi)\n  dp=4 tp=1 pp=1 (4 accumulation steps)"
    text = str(rich_strategy())
    assert text.splitlines()[0] == "Strategy(auto_mode=semi, seed=1234)"
    for line in ["dp=2 tp=4+sp pp=2 (VPP x2, 8 micro-batches) split at blocks.2, blocks.4, blocks.6",
                 "sharding: stage 3 over groups of 2 within dp (HSDP), offload",
                 "recompute: selective every 2 layers",
                 "amp: float16 O2, dynamic loss scale 1024",
                 "batch: micro 2, global 32",
                 "checkpoint: every 100 steps to /tmp/ckpt, keep last 2"]:
        assert f"  {line}" in text.splitlines(), (line, text)
    assert "amp" not in str(Strategy()) and "sharding" not in str(Strategy())


def test_repr_shows_non_defaults_and_evaluates():
    from autoparallel import strategy as mod
    assert repr(Strategy()) == "Strategy()"
    s = design_strategy()
    r = repr(s)
    assert "sharding=ShardingConfig(enable=True, stage=3, offload=True)" in r and "checkpoint=" not in r
    assert eval(r, vars(mod)) == s
    assert eval(repr(rich_strategy()), vars(mod)) == rich_strategy()


# -- command line ------------------------------------------------------------------------------

def parse(argv):
    p = argparse.ArgumentParser()
    add_strategy_args(p)
    p.add_argument("--steps", type=int, default=10)         # an example's own flag coexists
    return p.parse_args(argv)


def test_add_strategy_args_defaults():
    a = parse([])
    assert vars(a) == {"dp": None, "tp": 1, "pp": 1, "sp": False, "sharding_stage": 0, "offload": False,
                       "recompute": "none", "amp": "none", "grad_accum": 1, "micro_batches": None,
                       "schedule": None, "vpp": None, "auto": False, "steps": 10}
    assert Strategy.from_args(a) == Strategy()


def test_from_args_full():
    a = parse("--dp 2 --tp 2 --pp 2 --sp --sharding-stage 3 --offload --recompute selective --amp float16 "
              "--micro-batches 4 --schedule ZB-H1".split())
    s = Strategy.from_args(a)
    assert (s.data_parallel.degree, s.tensor_parallel.degree, s.pipeline_parallel.degree) == (2, 2, 2)
    assert s.sequence_parallel.enable and s.sharding.enable and s.sharding.stage == 3 and s.sharding.offload
    assert s.recompute.enable and s.recompute.granularity == "selective"
    assert s.amp.enable and s.amp.dtype == "float16"
    assert s.pipeline_parallel.micro_batches == 4 and s.pipeline_parallel.schedule == "ZB-H1"
    assert s.validate(world_size=8).num_micro_batches == 4


def test_from_args_vpp_implies_schedule_and_auto():
    s = Strategy.from_args(parse("--pp 2 --vpp 2 --micro-batches 4".split()))
    assert s.pipeline_parallel.schedule == "VPP" and s.pipeline_parallel.vpp_degree == 2
    assert s.validate(world_size=2).vpp == 2
    s = Strategy.from_args(parse(["--auto", "--grad-accum", "4"]))
    assert s.auto_mode == "full" and s.gradient_accumulation_steps == 4


def test_from_args_reads_seed_and_tolerates_missing():
    s = Strategy.from_args(argparse.Namespace(tp=2, seed=7))
    assert s.tensor_parallel.degree == 2 and s.seed == 7 and s.data_parallel.degree is None


@pytest.mark.parametrize("argv", [["--dp", "0"], ["--tp", "x"], ["--sharding-stage", "4"], ["--schedule", "2F2B"],
                                  ["--recompute", "some"], ["--amp", "fp8"], ["--grad-accum", "-1"]])
def test_bad_flags_rejected_by_parser(argv, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert "error" in capsys.readouterr().err


def test_from_args_invalid_combination_caught_by_validate():
    s = Strategy.from_args(parse(["--offload"]))
    with pytest.raises(ValueError, match="sharding.offload=True needs sharding.enable=True"):
        s.validate(world_size=1)
