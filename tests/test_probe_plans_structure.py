"""Default tensor-parallel plans found by structure (autoparallel/parallel/tp_structure.py): the vision towers'
blocks and an encoder-decoder's ``fc1``/``fc2`` and cross attention get Megatron styles, as readable strings
checked by hand; layers whose names match but whose structure does not get none."""
import paddle
import pytest
from test_probe_speech_whisper import build as whisper_build

from autoparallel.parallel.tp_dataflow import call_inputs
from autoparallel.parallel.tp_plans import default_plan, raw_plan
from autoparallel.parallel.tp_structure import plan_strings, structural_plan
from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers is not installed")

COL_B = "ColWiseParallel weight S(1) bias S(0)"
COL = "ColWiseParallel weight S(1)"
ROW = "RowWiseParallel weight S(0)"


def _lines(model, prefix, plan=None):
    plan = default_plan(model, 2) if plan is None else plan
    return [line for line in plan_strings(model, plan) if line.startswith(prefix)]


def test_whisper_decoder_block_plan():
    """Self attention by the name table; cross attention (k / v read the encoder's memory) and fc1 / fc2 by
    structure: q, k, v split by heads (columns), out_proj and fc2 row-parallel. Whisper's key has no bias."""
    model = whisper_build()
    p = "decoder.0."
    assert _lines(model, p) == [
        f"{p}self_attn.q_proj: {COL_B}", f"{p}self_attn.v_proj: {COL_B}", f"{p}self_attn.out_proj: {ROW}",
        f"{p}self_attn.k_proj: {COL}",
        f"{p}encoder_attn.q_proj: {COL_B}", f"{p}encoder_attn.v_proj: {COL_B}", f"{p}encoder_attn.out_proj: {ROW}",
        f"{p}encoder_attn.k_proj: {COL}",
        f"{p}fc1: {COL_B}", f"{p}fc2: {ROW}"]
    assert not any(n.startswith(p + "encoder_attn") or n.startswith(p + "fc") for n in raw_plan(model))
    flow = call_inputs(model.decoder[0].encoder_attn)              # read from the forward, not assumed
    assert flow["out_proj"] == {"q_proj", "k_proj", "v_proj"} and flow["q_proj"] == set()
    assert "fc1" in call_inputs(model.decoder[0])["fc2"]


def test_paddleocr_vl_vision_layer_and_projector_plan():
    pf.install_vl_stubs()
    model = pf.vl_build("paddleocr_vl")
    p = "visual.vision_model.encoder.layers.1."
    assert _lines(model, p) == [f"{p}self_attn.q_proj: {COL_B}", f"{p}self_attn.k_proj: {COL_B}",
                                f"{p}self_attn.v_proj: {COL_B}", f"{p}self_attn.out_proj: {ROW}",
                                f"{p}mlp.fc1: {COL_B}", f"{p}mlp.fc2: {ROW}"]
    assert _lines(model, "mlp_AR") == [f"mlp_AR.linear_1: {COL_B}", f"mlp_AR.linear_2: {ROW}"]
    assert _lines(model, "visual.vision_model.embeddings") == []
    assert call_inputs(model.visual.vision_model.encoder.layers[1].mlp)["fc2"] == {"fc1", "act_fn"}          # conv patches and position tables


def test_qwen3_vl_vision_block_by_structure_alone():
    """The fused ``qkv [d, 3d]`` + ``proj [d, d]`` attention and the ``linear_fc1`` / ``linear_fc2`` MLP, found
    without any name table (the structural plan on its own)."""
    pf.install_vl_stubs()
    model = pf.vl_build("qwen3_vl")
    p = "model.visual.blocks.0."
    assert _lines(model, p, structural_plan(model, 2)) == [
        f"{p}attn.qkv: {COL_B}", f"{p}attn.proj: {ROW}", f"{p}mlp.linear_fc1: {COL_B}", f"{p}mlp.linear_fc2: {ROW}"]
    assert _lines(model, "model.visual.patch_embed") == []


# ---- negative controls: names that match, structures that do not ------------------------------------------
class GatedDeltaLike(paddle.nn.Layer):
    """Qwen3-Next's linear attention in miniature: in / out projections with a conv and decay vectors between."""

    def __init__(self, d=8):
        super().__init__()
        self.in_proj = paddle.nn.Linear(d, 2 * d)
        self.conv1d = paddle.nn.Conv1D(2 * d, 2 * d, 3, padding=1, groups=2 * d)
        self.A_log = self.create_parameter([2 * d])
        self.out_proj = paddle.nn.Linear(2 * d, d)


class ParallelBranches(paddle.nn.Layer):
    """``fc1`` and ``fc2`` both read the input (widths [d, f] and [d, f]): no pair."""

    def __init__(self, d=8):
        super().__init__()
        self.fc1, self.fc2 = paddle.nn.Linear(d, 4 * d), paddle.nn.Linear(d, 4 * d)


class SeparateInputs(paddle.nn.Layer):
    """``fc1 [d, f]`` and ``fc2 [f, d]`` chain by shape, but the forward feeds them separate inputs."""

    def __init__(self, d=8):
        super().__init__()
        self.fc1, self.fc2 = paddle.nn.Linear(d, 4 * d), paddle.nn.Linear(4 * d, d)

    def forward(self, x, y):
        return self.fc1(x), self.fc2(y)


class Chained(SeparateInputs):
    def forward(self, x, y):
        h = self.fc1(x)
        h = paddle.nn.functional.gelu(h) * 2
        return self.fc2(h)


def test_the_data_flow_decides_between_chaining_shapes():
    assert structural_plan(SeparateInputs(), 2) == {}
    assert plan_strings(Chained(), structural_plan(Chained(), 2)) == [f"fc1: {COL_B}", f"fc2: {ROW}"]


class SquareMerger(paddle.nn.Layer):
    """GLM-4V's merger shape: ``proj`` then gate / up / down, all [d, d]: not q / k / v / out."""

    def __init__(self, d=8):
        super().__init__()
        self.proj, self.gate_proj, self.up_proj, self.down_proj = (paddle.nn.Linear(d, d) for _ in range(4))


class OddHeads(paddle.nn.Layer):
    def __init__(self, d=12):
        super().__init__()
        self.num_heads = 3
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (paddle.nn.Linear(d, d) for _ in range(4))


@pytest.mark.parametrize("cls", [GatedDeltaLike, ParallelBranches, SquareMerger, OddHeads])
def test_matching_names_without_the_structure_get_no_style(cls):
    assert structural_plan(cls(), 2) == {}


def test_a_layer_list_of_a_pair_is_no_block():
    lst = paddle.nn.LayerList([paddle.nn.Linear(8, 32), paddle.nn.Linear(32, 8)])
    assert structural_plan(lst, 2) == {}
    seq = paddle.nn.Sequential(paddle.nn.Linear(8, 32), paddle.nn.GELU(), paddle.nn.Linear(32, 8))
    assert plan_strings(seq, structural_plan(seq, 2)) == [f"0: {COL_B}", f"2: {ROW}"]


def test_odd_heads_take_an_even_degree_only_when_it_divides():
    assert sorted(structural_plan(OddHeads(), 3)) == ["k_proj", "out_proj", "q_proj", "v_proj"]


def test_qwen3_next_linear_attention_stays_replicated():
    model = pf.build("qwen3_next")
    plan = default_plan(model, 2)
    linear_attn = [n for n, _ in model.named_sublayers() if ".linear_attn." in n]
    assert linear_attn and not any(n in plan for n in linear_attn)
    assert any(n.endswith("linear_attn.out_proj") for n in linear_attn)
