"""paddle's intermediate API ``ap.parallelize(model, optimizer, mesh, config)``: plan key forms, plan values and
``pp_config`` split forms that were accepted and not honoured, now honoured (trained against one process) or
refused with a typed error (docs/api_call_forms.md, "Plan forms that were accepted and not honoured")."""
import sys
from pathlib import Path

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
import pytest
from paddle.distributed import SplitPoint

import autoparallel as ap
from autoparallel import layer_state
from autoparallel.parallel.tensor_parallel import PlanError
from autoparallel.testing.models import adamw

sys.path.insert(0, str(Path(__file__).parent / "dist_scripts"))
import pp_common  # noqa: E402


class MLP(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.emb = paddle.nn.Embedding(16, 8)
        self.fc1 = paddle.nn.Linear(8, 16)
        self.fc2 = paddle.nn.Linear(16, 8)
        self.head = paddle.nn.Linear(8, 16)

    def forward(self, ids):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(self.emb(ids))))))


def _mlp():
    paddle.seed(1)
    return MLP()


def _train(m, opt, steps=2):
    rng, out = np.random.default_rng(0), []
    for _ in range(steps):
        ids, lab = (paddle.to_tensor(rng.integers(0, 16, (4, 6))) for _ in range(2))
        loss = F.cross_entropy(m(ids), lab).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        out.append(float(loss))
    return out


def _mlp_reference():
    m = _mlp()
    return _train(m, adamw(m.parameters()))


def _paddle_form(mesh, plan):
    m = _mlp()
    return ap.parallelize(m, adamw(m.parameters()), mesh, {"mp_config": {"parallelize_plan": plan}})


DPMP = [[0, 1]]


# ---- two plan keys matching one layer ---------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["paddle config", "tp_plan"])
def test_two_patterns_giving_one_layer_different_styles_are_refused(form):
    """``{"fc1": ColWise, "fc*": RowWise}``: fc1 took the later entry's style and the first was dropped without a
    word (paddle applies both in order, the first laying out the weight). Refused naming both patterns."""
    with ap.simulate(world_size=2):
        m = _mlp()
        with pytest.raises(PlanError, match=r"\['fc1', 'fc\*'\] both match layer 'fc1' with different styles"):
            if form == "tp_plan":
                s = ap.Strategy()
                s.tensor_parallel.degree = 2
                ap.parallelize(m, adamw(m.parameters()), strategy=s,
                               tp_plan={"fc1": ap.ColWiseParallel(), "fc*": ap.RowWiseParallel()})
            else:
                ap.parallelize(m, adamw(m.parameters()), dist.ProcessMesh(DPMP, ["dp", "mp"]),
                               {"mp_config": {"parallelize_plan": {"fc1": dist.ColWiseParallel(),
                                                                   "fc*": dist.RowWiseParallel()}}})


