"""Every code snippet of the Paddle auto-parallel article, in its literal form (only ``import autoparallel as
auto_parallel`` / ``as dist`` in place of ``paddle.distributed``; the elided model, data and trainer filled
in), checked for the effect the article claims. Simulated world here; the parts that need real processes
(``init_parallel_env``, per-rank timings, a cross-process found-inf) run in one 2-rank launch at the end.

The article's model (DemoNet / TransformerBlock) is the example GPT (blocks of class ``Block``), its data
the test batches; "equal to one process" compares losses and every rank's copy of every parameter with a
single-process run of the same steps."""
import os

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as auto_parallel
import autoparallel as dist
from autoparallel import auto_checkpoint
from autoparallel.checkpoint.state import wrapper_chain
from autoparallel.testing.check import expected_local
from autoparallel.testing.gpu_scaler import gpu_place
from autoparallel.testing.models import batch, build
from dist_scripts import shared_launch
from examples.models.gpt import Block as TransformerBlock

ARTICLE = shared_launch.job(__name__, "article", os.path.join(os.path.dirname(__file__), "dist_scripts",
                                                               "article_worker.py"), 2, timeout=500)

STEPS = 3


def DemoNet():
    return build("gpt")


def make_optimizer(model):
    return paddle.optimizer.AdamW(1e-2, parameters=model.parameters(), epsilon=1e-4)


def loss_of(model, i):
    ids, lab = batch(i)
    return F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(lab)).mean()


def train(model, optimizer, steps=range(STEPS)):
    losses = []
    for i in steps:
        loss = loss_of(model, i)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    return losses


@pytest.fixture(scope="module")
def one_process():
    """Losses and final parameters of STEPS single-process steps, and {k: parameters after step k} for the
    tests that run fewer steps (one run for all of them)."""
    model = DemoNet()
    optimizer = make_optimizer(model)
    losses, after = [], {}
    for i in range(STEPS):
        losses += train(model, optimizer, range(i, i + 1))
        after[i + 1] = {n: p.numpy() for n, p in model.named_parameters()}
    return losses, after[STEPS], after


def assert_equal_to_one_process(model, losses, ref, rtol=1e-4, atol=2e-5):
    np.testing.assert_allclose(losses, ref[0][:len(losses)], rtol=1e-5, atol=1e-6)
    checked = 0
    for name, p in model.named_parameters():
        for r, t in p.locals.items():
            want = expected_local(ref[1][name], p.spec, p.mesh.coords_of(r))
            np.testing.assert_allclose(t.numpy(), want, rtol=rtol, atol=atol, err_msg=f"{name} on rank {r}")
            checked += 1
    assert checked


def zero_of(optimizer):
    from autoparallel.parallel.sharding import ZeroOptimizer

    return next((o for o in wrapper_chain(optimizer) if isinstance(o, ZeroOptimizer)), None)


