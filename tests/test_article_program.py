"""examples/article_program.py in one process: the program equals a plain paddle loop over the same model and data;
a kill after a checkpoint and ``resume_from_last_checkpoint()`` continue exactly as the uninterrupted run; the
first save after a restore keeps the step just taken (it used to load the checkpoint again); flags that cannot
be honoured are refused by name before any work."""
import os
import sys

import numpy as np
import paddle
import pytest

from autoparallel import auto_checkpoint
from autoparallel.checkpoint.manager import CheckpointManager
from autoparallel.checkpoint.state import training_state

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import article_program as program  # noqa: E402

STEPS = ["--steps", "4"]


def losses(log):
    return [s["loss"] for s in log["steps"]]


def plain_paddle(args_list):
    """The same training without autoparallel: the PaddleFormers model, AdamW, loss / accum_steps."""
    args = program.make_parser().parse_args(args_list)
    model = program.build_model(args)
    opt = paddle.optimizer.AdamW(learning_rate=args.lr, parameters=model.parameters())
    batches = program.dataloader(args)
    out = []
    for _ in range(args.steps):
        total = 0.0
        for _ in range(args.accum):
            loss = model(**next(batches)).loss / args.accum
            loss.backward()
            total += float(loss)
        opt.step()
        opt.clear_grad()
        out.append(total)
    return out


@pytest.fixture(autouse=True)
def _fresh_run():
    auto_checkpoint.reset()
    yield
    auto_checkpoint.reset()


@pytest.mark.parametrize("flags", [[], ["--accum", "2", "--tied"]], ids=["plain", "accum2_tied"])
def test_one_process_program_equals_plain_paddle(flags):
    got = losses(program.main(flags + STEPS))
    np.testing.assert_allclose(got, plain_paddle(flags + STEPS), rtol=1e-6)


def test_kill_after_a_checkpoint_and_resume_equal_the_uninterrupted_run(tmp_path):
    flags = ["--accum", "2", "--save-every", "1", "--ckpt-dir", str(tmp_path / "ckpt")]
    whole = losses(program.main(["--accum", "2"] + STEPS))
    with pytest.raises(program.Killed):
        program.main(flags + STEPS + ["--kill-after", "2"])
    auto_checkpoint.reset()                                   # a new process
    resumed = losses(program.main(flags + STEPS + ["--resume"]))
    # before the fix the first save after the resume loaded the checkpoint again: step 3 trained from step 2's
    # parameters (5.8175 against 5.7848)
    np.testing.assert_allclose(resumed, whole[2:], rtol=1e-6)


def test_first_save_after_restore_keeps_the_step_taken(tmp_path):
    paddle.seed(0)
    model = paddle.nn.Linear(4, 3)
    opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    CheckpointManager(str(tmp_path), 1).save(training_state(model, opt), 1)
    fresh = CheckpointManager(str(tmp_path), 1)               # a restarted run: restore() without start()
    assert fresh.restore(training_state(model, opt)).step == 1
    model.weight.set_value(np.full([4, 3], 7.0, "float32"))   # the step after the resume
    fresh.save(training_state(model, opt), 2)
    np.testing.assert_array_equal(model.weight.numpy(), 7.0)   # was the checkpoint's value again