def test_two_patterns_giving_one_layer_the_same_style_train_as_one_process():
    """Overlapping keys that agree are one style (negative control of the refusal)."""
    ref = _mlp_reference()
    with ap.simulate(world_size=2):
        m, opt = _paddle_form(dist.ProcessMesh(DPMP, ["dp", "mp"]),
                              {"fc1": dist.ColWiseParallel(), "fc[1]": dist.ColWiseParallel(),
                               "fc2": dist.RowWiseParallel()})
        assert dict(m.named_parameters())["fc1.weight"].placements == [ap.Replicate(), ap.Shard(1)]
        np.testing.assert_allclose(_train(m, opt), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key", ["fc[!1]", "fc1?"])
def test_keys_read_differently_as_paddles_regex_and_as_a_pattern_are_refused(key):
    """paddle matches plan keys as regular expressions: ``fc[!1]`` is ``fc!`` or ``fc1`` and ``fc1?`` is ``fc`` or
    ``fc1``; as this project's patterns they were ``fc2`` and ``fc1x``: the style landed on another layer than
    paddle's without a word. Such keys are refused; ``fc[2]`` means fc2 in both and is taken."""
    with ap.simulate(world_size=2):
        with pytest.raises(ValueError, match=r"regular expressions.*without '\?' / '\[!'"):
            _paddle_form(dist.ProcessMesh(DPMP, ["dp", "mp"]), {key: dist.ColWiseParallel()})
        m, _ = _paddle_form(dist.ProcessMesh(DPMP, ["dp", "mp"]), {"fc[2]": dist.ColWiseParallel()})
        assert dict(m.named_parameters())["fc2.weight"].placements == [ap.Replicate(), ap.Shard(1)]


# ---- the mesh has no 'mp' dim -----------------------------------------------------------------------------------
def test_a_plan_over_a_mesh_without_an_mp_dim_is_refused():
    """A plan over a mesh with only a 'dp' dim was dropped (every layer whole) without a word; paddle's styles look
    the 'mp' dim up and fail. A size-1 'mp' dim still keeps the layers whole (paddle's mp = 1 run)."""
    with ap.simulate(world_size=2):
        with pytest.raises(ValueError, match=r"plan \(keys \['fc1'\]\).*mesh \['dp'\] \[2\] has none"):
            _paddle_form(dist.ProcessMesh([0, 1], ["dp"]), {"fc1": dist.ColWiseParallel()})
        with pytest.raises(ValueError, match="has none"):
            _paddle_form(dist.ProcessMesh([0, 1], ["dp"]), {"fc1": dist.SequenceParallelEnable()})
        m, _ = _paddle_form(dist.ProcessMesh([[0], [1]], ["dp", "mp"]), {"fc1": dist.ColWiseParallel()})
        assert dict(m.named_parameters())["fc1.weight"].placements == [ap.Replicate(), ap.Replicate()]


def test_prepare_hooks_alone_need_no_mp_dim():
    seen = []

    def note(process_mesh):
        return lambda layer, inputs: seen.append(process_mesh.dim_names)

    ref = _mlp_reference()
    with ap.simulate(world_size=2):
        m, opt = _paddle_form(dist.ProcessMesh([0, 1], ["dp"]), {"fc1": dist.PrepareLayerInput(note)})
        np.testing.assert_allclose(_train(m, opt), ref, rtol=1e-5, atol=1e-6)
    assert seen and seen[0] == ["data", "model"]


def test_a_none_plan_value_is_refused():
    """``{"nothing": None}`` was skipped, its key never checked; paddle asserts every value is a plan object."""
    with ap.simulate(world_size=2):
        for value in (None, [dist.ColWiseParallel(), None]):
            with pytest.raises(TypeError, match=r"parallelize_plan\['fc1'\] is .*a plan value is a style"):
                _paddle_form(dist.ProcessMesh(DPMP, ["dp", "mp"]), {"fc1": value, "fc2": dist.RowWiseParallel()})


def test_sequence_parallel_entries_over_a_size_one_mp_dim_train_as_one_process():
    """paddle's SequenceParallel* entries over a size-1 'mp' dim (the script run with mp = 1) split nothing; they
    turned sequence parallelism on and the strategy refused it (tensor_parallel.degree=1). Now they are kept whole
    like the plan's other styles."""
    ref = _mlp_reference()
    with ap.simulate(world_size=2):
        m, opt = _paddle_form(dist.ProcessMesh([[0], [1]], ["dp", "mp"]),
                              {"emb": dist.SequenceParallelBegin(), "fc1": dist.ColWiseParallel(),
                               "head": dist.SequenceParallelEnd()})
        assert not layer_state.build_of(m).strategy.sequence_parallel.enable
        np.testing.assert_allclose(_train(m, opt), ref, rtol=1e-5, atol=1e-6)
        with pytest.raises(PlanError, match="'nope'"):                   # the keys are still checked
            _paddle_form(dist.ProcessMesh([[0], [1]], ["dp", "mp"]), {"nope": dist.SequenceParallelBegin()})


# ---- pp_config split_spec ---------------------------------------------------------------------------------------
def _stage0_blocks(pipe):
    return sorted({".".join(n.split(".")[:2]) if n.startswith("blocks.") else n.split(".")[0]
                   for n, _ in pipe.stages[0].named_parameters()})


@pytest.mark.parametrize("spec, stage0", [
    ("blocks", ["blocks.0", "blocks.1"]),
    (["blocks"], ["blocks.0", "blocks.1"]),
    ({"blocks.0": SplitPoint.END}, ["blocks.0"]),
    ({"blocks.3": SplitPoint.BEGINNING}, ["blocks.0", "blocks.1", "blocks.2"]),
    ({"blocks.1": ap.SplitPoint.END}, ["blocks.0", "blocks.1"]),              # ap.SplitPoint: paddle's enum
])
def test_split_spec_forms_split_where_they_say_and_train_as_one_process(spec, stage0):
    """paddle's split_spec as a prefix (a string or a list of one: balanced) and as a dict of SplitPoints
    (``{"blocks.0": END}``: stage 2 starts after blocks.0) give those stages; the dict was refused before."""
    ref_losses, _ = pp_common.reference("gpt", steps=2)
    with ap.simulate(world_size=2):
        m = pp_common.build("gpt")
        pipe, opt = ap.parallelize(m, pp_common.optimizer(m.parameters()),
                                   dist.ProcessMesh([[0], [1]], ["pp", "dp"]), {"pp_config": {"split_spec": spec}})
        assert _stage0_blocks(pipe) == sorted(stage0 + ["wpe", "wte"])
        losses = []
        for x, y in pp_common.batches(2):
            losses.append(pipe.train_batch(x, y))
            opt.step()
            opt.clear_grad()
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec, exc, words", [
    ({"blocks.3": SplitPoint.END}, ValueError, ["leaves a stage empty", "last block"]),
    ({"blocks.0": SplitPoint.BEGINNING}, ValueError, ["leaves a stage empty", "first block"]),
    ({"wte": SplitPoint.END}, NotImplementedError, ["key 'wte'", "blocks.0 .. blocks.3"]),
    ({"blocks.0.mlp": SplitPoint.END}, NotImplementedError, ["key 'blocks.0.mlp'"]),
    ({"blocks.1": 1}, TypeError, ["SplitPoint.END or .BEGINNING", "got 1"]),
    ({"blocks.0": SplitPoint.END, "blocks.1": SplitPoint.END}, ValueError, ["split_points has 2 names"]),
    (["blocks", "head"], NotImplementedError, ["block list 'blocks'"]),
    (3, TypeError, ["split_spec", "got int"]),
    ({}, ValueError, ["empty dict"]),
])
def test_split_spec_refusals(spec, exc, words):
    with ap.simulate(world_size=2):
        m = pp_common.build("gpt")
        with pytest.raises(exc) as info:
            ap.parallelize(m, pp_common.optimizer(m.parameters()), dist.ProcessMesh([[0], [1]], ["pp", "dp"]),
                           {"pp_config": {"split_spec": spec}})
        assert all(w in str(info.value) for w in words), str(info.value)


