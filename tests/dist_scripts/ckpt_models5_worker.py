"""Saving and loading PaddleFormers models on real gloo ranks (2: tensor parallel 2, data parallel 2; 4: dp 2 x tp 2,
ZeRO-3 over 4). Usage: ckpt_models5_worker.py OUT. OUT holds what the test wrote before the launch: a one-process
``save_pretrained`` directory per model (``pre-<model>``). Every rank writes its numbers next to it and reports:

* ``from_pretrained``: every rank loads the one-process checkpoint with ``from_pretrained``, then parallelizes;
  its logits (``logits-<model>-r<rank>.npy``);
* ``lazy_zero3``: a one-process ``ap.save_state_dict`` checkpoint (``one-<model>``) loaded into a model built under
  ``paddle.LazyGuard`` and laid out with ZeRO-3 (its logits, ``lazy-logits-r<rank>.npy``);
* ``save_pretrained``: PaddleFormers' ``save_pretrained`` on every rank (the error every rank raised, if any);
* ``resume``: AdamW + StepDecay, 2 steps in one layout, ``ap.full_state_dict`` of the model and the optimizer and
  the scheduler's state written with ``paddle.save`` by rank 0 (``resume/``), then every rank loads them with
  ``paddle.load`` + ``set_state_dict`` into another layout and takes 2 more steps (the losses); on 2 ranks that
  layout (data parallel) then saves ``model.state_dict()`` / ``opt.state_dict()`` itself (``resume2/``);
* ``ap_ckpt``: ``ap.save_state_dict`` of a bfloat16 model (untrained: paddle has no bfloat16 matmul on a CPU)
  with tied embeddings, a frozen parameter and non-tensor entries, loaded with ``ap.load_state_dict`` into
  another layout (the largest difference) and by the test into one process;
* ``failures``: an existing file as the path, a directory nothing can be created in, a checkpoint missing a key,
  with a wrong shape, of another model, without its metadata, of an untied model into a tied one: the error each
  rank raised, and whether the state was left as it was."""
import os
import shutil
import sys

import numpy as np
import paddle
import paddle.distributed as dist

import autoparallel as ap
from autoparallel.testing.launch import write_result

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt_models5_common as cm  # noqa: E402


def layout_of(world: int, which: str) -> dict:
    return cm.LAYOUTS[world][which]


def from_pretrained(out, world, rank):
    name = cm.PRETRAINED[world]
    cls = type(cm.build(name))
    try:
        model = cls.from_pretrained(os.path.join(out, f"pre-{name}"))
    except Exception as e:                      # noqa: BLE001  (reported to the test)
        return {"error": f"{type(e).__name__}: {e}"}
    model, _ = ap.parallelize(model, None, strategy=cm.strategy(**layout_of(world, "src")))
    np.save(os.path.join(out, f"logits-{name}-r{rank}.npy"), cm.logits(model))
    return {"error": None, "model": name, "distributed": any(cm.is_dist(p) for p in model.parameters())}


def lazy_zero3(out, world, rank):
    """A one-process checkpoint (``one-<model>``, written by the test) loaded into a lazily built model under
    ZeRO-3 over every rank, with ``ap.load_state_dict(model.state_dict(), path)``."""
    name = cm.LAZY[world]
    model = cm.lazy(name)
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
    model, opt = ap.parallelize(model, opt, strategy=cm.strategy(dp=world, zero3=True))
    ap.load_state_dict(dict(model.state_dict()), os.path.join(out, f"one-{name}"))
    np.save(os.path.join(out, f"lazy-logits-r{rank}.npy"), cm.logits(model))
    return {"model": name}


def save_pretrained(out, world, rank):
    name = cm.PRETRAINED[world]
    model, _ = ap.parallelize(cm.build(name), None, strategy=cm.strategy(**layout_of(world, "src")))
    path = os.path.join(out, f"saved-{name}")
    try:
        model.save_pretrained(path)
    except Exception as e:                      # noqa: BLE001  (reported to the test)
        return {"error": f"{type(e).__name__}: {e}"}
    np.save(os.path.join(out, f"saved-logits-r{rank}.npy"), cm.logits(model))
    return {"error": None}


