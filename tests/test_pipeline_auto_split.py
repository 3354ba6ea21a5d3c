"""Pipeline stages for models without embed()/head(): split at the longest list of same-type blocks, the
rest attached to the first / last stage, each stage running the model's own forward. A PaddleFormers
Llama built tiny and a nanoGPT-style model (Sequential blocks, a bare position parameter, a tied head)
train through the pipeline exactly like one process on one big batch."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import autoparallel as ap
from autoparallel.parallel.pipeline import auto_split
from autoparallel.parallel.pipeline.runtime import apply_pp
from autoparallel.parallel.pipeline.stage import describe_model


VOCAB, STEPS, RTOL, ATOL = 64, 2, 1e-4, 2e-5


def llama():
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      fuse_rms_norm=False, tie_word_embeddings=False)
    paddle.seed(0)
    return LlamaForCausalLM(cfg)


class Block(nn.Layer):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + F.gelu(self.fc(self.ln(x)))


class NanoGPT(nn.Layer):
    """Blocks in a Sequential, a bare position parameter on the root, the head tied to the embedding."""

    def __init__(self, d=32, layers=4):
        super().__init__()
        paddle.seed(0)
        self.wte = nn.Embedding(VOCAB, d)
        self.pos = self.create_parameter([16, d], default_initializer=nn.initializer.Normal(std=0.02))
        self.h = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.proj = nn.Linear(d, d)                 # a list of one type that is shorter than h

    def forward(self, ids):
        x = self.wte(ids) + self.pos[: ids.shape[1]]
        x = self.h(x)
        return paddle.matmul(self.ln_f(x), self.wte.weight, transpose_y=True)


def data(step):
    rng = np.random.default_rng(step)
    return rng.integers(0, VOCAB, (4, 8)), rng.integers(0, VOCAB, (4, 8))


def reference(build):
    model = build()
    opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        loss = F.cross_entropy(auto_split.model_output(model(paddle.to_tensor(x))), paddle.to_tensor(y))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: p.numpy() for n, p in model.named_parameters()}


def pipeline(build, schedule, vpp=1):
    model = build()
    opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
    s = ap.Strategy()
    s.pipeline_parallel.degree = 2                     # micro-batches default to the degree
    s.pipeline_parallel.schedule = schedule
    s.pipeline_parallel.vpp_degree = vpp
    pipe = apply_pp(model, s)
    opt = pipe.wrap_optimizer(opt)
    losses = []
    for step in range(STEPS):
        losses.append(pipe.train_batch(*data(step)))
        opt.step()
        opt.clear_grad()
    return losses, pipe


_REFS = {}


def check(build, schedule, vpp=1):
    if build not in _REFS:
        _REFS[build] = reference(build)
    ref_losses, ref_params = _REFS[build]
    losses, pipe = pipeline(build, schedule, vpp)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=1e-6)
    params = dict(pipe.named_parameters())
    assert set(params) == set(ref_params)
    for n, p in params.items():
        np.testing.assert_allclose(p.numpy(), ref_params[n], rtol=RTOL, atol=ATOL, err_msg=n)
    return pipe


def test_pieces_found_by_a_dry_run():
    pieces = describe_model(llama())
    assert pieces.generic and pieces.layers_name == "model.layers"
    assert pieces.embed_layers == ("model.embed_tokens.weight",)
    assert pieces.head_layers == ("model.norm.weight", "lm_head.weight")
    nano = describe_model(NanoGPT())
    assert nano.layers_name == "h" and nano.embed_layers == ("pos", "wte.weight")
    assert nano.head_layers == ("wte.weight", "ln_f.weight", "ln_f.bias", "proj.weight", "proj.bias")  # proj: unused


@pytest.mark.parametrize("schedule,vpp", [("1F1B", 1), ("ZB-H1", 1), ("VPP", 2)])
def test_paddleformers_llama_pipeline_equals_one_process(schedule, vpp):
    pipe = check(llama, schedule, vpp)
    first, last = pipe.stages[0], pipe.stages[-1]
    assert "model.embed_tokens.weight" in dict(first.named_parameters())
    assert {"model.norm.weight", "lm_head.weight"} <= set(dict(last.named_parameters()))
    assert "lm_head.weight" not in dict(first.named_parameters())


@pytest.mark.parametrize("schedule", ["FThenB", "ZB-H1"])
def test_nanogpt_with_tied_head_and_bare_parameter(schedule):
    check(NanoGPT, schedule)


def test_simulated_world_runs_the_auto_split_too():
    with ap.simulate(world_size=2):
        check(NanoGPT, "1F1B")


def test_negative_control_stage_ignoring_the_received_activation(monkeypatch):
    """A later stage that kept the hidden state its own prefix computed must fail the comparison."""
    monkeypatch.setattr(auto_split, "_replace_hidden", lambda args, kwargs, name, x: (args, kwargs))
    with pytest.raises(AssertionError):
        check(NanoGPT, "1F1B")


def test_every_stage_needs_the_model_inputs():
    s = ap.Strategy()
    s.pipeline_parallel.degree = 2
    pipe = apply_pp(NanoGPT(), s)
    with pytest.raises(ValueError, match="needs the model inputs; got inputs=None"):
        pipe.stages[1](paddle.zeros([1, 2, 32]))


def test_model_with_no_repeated_blocks_is_refused():
    class Flat(nn.Layer):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    with pytest.raises(TypeError, match="Flat cannot be split.*found neither"):
        describe_model(Flat())


def test_the_dry_run_draws_no_random_numbers():
    class Dropped(NanoGPT):
        def forward(self, ids):
            return super().forward(ids) + F.dropout(paddle.ones([1]), 0.5)

    model = Dropped()
    paddle.seed(5)
    want = paddle.rand([4]).numpy()
    paddle.seed(5)
    describe_model(model)
    np.testing.assert_array_equal(paddle.rand([4]).numpy(), want)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_the_projects_models_split_at_their_blocks_too(kind):
    """The example GPT / LLaMA have embed()/head(); split at their blocks instead, the stages chained give the
    model's logits and the same gradients (LLaMA's blocks take rotary tables as extra arguments)."""
    import pp_common
    from autoparallel.parallel.pipeline.stage import build_stages, describe_generic

    model = pp_common.build(kind, tie=True)
    pieces = describe_generic(model)
    assert pieces.layers_name == ("blocks" if kind == "gpt" else "layers")
    ids = paddle.to_tensor(data(0)[0])
    want = model(ids)
    want.sum().backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    model.clear_gradients()
    first, second = build_stages(pieces, [(0, 2), (2, 4)])
    h = first(ids)
    x = h.detach()
    x.stop_gradient = False
    out = second(x, inputs=ids)
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    h.backward(x.grad)
    for n, p in model.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), grads[n], rtol=1e-4, atol=1e-6, err_msg=n)