def test_split_spec_and_strategy_split_points_must_agree():
    with ap.simulate(world_size=2):
        s = ap.Strategy()
        s.pipeline_parallel.degree = 2
        s.pipeline_parallel.split_points = ["blocks.3"]
        m = pp_common.build("gpt")
        with pytest.raises(ValueError, match=r"starts stages at \['blocks.1'\].*split_points at \['blocks.3'\]"):
            ap.parallelize(m, pp_common.optimizer(m.parameters()), strategy=s,
                           mesh=dist.ProcessMesh([[0], [1]], ["pp", "dp"]),
                           config={"pp_config": {"split_spec": {"blocks.0": SplitPoint.END}}})


def test_paddleformers_own_llama_dist_config_names_layers_the_model_lacks():
    """PaddleFormers 1.2's ``get_dist_config`` for its LlamaForCausalLM names ``llama.*`` layers while the model's
    are ``model.*``: paddle would shard only ``lm_head`` and keep the rest whole without a word; here the first key
    that matches no layer is a PlanError naming it and the model's own layer names."""
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM
    from paddleformers.transformers.llama.auto_dist_config import get_dist_config

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
                      fuse_rms_norm=False, tie_word_embeddings=False)
    with ap.simulate(world_size=2):
        paddle.seed(0)
        m = LlamaForCausalLM(cfg)
        with pytest.raises(PlanError, match=r"'llama.embed_tokens' matches no layer.*model.embed_tokens"):
            ap.parallelize(m, adamw(m.parameters()), dist.ProcessMesh(DPMP, ["dp", "mp"]), get_dist_config(m))


class _InOut(paddle.nn.Layer):
    """A custom matmul layer with an [in, out] weight (not an nn.Linear)."""

    def __init__(self, i, o):
        super().__init__()
        self.weight = self.create_parameter([i, o])
        self.bias = self.create_parameter([o], is_bias=True)

    def forward(self, x):
        return paddle.matmul(x, self.weight) + self.bias


def test_styles_on_custom_in_out_layers_train_as_one_process():
    """ColWise / RowWise on custom [in, out] layers take the weight as [out, in] (the documented difference from
    paddle, which shards dim 1 / dim 0 of any 2-D weight); the values are one process's."""
    def make():
        m = _mlp()
        paddle.seed(2)
        m.fc1, m.fc2 = _InOut(8, 16), _InOut(16, 8)
        return m

    m = make()
    ref = _train(m, adamw(m.parameters()))
    with ap.simulate(world_size=2):
        m = make()
        m, opt = ap.parallelize(m, adamw(m.parameters()), dist.ProcessMesh(DPMP, ["dp", "mp"]),
                                {"mp_config": {"parallelize_plan": {"fc1": dist.ColWiseParallel(),
                                                                    "fc2.weight": dist.RowWiseParallel()}}})
        params = dict(m.named_parameters())
        assert params["fc1.weight"].placements == [ap.Replicate(), ap.Shard(0)]
        assert params["fc2.weight"].placements == [ap.Replicate(), ap.Shard(1)]
        np.testing.assert_allclose(_train(m, opt), ref, rtol=1e-5, atol=1e-6)