def counting(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def wrapped(*a, **k):
        calls.append(name)
        return original(*a, **k)

    monkeypatch.setattr(module, name, wrapped)
    return calls


# ---- 1. a 2x4 mesh for data and model parallel ----------------------------------------------------------
def test_01_mesh():
    with auto_parallel.simulate(world_size=8):
        mesh = dist.ProcessMesh(mesh=[[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["data", "model"])
        assert mesh.shape == [2, 4] and mesh.dim_names == ["data", "model"]
        x = paddle.arange(8 * 12, dtype="float32").reshape([8, 12])
        d = dist.shard_tensor(x, mesh, [dist.Shard(0), dist.Shard(1)])
        assert d.locals[6].shape == [4, 3]                          # rank 6: data row 1, model column 2
        np.testing.assert_array_equal(d.locals[6].numpy(), x.numpy()[4:8, 6:9])


# ---- 2. eager semi-auto: DataParallel + Optimizer ------------------------------------------------------
def test_02_semi_auto_data_parallel_equals_one_process(one_process):
    with auto_parallel.simulate(world_size=2):
        model = DemoNet()
        optimizer = make_optimizer(model)
        strategy = auto_parallel.Strategy()
        strategy.auto_mode = "semi"
        dp_model = auto_parallel.DataParallel(model, strategy=strategy)
        optimizer = auto_parallel.Optimizer(optimizer)
        losses = train(dp_model, optimizer)
        assert_equal_to_one_process(dp_model, losses, one_process)


# ---- 3. the same model code in static mode ---------------------------------------------------------------
def test_03_to_static_train_step_equals_eager():
    with auto_parallel.simulate(world_size=2):
        model = auto_parallel.DataParallel(DemoNet(), strategy=auto_parallel.Strategy())
        ids, lab = batch(0)
        labels = paddle.to_tensor(lab)

        @paddle.jit.to_static
        def train_step(data):
            with auto_parallel.parallel_guard(["data"]):
                logits = model(data)
                # the article writes cross_entropy(logits); paddle's needs the labels
                loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, labels))
            return loss

        static = float(train_step(paddle.to_tensor(ids)))
        eager = float(paddle.mean(F.cross_entropy(model(paddle.to_tensor(ids)), labels)))
        assert static == pytest.approx(eager, rel=1e-6)


# ---- 4. 4-D hybrid: dp 2, tp 4, pp 4, sequence parallel ---------------------------------------------------
def test_04_hybrid_strategy_resolves_and_sp_lowers_activation_memory():
    from autoparallel.planner.api import plan

    strategy = auto_parallel.Strategy()
    strategy.data_parallel.degree = 2
    strategy.tensor_parallel.degree = 4
    strategy.pipeline_parallel.degree = 4
    strategy.sequence_parallel.enable = True
    d = strategy.validate(world_size=32, model_info={"heads": 32, "hidden": 4096, "layers": 32})
    assert (d.dp, d.tp, d.pp) == (2, 4, 4) and strategy.num_micro_batches == 4      # default: pp micro-batches
    fixed = "dp=2,tp=4,pp=4,micro_batch=1"
    with_sp = plan("llama2-7b", "4x8:A100-80GB", 64, 4096, fixed=fixed + ",sp=1").best
    without = plan("llama2-7b", "4x8:A100-80GB", 64, 4096, fixed=fixed + ",sp=0").best
    act = with_sp.memory_gb["activations"], without.memory_gb["activations"]
    assert act[0] < 0.85 * act[1]                     # SP: the norm/dropout activations split over tp as well


def test_04_hybrid_tp_pp_sp_runs_equal_to_one_process(tmp_path, one_process):
    """The same four fields at a size the simulated world runs quickly: dp 2, tp 2, pp 2 with SP."""
    from autoparallel.checkpoint.state import training_state

    ref_losses, ref_params = one_process[0][:2], one_process[2][2]
    with auto_parallel.simulate(world_size=8):
        strategy = auto_parallel.Strategy()
        strategy.data_parallel.degree = 2
        strategy.tensor_parallel.degree = 2
        strategy.pipeline_parallel.degree = 2
        strategy.sequence_parallel.enable = True
        model = DemoNet()
        model, opt = auto_parallel.parallelize(model, make_optimizer(model), strategy=strategy)
        losses = []
        for i in range(2):
            ids, lab = batch(i)
            losses.append(float(model.train_batch(paddle.to_tensor(ids), paddle.to_tensor(lab))))
            opt.step()
            opt.clear_grad()
        auto_parallel.save_state_dict(training_state(model), str(tmp_path / "s"))      # the parameters
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = auto_parallel.load_merged_state_dict(str(tmp_path / "s"))["model"]
    for name, p in ref_params.items():
        np.testing.assert_allclose(got[name], p, rtol=1e-4, atol=2e-5, err_msg=name)


# ---- 5. gradient sync chosen by loss.backward(): all-reduce, or reduce-scatter + all-gather -------------
def test_05_backward_reduces_replicated_and_reduce_scatters_sharded(monkeypatch, one_process):
    from autoparallel.comm import collectives as C
    from autoparallel.parallel import grads

    with auto_parallel.simulate(world_size=2):
        model = DemoNet()
        model, opt = auto_parallel.parallelize(model, make_optimizer(model))
        bucket = counting(monkeypatch, grads, "reduce_bucket")
        loss = loss_of(model, 0)
        loss.backward()
        opt.step()
        assert bucket                                            # replicated: all-reduced gradient buckets
        assert_equal_to_one_process(model, [float(loss)], (one_process[0], one_process[2][1]))
    with auto_parallel.simulate(world_size=2):
        strategy = auto_parallel.Strategy()
        strategy.sharding.enable, strategy.sharding.stage = True, 2
        model = DemoNet()
        model, opt = auto_parallel.parallelize(model, make_optimizer(model), strategy=strategy)
        rs = counting(monkeypatch, C, "_reduce_scatter_raw")
        ag = counting(monkeypatch, C, "_gather_raw")
        loss = loss_of(model, 0)
        loss.backward()
        opt.step()
        assert rs and ag                                         # sharded: reduce-scatter, then all-gather
        assert_equal_to_one_process(model, [float(loss)], (one_process[0], one_process[2][1]))


# ---- 6. fine-grained recompute by a per-layer predicate -------------------------------------------------------
def test_06_recompute_layers_predicate_recomputes_blocks(one_process):
    model = DemoNet()
    model = auto_parallel.recompute_layers(
        model, segment_func=lambda x: isinstance(x, TransformerBlock), checkpoint_every_n_layers=2)
    runs = []
    for block in model.blocks:
        block.mlp.register_forward_post_hook(lambda *_: runs.append(1))
    losses = train(model, make_optimizer(model), range(1))
    assert len(runs) == 2 * len(model.blocks)                # each block's forward ran again in backward
    np.testing.assert_allclose(losses, one_process[0][:1], rtol=1e-6)
    ref = one_process[2][1]
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.numpy(), ref[name], rtol=1e-5, atol=1e-6, err_msg=name)


