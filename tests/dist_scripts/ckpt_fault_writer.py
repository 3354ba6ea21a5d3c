"""Saves one checkpoint with CheckpointManager in the simulated world (DP2 x TP2 on 4 ranks); the test sets
AP_CKPT_FAULT so the save SIGKILLs itself at a named phase. Usage: ckpt_fault_writer.py ROOT STEP"""
import sys


import autoparallel as ap  # noqa: E402
from autoparallel.checkpoint import CheckpointManager  # noqa: E402
from ckpt_common import DP2_TP2, build_state, full_tensors  # noqa: E402

root, step = sys.argv[1], int(sys.argv[2])
with ap.simulate(world_size=4):
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"])
    state = build_state(mesh, DP2_TP2, full_tensors(seed=step))
    mgr = CheckpointManager(root, save_interval_steps=1)
    mgr.start(resume=True)                      # the same run continues in its root
    mgr.save(state, step, extra={"seed": step})
print("saved", step)
