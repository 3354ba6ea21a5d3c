"""Saving and loading PaddleFormers models (Llama, Qwen3, Qwen3-MoE) laid out on real gloo ranks, against one
process: one shared-launch job per world size (dist_scripts/ckpt_models5_worker.py; 2 ranks: tensor parallel 2 ->
data parallel 2; 4 ranks: dp 2 x tp 2 -> ZeRO-3 over 4).

* A resume through paddle's own files (``paddle.save`` of ``ap.full_state_dict(model)`` / ``(opt)`` and of the
  scheduler, ``paddle.load`` + ``set_state_dict`` into another layout, or into one process) continues the loss
  trajectory of an uninterrupted one-process run, AdamW moments, weight decay and a StepDecay schedule included;
  so does ``paddle.save(model.state_dict())`` / ``opt.state_dict()`` of a data-parallel layout.
* ``ap.save_state_dict`` / ``ap.load_state_dict`` of a bfloat16 model with tied embeddings, a frozen parameter and
  non-tensor entries, across layouts and into one process: equal, the tie and the frozen flag kept.
* A path that is a file, a directory nothing can be created in, a checkpoint missing a key, with a wrong shape,
  of another model, without its metadata: the same typed error on every rank, naming the path or the keys,
  nothing loaded, the user's file kept.
* A model built under ``paddle.LazyGuard`` and laid out with ZeRO-3 took no value written into it:
  ``ap.load_state_dict(model.state_dict(), path)``, ``model.set_state_dict(sd)``, ``p.set_value(v)`` all
  returned, and the next forward gathered the initialiser's values again (logits off by 4-7 against the loaded
  one-process model; a model built eagerly was right). The write reached the parameter, but refreshing its
  master chunk from it (``ZeroOptimizer.reload``) asked ``_initial_chunk``, which the lazy optimizer answers with
  the chunk streamed from the initialiser. Now the chunk comes from the data written.
* A float16 model could not be laid out with tensor parallelism on a CPU when a weight is block-sharded (Qwen3's
  fused q/k/v projection): cutting a rank's rows used ``paddle.index_select``, which has no CPU kernel for
  float16 (paddle's ``NotFound`` error). The rows are now cut as slices of contiguous runs
  (``local_parts._rows``); float16 and bfloat16 checkpoints then go dp 2 x tp 2 -> one process / ZeRO-3 exactly.
* A checkpoint of a model whose embedding and head are separate, loaded into one that ties them (two names, one
  tensor): the load wrote both values into the one tensor and kept the head's, silently (measured: the
  embedding off by 0.73, in one process, simulated and on real ranks). Now ``CheckpointMismatchError`` naming
  both entries, nothing loaded (``checkpoint/load.py: _check_ties``); a tied checkpoint still loads into a tied
  or an untied model.
* PaddleFormers' ``save_pretrained`` / ``from_pretrained`` on several ranks go through paddle's flex-checkpoint,
  whose distributed path moves every tensor to a GPU (``.cuda()``): on a CPU it raises paddle's ``ValueError: No
  available device found.`` in a plain paddle program as well (no autoparallel), so here every rank must raise
  that same error, and nothing may hang (with a GPU the values are compared with one process). In one process
  (the simulated world) the files equal the one-process files: tests/test_probe_models_options.py."""
import contextlib
import os
import sys

import numpy as np
import pytest

from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

import paddle  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel.checkpoint import CheckpointMismatchError  # noqa: E402
from dist_scripts import shared_launch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts"))
import ckpt_models5_common as cm  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts", "ckpt_models5_worker.py")
CPU_ONLY = "ValueError: No available device found."      # paddle's flex-checkpoint on several CPU ranks


def _prepare(world):
    def args(out):
        name = cm.PRETRAINED[world]
        cm.build(name).save_pretrained(os.path.join(out, f"pre-{name}"))
        ap.save_state_dict(dict(cm.build(cm.LAZY[world], 5).state_dict()), os.path.join(out, f"one-{cm.LAZY[world]}"))
        return [out]
    return args