def resume(out, world, rank):
    name = cm.RESUMED[world]
    path = os.path.join(out, "resume")
    model, opt, sched = cm.make(name, **layout_of(world, "src"))
    first = cm.steps(model, opt, sched, 0, cm.HALF)
    states = {"model": ap.full_state_dict(model), "opt": ap.full_state_dict(opt)}     # every rank: collective
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        paddle.save(states["model"], os.path.join(path, "model.pdparams"))
        paddle.save(states["opt"], os.path.join(path, "model.pdopt"))
        paddle.save(sched.state_dict(), os.path.join(path, "sched.pdparams"))
    dist.barrier()
    model, opt, sched = cm.make(name, **layout_of(world, "dst"))
    model.set_state_dict(paddle.load(os.path.join(path, "model.pdparams")))
    opt.set_state_dict(paddle.load(os.path.join(path, "model.pdopt")))
    sched.set_state_dict(paddle.load(os.path.join(path, "sched.pdparams")))
    losses = first + cm.steps(model, opt, sched, cm.HALF, 2 * cm.HALF)
    if world == 2 and rank == 0:                # data parallel: every value is whole, paddle's own forms save it
        os.makedirs(path + "2")
        paddle.save(model.state_dict(), os.path.join(path + "2", "model.pdparams"))
        paddle.save(opt.state_dict(), os.path.join(path + "2", "model.pdopt"))
        paddle.save(sched.state_dict(), os.path.join(path + "2", "sched.pdparams"))
    return {"model": name, "losses": losses}


def ap_ckpt(out, world, rank):
    name = cm.TIED[world]
    path = os.path.join(out, "apckpt")
    model, opt, _ = cm.make(name, dtype="bfloat16", **layout_of(world, "src"), **cm.TIED_CFG)
    state = cm.with_extras(model.state_dict())
    ap.save_state_dict(state, path)
    saved = cm.full_np(model)
    other, _, _ = cm.make(name, seed=1, dtype="bfloat16", **layout_of(world, "dst"), **cm.TIED_CFG)
    target = cm.with_extras(other.state_dict(), empty=True)
    ap.load_state_dict(target, path)
    got = cm.full_np(other)
    tied = cm.tie_kept(other)
    frozen = cm.frozen_param(other).stop_gradient
    if rank == 0:
        np.savez(os.path.join(out, "apckpt-saved.npz"), **saved)
    return {"max_diff": max(float(np.abs(got[k] - saved[k]).max()) for k in saved),
            "keys": sorted(got) == sorted(saved), "extras": {k: target[k] for k in cm.EXTRAS}, "tied": tied,
            "frozen": frozen}


def failures(out, world, rank):
    name = cm.TIED[world]
    root = os.path.join(out, "bad")
    model, _, _ = cm.make(name, **layout_of(world, "src"))
    good = os.path.join(root, "good")
    ap.save_state_dict(dict(model.state_dict()), good)
    if rank == 0:
        with open(os.path.join(root, "a-file"), "w") as f:
            f.write("the user's file")
        shutil.copytree(good, os.path.join(root, "no-meta"))
        os.remove(os.path.join(root, "no-meta", "metadata.json"))
    dist.barrier()
    res = {}

    def attempt(case, fn, probe=None):
        before = None if probe is None else cm.full_np(probe)
        try:
            fn()
            res[case] = {"error": None}
        except Exception as e:                  # noqa: BLE001  (reported to the test)
            res[case] = {"error": f"{type(e).__name__}: {e}"}
        if probe is not None:
            after = cm.full_np(probe)
            res[case]["unchanged"] = all(np.array_equal(before[k], after[k]) for k in before)
        dist.barrier()

    state = dict(model.state_dict())
    attempt("existing_file", lambda: ap.save_state_dict(state, os.path.join(root, "a-file")))
    attempt("unwritable_dir", lambda: ap.save_state_dict(state, cm.UNWRITABLE))
    for case, overrides in cm.MISMATCH.items():
        other, _, _ = cm.make(cm.OTHER_MODEL[name] if case == "other_model" else name, seed=2,
                              **layout_of(world, "dst"), **overrides)
        attempt(case, lambda o=other: ap.load_state_dict(dict(o.state_dict()), good), probe=other)
    untied, _, _ = cm.make(name, seed=4, **layout_of(world, "src"), tie_word_embeddings=False)
    ap.save_state_dict(dict(untied.state_dict()), os.path.join(root, "untied"))
    tied, _, _ = cm.make(name, seed=2, **layout_of(world, "dst"), **cm.TIED_CFG)
    attempt("untied_into_tied", lambda: ap.load_state_dict(dict(tied.state_dict()), os.path.join(root, "untied")),
            probe=tied)
    other, _, _ = cm.make(name, seed=2, **layout_of(world, "dst"))
    attempt("no_metadata", lambda: ap.load_state_dict(dict(other.state_dict()), os.path.join(root, "no-meta")),
            probe=other)
    with open(os.path.join(root, "a-file")) as f:
        res["file_kept"] = f.read() == "the user's file"
    return res


def main():
    out = sys.argv[1]
    paddle.set_device("cpu")
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank}
    for case in (from_pretrained, lazy_zero3, save_pretrained, resume, ap_ckpt, failures):
        result[case.__name__] = case(out, world, rank)
        dist.barrier()
    write_result(result)


if __name__ == "__main__":
    main()