@pytest.mark.parametrize("flags,world,says", [
    (["--dp", "2"], 1, "--dp 2 x --tp 1 x --pp 1 must equal the 1 ranks"),
    (["--sp"], 1, "--sp needs --tp > 1"),
    (["--micro-batches", "2"], 1, "--micro-batches 2 needs --pp > 1"),
    (["--accum", "0"], 1, "--accum must be a positive integer"),
    (["--resume"], 1, "need --ckpt-dir"),
])
def test_flags_that_cannot_be_honoured_are_refused_by_name(flags, world, says, capsys, monkeypatch):
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", str(world))
    with pytest.raises(SystemExit) as e:
        program.main(flags)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_keyword_inputs_give_the_planner_its_batch():
    """``model(**batch)`` passes every input by keyword: the run records the batch shape from them, so the
    monitor's ``suggest_optimal_strategy()`` can re-plan without being told the batch (it raised ValueError
    're-planning needs global_batch_size' on DP2 x TP2)."""
    import autoparallel as dist

    args = program.make_parser().parse_args(["--batch-size", "4", "--seq-len", "8"])
    model = program.build_model(args)
    opt = paddle.optimizer.AdamW(learning_rate=args.lr, parameters=model.parameters())
    model, opt = dist.parallelize(model, opt, strategy=program.make_strategy(args))
    monitor = dist.PerformanceMonitor(warmup_steps=1, measure_steps=2)
    batches = program.dataloader(args)
    for _ in range(3):
        with monitor.record("forward"):
            loss = model(**next(batches)).loss
        with monitor.record("backward"):
            loss.backward()
        with monitor.record("step"):
            opt.step()
            opt.clear_grad()
        monitor.step()
    assert auto_checkpoint.current_run().input_shape == [4, 8]
    suggested = monitor.suggest_optimal_strategy()
    assert isinstance(suggested, dist.Strategy)


@pytest.mark.parametrize("flags", [[], ["--pp", "2"], ["--tp", "2", "--sp"]], ids=["one", "pp2", "tp2_sp"])
def test_recompute_reruns_the_decoder_layers(flags, monkeypatch):
    """--recompute is not silently dropped by parallelize: every decoder layer's MLP runs again in backward."""
    import autoparallel as dist
    from paddleformers.transformers.llama import modeling

    calls = [0]
    forward = modeling.MLP.forward

    def counted(self, *a, **k):
        calls[0] += 1
        return forward(self, *a, **k)

    monkeypatch.setattr(modeling.MLP, "forward", counted)

    def mlp_calls(recompute):
        args = program.make_parser().parse_args(flags + (["--recompute"] if recompute else []))
        model = program.build_model(args)
        if recompute:
            model = dist.recompute_layers(model, segment_func=program.is_decoder_layer, checkpoint_every_n_layers=2)
        opt = paddle.optimizer.AdamW(learning_rate=args.lr, parameters=model.parameters())
        model, opt = dist.parallelize(model, opt, strategy=program.make_strategy(args))
        calls[0] = 0
        model(**next(program.dataloader(args))).loss.backward()
        return calls[0]

    with dist.simulate(world_size=2) if flags else __import__("contextlib").nullcontext():
        plain, recomputed = mlp_calls(False), mlp_calls(True)
    assert plain > 0 and recomputed == 2 * plain


def test_save_after_reconfiguring_into_a_pipeline_with_zero(tmp_path):
    """``reconfigure_distributed_model`` in place from DP2 x TP2 to PP2 x DP2 with ZeRO-1 (what the monitor's
    re-plan chose on 4 ranks): the rebuilt pipeline optimizer named the rebuilt pipeline, not the held object,
    so the next automatic save raised 'pass that PipelineModule to ap.training_state'."""
    import autoparallel as dist
    from autoparallel.checkpoint.state import training_state as state_of

    with dist.simulate(world_size=4):
        args = program.make_parser().parse_args(["--dp", "2", "--tp", "2", "--batch-size", "4", "--seq-len", "8"])
        model = program.build_model(args)
        opt = paddle.optimizer.AdamW(learning_rate=args.lr, parameters=model.parameters())
        strategy = program.make_strategy(args)
        model, opt = dist.parallelize(model, opt, strategy=strategy)
        batches = program.dataloader(args)
        model(**next(batches)).loss.backward()
        opt.step()
        opt.clear_grad()
        new = dist.Strategy()
        new.data_parallel.degree, new.pipeline_parallel.degree, new.pipeline_parallel.micro_batches = 2, 2, 2
        new.sharding.enable, new.sharding.stage = True, 1
        dist.reconfigure_distributed_model(model, new)
        loss = model(**next(batches)).loss
        loss.backward()
        opt.step()
        opt.clear_grad()
        assert state_of(model, opt)["model"]
        third = float(model(**next(batches)).loss)
    expected = plain_paddle(["--batch-size", "4", "--seq-len", "8", "--steps", "3"])
    np.testing.assert_allclose([float(loss), third], expected[1:], rtol=1e-5)