JOBS = {w: shared_launch.job(__name__, f"ckpt_models5_{w}", WORKER, w, args=_prepare(w), timeout=240) for w in (2, 4)}


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def job(request):
    out, ranks = shared_launch.results(JOBS[request.param])
    return request.param, out, ranks


def _reference(name, n):
    model, opt, sched = cm.make(name)
    return cm.steps(model, opt, sched, 0, n)


def test_a_resume_through_paddle_save_into_another_layout_continues_the_one_process_run(job):
    world, _, ranks = job
    ref = _reference(cm.RESUMED[world], 2 * cm.HALF)
    for r in ranks:
        assert r["resume"]["model"] == cm.RESUMED[world]
        np.testing.assert_allclose(r["resume"]["losses"], ref, rtol=0, atol=2e-5)


def test_paddle_files_written_on_ranks_resume_in_one_process(job):
    world, out, _ = job
    name = cm.RESUMED[world]
    ref = _reference(name, 3 * cm.HALF)
    dirs = [("resume", cm.HALF)] + ([("resume2", 2 * cm.HALF)] if world == 2 else [])
    for sub, start in dirs:
        model, opt, sched = cm.make(name)
        model.set_state_dict(paddle.load(os.path.join(out, sub, "model.pdparams")))
        opt.set_state_dict(paddle.load(os.path.join(out, sub, "model.pdopt")))
        sched.set_state_dict(paddle.load(os.path.join(out, sub, "sched.pdparams")))
        got = cm.steps(model, opt, sched, start, start + cm.HALF)
        np.testing.assert_allclose(got, ref[start:start + cm.HALF], rtol=0, atol=2e-5, err_msg=sub)


def test_negative_control_the_model_alone_does_not_continue_the_run(job):
    world, out, _ = job
    name = cm.RESUMED[world]
    ref = _reference(name, 2 * cm.HALF)
    model, opt, sched = cm.make(name)
    model.set_state_dict(paddle.load(os.path.join(out, "resume", "model.pdparams")))   # no moments, no schedule
    got = cm.steps(model, opt, sched, cm.HALF, 2 * cm.HALF)
    assert np.abs(np.array(got) - ref[cm.HALF:]).max() > 1e-3


def test_a_bfloat16_tied_frozen_checkpoint_loads_into_another_layout_and_one_process(job):
    world, out, ranks = job
    name = cm.TIED[world]
    one, _, _ = cm.make(name, dtype="bfloat16", **cm.TIED_CFG)
    for r in ranks:
        c = r["ap_ckpt"]
        assert c["keys"] and c["max_diff"] == 0.0
        assert c["extras"] == cm.EXTRAS
        assert c["tied"] == cm.tie_kept(one) and c["frozen"]
    saved = dict(np.load(os.path.join(out, "apckpt-saved.npz")))
    target, _, _ = cm.make(name, seed=3, dtype="bfloat16", **cm.TIED_CFG)
    state = cm.with_extras(target.state_dict(), empty=True)
    ap.load_state_dict(state, os.path.join(out, "apckpt"))
    got = {k: v.astype("float32").numpy() for k, v in target.state_dict().items()}
    assert sorted(got) == sorted(saved)
    for k in saved:
        assert target.state_dict()[k].dtype == paddle.bfloat16, k
        np.testing.assert_array_equal(got[k], saved[k], err_msg=k)
    assert {k: state[k] for k in cm.EXTRAS} == cm.EXTRAS