# ---- 7 / 14. ZeRO stage 3 with offload (and recompute) through the seed-style entry points -------------
@pytest.mark.parametrize("recompute", [False, True])
def test_07_14_zero3_offload_shards_states_and_equals_one_process(one_process, recompute):
    with auto_parallel.simulate(world_size=2):
        strategy = auto_parallel.Strategy()
        if recompute:
            strategy.recompute.enable = True
        strategy.sharding.enable = True
        strategy.sharding.stage = 3
        strategy.sharding.offload = True
        model = DemoNet()
        optimizer = make_optimizer(model)
        model = auto_parallel.DataParallel(model, strategy=strategy)
        optimizer = auto_parallel.Optimizer(optimizer)
        runs = []
        model.blocks[0].mlp.register_forward_post_hook(lambda *_: runs.append(1))
        losses = train(model, optimizer)
        zero = zero_of(optimizer)
        assert zero is not None and zero.stage == 3 and zero.offload
        assert all(p.is_cpu_place() for p in zero.state_places())
        full = sum(int(np.prod(p.global_shape)) for p in model.parameters())
        for r in (0, 1):                                          # each rank holds half of every state
            held = sum(int(m.numel()) for m in zero.master[r].values())
            assert held <= full // 2 + len(list(model.parameters()))
        assert len(runs) == STEPS * (2 if recompute else 1)
        zero.gather(zero.params)
        assert_equal_to_one_process(model, losses, one_process)


def test_14_planner_puts_7b_under_20gb_with_zero3_offload_recompute():
    from autoparallel.planner.api import plan

    def gb(fixed):
        return plan("llama2-7b", "1x8:A100-80GB", 8, 4096, fixed=fixed + ",micro_batch=1").best.memory_per_device_gb

    assert gb("dp=8,tp=1,pp=1,sharding=0,recompute=none") > 80              # plain data parallel: no fit
    assert gb("dp=8,tp=1,pp=1,sharding=3,offload=1,recompute=full") < 20
    assert gb("dp=2,tp=4,pp=1,sharding=3,offload=1,recompute=full") < 20    # + TP, as the article combines


