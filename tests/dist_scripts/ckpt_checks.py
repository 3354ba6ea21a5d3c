"""Checkpoint checks run on every rank of a real 4-rank gloo job (called by watchdog_worker.py before its
training loop, under the running watchdog): save a DP2 x TP2 state with ranks finishing their writes at
different times, load it back under DP4 and under TP2 on ranks 0-1, compare every held shard with the
full tensors, and gather PerformanceMonitor timings."""
import os
import time
import traceback


import autoparallel as ap  # noqa: E402
import autoparallel.checkpoint.save as save_module  # noqa: E402
from autoparallel.checkpoint import CheckpointManager, load_state_dict  # noqa: E402
from autoparallel.monitor import PerformanceMonitor  # noqa: E402
from ckpt_common import DP2_TP2, DP4, TP2, build_state, check_state, full_tensors  # noqa: E402


def _slow_writes(rank):
    """Rank r starts writing 0.4 r seconds late."""
    original = save_module.write_rank_file

    def slow(*args, **kwargs):
        time.sleep(0.4 * rank)
        return original(*args, **kwargs)

    save_module.write_rank_file = slow
    return original


def make_meshes() -> tuple:
    """Every mesh up front (their groups are created now), the whole-world one first: paddle 3.3.1's gloo
    fails to create a group over all ranks after smaller groups exist ("address.cc:30 ... 136 vs 45")."""
    return (ap.ProcessMesh([0, 1, 2, 3], ["dp"]), ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"]),
            ap.ProcessMesh([0, 1], ["tp"]))


def checkpoint_round_trip(root: str, rank: int, meshes: tuple) -> dict:
    result = {"rank": rank}
    try:
        full = full_tensors()
        flat, mesh, pair = meshes
        ticks = iter([0.0, 0.05 * (rank + 1)])      # a given clock: rank 3 is the slowest, exactly
        mon = PerformanceMonitor(warmup_steps=0, measure_steps=1, clock=lambda: next(ticks))
        with mon.record("step"):
            pass
        mon.step()
        state = build_state(mesh, DP2_TP2, full)
        original = _slow_writes(rank)
        try:
            path = CheckpointManager(root, save_interval_steps=10).save(
                state, 10, extra={"loader": {"epoch": 1, "index": 320}})
        finally:
            save_module.write_rank_file = original
        result["path"] = path
        result["files_after_save"] = sorted(os.listdir(path))
        dp4 = build_state(flat, DP4)
        info = load_state_dict(dp4, root)
        result["dp4_bad"] = check_state(dp4, full)
        result["dp4_step"] = info.step
        result["dp4_held"] = sorted(r for t in dp4["model"].values() for r in t.locals)
        tp2 = build_state(pair, TP2)
        load_state_dict(tp2, path)
        result["tp2_bad"] = check_state(tp2, full)
        result["tp2_held"] = sorted({r for t in tp2["model"].values() for r in t.locals})
        result["gathered"] = {str(r): t for r, t in mon.gather().items()}
        result["imbalanced"] = mon.is_imbalanced(0.2)
    except Exception:
        result["error"] = traceback.format_exc()
    return result