FAILURES = {
    "existing_file": ("CheckpointOwnershipError", "a-file': the path already exists and is a file"),
    "unwritable_dir": ("FileNotFoundError", "cannot save checkpoint '/proc/ap-ckpt-models5': rank {rank} cannot "
                                            "create a file in '/proc'"),
    "wrong_shape": ("CheckpointMismatchError", "'model.embed_tokens.weight': shape [160, 64] in the state, "
                                               "[128, 64] in the checkpoint"),
    "missing_key": ("CheckpointMismatchError", "missing from the checkpoint: ['model.layers.2."),
    "other_model": ("CheckpointMismatchError", "in the checkpoint but not in the state"),
    "no_metadata": ("FileNotFoundError", "no complete checkpoint in '{out}/bad/no-meta'"),
    "untied_into_tied": ("CheckpointMismatchError", "'model.embed_tokens.weight' and 'lm_head.weight' are one "
                                                    "tensor in the state (tied weights), but the checkpoint holds "
                                                    "different values"),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_a_bad_path_or_checkpoint_is_the_same_typed_error_on_every_rank_and_loads_nothing(job, case):
    world, out, ranks = job
    kind, text = FAILURES[case]
    for r in ranks:
        got = r["failures"][case]
        assert got["error"] is not None and got["error"].startswith(kind + ": "), got
        assert text.format(rank=r["rank"], out=out) in got["error"], got
        assert got.get("unchanged", True)
        assert r["failures"]["file_kept"]
    assert sorted(os.listdir(os.path.join(out, "bad"))) == ["a-file", "good", "no-meta", "untied"]   # nothing else


def test_from_pretrained_and_save_pretrained_on_every_rank(job):
    """With a GPU, the values against one process; on CPU ranks paddle's own error, the same on every rank."""
    world, out, ranks = job
    name = cm.PRETRAINED[world]
    for case in ("from_pretrained", "save_pretrained"):
        errors = {r[case]["error"] for r in ranks}
        assert len(errors) == 1, (case, errors)                 # every rank: the same outcome
        assert errors <= {None, CPU_ONLY}, (case, errors)
    if ranks[0]["from_pretrained"]["error"] is None:
        want = cm.logits(type(cm.build(name)).from_pretrained(os.path.join(out, f"pre-{name}")))
        for r in ranks:
            assert r["from_pretrained"]["distributed"]
            np.testing.assert_allclose(np.load(os.path.join(out, f"logits-{name}-r{r['rank']}.npy")), want,
                                       rtol=0, atol=1e-5)
    saved = os.path.join(out, f"saved-{name}")
    if ranks[0]["save_pretrained"]["error"] is None:           # the same untrained weights as the one-process files
        loaded = cm.logits(type(cm.build(name)).from_pretrained(saved))
        want = cm.logits(type(cm.build(name)).from_pretrained(os.path.join(out, f"pre-{name}")))
        np.testing.assert_allclose(loaded, want, rtol=0, atol=1e-5)
    elif os.path.isdir(saved):                                  # no weights file a load could take for complete
        assert not [f for f in os.listdir(saved) if f.endswith((".safetensors", ".pdparams"))]


@pytest.mark.parametrize("world", [1, 2])
def test_an_untied_checkpoint_into_a_tied_model_names_both_entries_and_loads_nothing(tmp_path, world):
    untied = cm.build("qwen3", 4, tie_word_embeddings=False)
    ap.save_state_dict(dict(untied.state_dict()), str(tmp_path / "untied"))
    tied_ckpt = cm.build("qwen3", 5, **cm.TIED_CFG)
    ap.save_state_dict(dict(tied_ckpt.state_dict()), str(tmp_path / "tied"))
    with ap.simulate(world_size=world) if world > 1 else contextlib.nullcontext():
        model, _, _ = cm.make("qwen3", seed=2, **({"tp": 2} if world > 1 else {}), **cm.TIED_CFG)
        before = cm.full_np(model)
        with pytest.raises(CheckpointMismatchError, match=r"'model.embed_tokens.weight' and 'lm_head.weight' are "
                                                          r"one tensor in the state \(tied weights\)"):
            ap.load_state_dict(dict(model.state_dict()), str(tmp_path / "untied"))
        after = cm.full_np(model)
        assert all(np.array_equal(before[k], after[k]) for k in before)            # nothing loaded
        ap.load_state_dict(dict(model.state_dict()), str(tmp_path / "tied"))       # negative control: tied -> tied
        got = cm.full_np(model)
        assert cm.tie_kept(model)
    for k, v in tied_ckpt.state_dict().items():
        np.testing.assert_array_equal(got[k], v.numpy(), err_msg=k)
    separate = cm.build("qwen3", 6, tie_word_embeddings=False)                    # tied -> untied: both names
    ap.load_state_dict(dict(separate.state_dict()), str(tmp_path / "tied"))
    np.testing.assert_array_equal(separate.lm_head.weight.numpy(), tied_ckpt.lm_head.weight.numpy())
    np.testing.assert_array_equal(separate.model.embed_tokens.weight.numpy(), tied_ckpt.lm_head.weight.numpy())


def test_a_lazily_built_zero3_model_loads_a_one_process_checkpoint_on_every_rank(job):
    world, out, ranks = job
    want = cm.logits(cm.build(cm.LAZY[world], 5))
    for r in ranks:
        got = np.load(os.path.join(out, f"lazy-logits-r{r['rank']}.npy"))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("form", ["ap.load_state_dict", "set_state_dict", "set_value"])
def test_values_written_into_a_lazily_built_zero3_model_are_the_ones_it_computes_with(tmp_path, form):
    src = cm.build("llama", 5)
    want = cm.logits(src)
    full = {k: v.numpy() for k, v in src.state_dict().items()}
    ap.save_state_dict(dict(src.state_dict()), str(tmp_path / "one"))
    with ap.simulate(world_size=2):
        model = cm.lazy("llama")
        opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
        model, opt = ap.parallelize(model, opt, strategy=cm.strategy(dp=2, zero3=True))
        if form == "ap.load_state_dict":
            ap.load_state_dict(dict(model.state_dict()), str(tmp_path / "one"))
        elif form == "set_state_dict":
            model.set_state_dict({k: paddle.to_tensor(v) for k, v in full.items()})
        else:
            for k, p in model.named_parameters():
                p.set_value(full[k])
        np.testing.assert_allclose(cm.logits(model), want, rtol=0, atol=1e-5)
        got = cm.full_np(model)
    for k in full:
        np.testing.assert_array_equal(got[k], full[k], err_msg=k)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_low_precision_block_sharded_model_saves_and_loads_across_layouts(tmp_path, dtype):
    src = cm.build("qwen3", 3, **cm.TIED_CFG)
    src.to(dtype=dtype)
    full = {k: v.astype("float32").numpy() for k, v in src.state_dict().items()}
    with ap.simulate(world_size=4):
        model, _, _ = cm.make("qwen3", dtype=dtype, dp=2, tp=2, **cm.TIED_CFG)     # q/k/v fused: block-sharded
        model.set_state_dict(dict(src.state_dict()))
        ap.save_state_dict(dict(model.state_dict()), str(tmp_path / "ck"))
    one = cm.build("qwen3", 9, **cm.TIED_CFG)
    one.to(dtype=dtype)
    ap.load_state_dict(dict(one.state_dict()), str(tmp_path / "ck"))
    with ap.simulate(world_size=2):
        zero3, _, _ = cm.make("qwen3", seed=8, dtype=dtype, dp=2, zero3=True, **cm.TIED_CFG)
        ap.load_state_dict(dict(zero3.state_dict()), str(tmp_path / "ck"))
        got = cm.full_np(zero3)
    for k in full:
        assert one.state_dict()[k].dtype == getattr(paddle, dtype), k
        np.testing.assert_array_equal(one.state_dict()[k].astype("float32").numpy(), full[k], err_msg=k)
        np.testing.assert_array_equal(got[k], full[k], err_msg=k)