# ---- 8. a LLaMA (PaddleFormers) with a custom shard hook and shard_optimizer(opt, mesh) ------------------------
def llama_auto_shard_fn(layer_name, layer, process_mesh):
    if any(k in layer_name for k in ["q_proj", "k_proj", "v_proj"]):
        weight_spec = [dist.Shard(1)]      # split by heads
    elif "o_proj" in layer_name:
        weight_spec = [dist.Shard(0)]      # output projection split by hidden
    else:
        weight_spec = [dist.Replicate()]
    if hasattr(layer, 'weight'):
        layer.weight = dist.shard_tensor(layer.weight, process_mesh, weight_spec)
    return layer


class CausalLMOutput:
    def __init__(self, loss):
        self.loss = loss


class ExampleLlamaForCausalLM(paddle.nn.Layer):
    """The project's example Llama with a PaddleNLP-style ``model(**batch).loss`` interface."""

    def __init__(self):
        super().__init__()
        self.model = build("llama")

    def forward(self, input_ids, labels, return_dict=True):
        return CausalLMOutput(F.cross_entropy(self.model(input_ids), labels).mean())


def paddleformers_llama():
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
                      fuse_rms_norm=False, tie_word_embeddings=False)
    paddle.seed(0)
    return LlamaForCausalLM(cfg)


def llama_batches(n=2):
    out = []
    for i in range(n):
        ids, lab = batch(i)
        out.append({"input_ids": paddle.to_tensor(ids), "labels": paddle.to_tensor(lab),
                    "return_dict": True})                  # PaddleFormers' forward defaults to a tuple
    return out


LLAMAS = {"example": ExampleLlamaForCausalLM, "paddleformers": paddleformers_llama}


@pytest.mark.parametrize("kind", ["example", "paddleformers"])
def test_08_llama_custom_shard_fn_equals_one_process(kind):
    from paddle.optimizer import AdamW

    LLaMAForCausalLM = LLAMAS[kind]
    ref = LLaMAForCausalLM()
    ref_opt = AdamW(learning_rate=3e-5, parameters=ref.parameters())
    ref_losses = []
    for b in llama_batches():
        loss = ref(**b).loss
        loss.backward()
        ref_opt.step()
        ref_opt.clear_grad()
        ref_losses.append(float(loss))
    with auto_parallel.simulate(world_size=8):
        mesh = dist.ProcessMesh(mesh=[[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["data", "model"])

        def apply_sharding(model, mesh, shard_fn):
            return dist.shard_layer(model, mesh, shard_fn)

        dataloader = llama_batches()
        model = LLaMAForCausalLM()                  # from_pretrained("llama-7b"): a tiny one built here
        model = apply_sharding(model, mesh, llama_auto_shard_fn)
        optimizer = AdamW(learning_rate=3e-5, parameters=model.parameters())   # the article elides parameters
        optimizer = auto_parallel.shard_optimizer(optimizer, mesh)
        losses = []
        for batch_ in dataloader:
            loss = model(**batch_).loss
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
            losses.append(float(loss))
        attn = model.model.layers[0].self_attn
        q = attn.q_proj.weight
        assert [str(p) for p in q.placements] == ["S(1)", "R"] and q.locals[0].shape == [32, 16]
        assert [str(p) for p in attn.o_proj.weight.placements] == ["S(0)", "R"]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        params = dict(model.named_parameters())
        for name, p in ref.named_parameters():
            got = params[name]
            for r, t in got.locals.items():
                want = expected_local(p.numpy(), got.spec, got.mesh.coords_of(r))
                np.testing.assert_allclose(t.numpy(), want, rtol=1e-4, atol=2e-6, err_msg=f"{name} rank {r}")


# ---- 9. a custom op's dict-returning spmd rule ---------------------------------------------------------------------
def test_09_custom_rule_is_consulted(monkeypatch):
    from spmd_rules import registry

    monkeypatch.setitem(registry._RULES, "flash_attention", registry._RULES["flash_attention"])   # restored after
    register_spmd_rule = auto_parallel.register_spmd_rule

    @register_spmd_rule("flash_attention")
    def spmd_flash_attn(inputs, outputs, attrs, mesh):
        q, k, v = inputs
        out = outputs[0]
        q_out_placements = [dist.Shard(1)] if q.placements[0].is_shard(1) else [dist.Replicate()]
        return {"inputs": {"q": q_out_placements, "k": q_out_placements, "v": q_out_placements},
                "outputs": {"out": q_out_placements}}

    # the user's kernel, called like paddle's (query, key, value, ...) -> (out, softmax); its tensors are
    # [batch, heads, seq, head_dim], so the rule's Shard(1) splits heads (each rank attends over whole
    # sequences of its heads: exact)
    @auto_parallel.custom_op("flash_attention")
    def flash_attention(query, key, value, dropout=0.0, causal=False, return_softmax=False):
        w = F.softmax(paddle.matmul(query, key, transpose_y=True) / 2.0, axis=-1)
        return paddle.matmul(w, value), None

    rng = np.random.default_rng(0)
    q, k, v = (paddle.to_tensor(rng.standard_normal((2, 4, 8, 4)).astype("float32")) for _ in range(3))
    want = flash_attention(q, k, v)[0].numpy()
    with auto_parallel.simulate(world_size=2):
        mesh = dist.ProcessMesh([0, 1], dim_names=["model"])
        heads = [dist.shard_tensor(t, mesh, [dist.Shard(1)]) for t in (q, k, v)]
        out, _ = flash_attention(*heads)
        assert [str(p) for p in out.placements] == ["S(1)"]             # the rule's output layout
        assert out.locals[1].shape == [2, 2, 8, 4]                       # heads 2..3, computed locally
        np.testing.assert_allclose(out.full().numpy(), want, rtol=1e-5, atol=1e-6)
        rows = [dist.shard_tensor(t, mesh, [dist.Shard(0)]) for t in (q, k, v)]
        out, _ = flash_attention(*rows)
        assert [str(p) for p in out.placements] == ["R"]                 # the rule replicates other layouts
        np.testing.assert_allclose(out.full().numpy(), want, rtol=1e-5, atol=1e-6)


# ---- 10. runtime monitoring and re-tuning ------------------------------------------------------------------------
def test_10_monitor_loop_as_written():
    from autoparallel import reconfigure_distributed_model

    with auto_parallel.simulate(world_size=2):
        strategy = auto_parallel.Strategy()
        strategy.sharding.enable = True              # (simulated optimizer states are checkpointable under ZeRO)
        model = DemoNet()
        optimizer = make_optimizer(model)
        model = auto_parallel.DataParallel(model, strategy=strategy)
        optimizer = auto_parallel.Optimizer(optimizer)

        class LossModel:                              # the article's model(batch) returns the loss
            def __call__(self, i):
                return loss_of(model, i)

        dataloader = range(32)
        seen = {}
        monitor = dist.PerformanceMonitor(warmup_steps=10, measure_steps=20)
        for step, batch_ in enumerate(dataloader):
            with monitor.record("forward"):
                loss = LossModel()(batch_)
            with monitor.record("backward"):
                loss.backward()
            with monitor.record("step"):
                optimizer.step()
                optimizer.clear_grad()
            if step == 30:
                seen["done"], seen["imbalanced"] = monitor.done, monitor.is_imbalanced()
            if step == 30 and monitor.is_imbalanced():
                new_strategy = monitor.suggest_optimal_strategy()
                reconfigure_distributed_model(model, new_strategy)
        # one process runs every simulated rank on one timeline: no rank imbalance to find here (the
        # 2-rank launch below slows one rank down and takes the branch)
        assert seen == {"done": True, "imbalanced": False}
        assert set(monitor.gather()) == {0, 1} and monitor.timings().keys() == {"forward", "backward", "step"}
        new_strategy = monitor.suggest_optimal_strategy()
        assert isinstance(new_strategy, auto_parallel.Strategy) and new_strategy.suggestion.plan is not None
        before = {n: p.full().numpy() for n, p in model.named_parameters()}
        reconfigure_distributed_model(model, new_strategy)
        z = zero_of(optimizer)
        if z is not None:
            z.gather(z.params)
        for n, p in model.named_parameters():
            np.testing.assert_allclose(p.full().numpy(), before[n], rtol=1e-6, err_msg=n)


# ---- 11. automatic checkpoints and recovery ------------------------------------------------------------------------
def test_11_checkpoint_and_recovery_as_written(tmp_path, one_process):
    from autoparallel import fallback_to_cpu_offload, resume_from_last_checkpoint

    with auto_parallel.simulate(world_size=2):
        strategy = auto_parallel.Strategy()
        strategy.sharding.enable = True
        strategy.checkpoint.dir = str(tmp_path)
        model = DemoNet()
        optimizer = make_optimizer(model)

        strategy.checkpoint.enable = True
        strategy.checkpoint.save_interval_steps = 2       # the article's 1000, scaled to a 3-step test
        model = auto_parallel.DataParallel(model, strategy=strategy)
        optimizer = auto_parallel.Optimizer(optimizer)

        class Trainer:
            """Trains STEPS steps; runs out of memory once, in step 2 (after the save at step 2)."""
            def __init__(self):
                self.losses, self.failed = {}, False

            def train(self):
                start = auto_checkpoint.current_run().step
                for i in range(start, STEPS):
                    loss = loss_of(model, i)
                    loss.backward()
                    if i == 2 and not self.failed:
                        self.failed = True
                        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
                    optimizer.step()
                    optimizer.clear_grad()
                    self.losses[i] = float(loss)

        trainer = Trainer()
        try:
            trainer.train()
        except RuntimeError as e:
            if "CUDA out of memory" in str(e):
                fallback_to_cpu_offload(model)
                resume_from_last_checkpoint()
        assert trainer.failed and sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["latest", "step-00000002"]
        assert zero_of(optimizer).offload and auto_checkpoint.current_run().step == 2
        optimizer.clear_grad()
        trainer.train()
        assert_equal_to_one_process(model, [trainer.losses[i] for i in range(STEPS)], one_process)


# ---- 12. overlap gradient communication with backward ---------------------------------------------------------------
def test_12_backward_use_async_allreduce(one_process):
    with auto_parallel.simulate(world_size=2):
        model = DemoNet()
        optimizer = make_optimizer(model)
        model = auto_parallel.DataParallel(model, strategy=auto_parallel.Strategy())
        optimizer = auto_parallel.Optimizer(optimizer)
        losses = []
        for i in range(STEPS):
            loss = loss_of(model, i)
            loss.backward(use_async_allreduce=True)
            optimizer.step()
            optimizer.clear_grad()
            losses.append(float(loss))
        assert_equal_to_one_process(model, losses, one_process)


# ---- 13. gradient accumulation ---------------------------------------------------------------------------------------
def test_13_gradient_accumulation_as_written(monkeypatch):
    """The literal loop equals one process; its gradient reductions fuse into one per optimizer step once
    the reducer has seen a full window (it learns the 8 backward passes per step), and from the first step
    on when the strategy says ``gradient_accumulation_steps = 8``."""
    from autoparallel.parallel import grads

    accum_steps = 8
    batches = 3 * accum_steps

    class Out:
        def __init__(self, loss):
            self.loss = loss

    def run(model):
        def forward(i):
            return Out(loss_of(model, i))
        return forward

    ref = DemoNet()
    ref_opt = make_optimizer(ref)
    for i, batch_ in enumerate(range(batches)):
        loss = run(ref)(batch_).loss / accum_steps
        loss.backward()
        if (i + 1) % accum_steps == 0:
            ref_opt.step()
            ref_opt.clear_grad()
    counts = {}
    for strategy_steps in (1, accum_steps):
        with auto_parallel.simulate(world_size=2):
            strategy = auto_parallel.Strategy()
            strategy.gradient_accumulation_steps = strategy_steps
            model = DemoNet()
            optimizer = make_optimizer(model)
            model = auto_parallel.DataParallel(model, strategy=strategy)
            optimizer = auto_parallel.Optimizer(optimizer)
            reductions = counting(monkeypatch, grads, "reduce_bucket")
            dataloader = range(batches)
            model_fn = run(model)
            for i, batch_ in enumerate(dataloader):
                # with strategy.gradient_accumulation_steps the framework divides: the loop leaves the loss
                loss = model_fn(batch_).loss / (accum_steps if strategy_steps == 1 else 1)
                loss.backward()
                counts[strategy_steps, i] = len(reductions)
                if (i + 1) % accum_steps == 0:
                    optimizer.step()
                    optimizer.clear_grad()
                    counts[strategy_steps, "after step", i // accum_steps] = len(reductions)
            for name, p in ref.named_parameters():
                got = dict(model.named_parameters())[name]
                for r, t in got.locals.items():
                    np.testing.assert_allclose(t.numpy(), expected_local(p.numpy(), got.spec, got.mesh.coords_of(r)),
                                               rtol=1e-4, atol=2e-5, err_msg=f"{name} rank {r}")
            monkeypatch.undo()

    def quiet(k, window):              # no reduction during the window's 7 non-final micro-steps
        last_non_final = window * accum_steps + accum_steps - 2
        return counts[k, last_non_final] == counts[k, "after step", window - 1]

    assert quiet(1, 1) and quiet(1, 2) and quiet(accum_steps, 1) and quiet(accum_steps, 2)
    assert counts[accum_steps, accum_steps - 2] == 0     # told: quiet from the first window on
    assert counts[1, accum_steps - 2] > 0  # negative control: before it learned, the literal loop reduced early


# ---- 15. mixed precision with paddle's GradScaler ------------------------------------------------------------------
@pytest.fixture
def gpu_scaler():
    """paddle.amp.GradScaler as built on a GPU (on CPU paddle disables it and scale() is the identity)."""
    with gpu_place():
        yield


def test_15_grad_scaler_as_written(gpu_scaler, one_process):
    with auto_parallel.simulate(world_size=2):
        model = DemoNet()
        optimizer = make_optimizer(model)
        model = auto_parallel.DataParallel(model, strategy=auto_parallel.Strategy())
        optimizer = auto_parallel.Optimizer(optimizer)
        scaler = paddle.amp.GradScaler(init_loss_scaling=1024)
        losses = []
        for i in range(STEPS):
            with paddle.amp.auto_cast():
                loss = loss_of(model, i)
            scaled_loss = scaler.scale(loss)
            assert float(scaled_loss) == pytest.approx(1024 * float(loss), rel=1e-6)
            scaled_loss.backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.clear_grad()
            losses.append(float(loss))
        assert_equal_to_one_process(model, losses, one_process)


# ---- the parts that need real processes ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launched():
    return shared_launch.results(ARTICLE)[1]


def _section(launched, *names):
    for r in launched:
        for name in names:
            assert name not in r["errors"], r["errors"][name]
    return launched


def test_real_ranks_init_parallel_env_and_llama_shard_fn(launched):
    for r in _section(launched, "init_parallel_env", "llama"):
        assert r["init_parallel_env"] and r["q_local_shape"] == [32, 16]
        assert r["llama_max_loss_diff"] < 1e-5 and r["llama_max_param_diff"] < 1e-5


def test_real_ranks_monitor_finds_the_slow_rank_and_reconfigures(launched):
    for r in _section(launched, "monitor"):
        assert r["imbalanced"] and r["slowest_rank"] == 1 and r["slowest_phase"] == "forward"
        assert r["suggested_is_strategy"] and r["reconfigured"]
        assert r["after_reconfigure_max_diff"] < 1e-4                    # training went on, equal to one process


def test_real_ranks_agree_on_an_overflow_of_one_rank(launched):
    for r in _section(launched, "scaler"):
        assert r["skipped_on_overflow"] and r["scale_after_overflow"] == 512.0 and r["params_identical"]


def test_real_ranks_backward_use_async_allreduce(launched):
    for r in _section(launched, "async"):
        assert r["async_allreduce_max_diff"] < 1e-5


def test_real_ranks_checkpoint_fallback_and_resume(launched):
    for r in _section(launched, "checkpoint"):
        assert r["saved_before_failure"] == ["latest", "step-00000002"] and r["offloaded"]
        assert r["saved"] == ["latest", "step-00000002", "step-00000004"]
        assert r["recovered_max_diff"] < 1e-5                 # 4 steps through the failure equal one process
