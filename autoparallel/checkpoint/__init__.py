"""Distributed checkpoints: save per-rank shards, load into any layout, crash-safe, verified.

```python
ap.save_state_dict(state, "ckpt/step-100", step=100, extra={"loader": {"epoch": 1, "index": 640}})
info = ap.load_state_dict(state, "ckpt")            # newest complete checkpoint under ckpt/
full = ap.load_merged_state_dict("ckpt/step-100")   # every tensor as one numpy array
mgr = CheckpointManager.from_strategy(strategy)     # save_interval_steps, keep_last
info = mgr.start(state, resume=True)                # before training: root checked, newest restored
```

Modules: format (files), layout (who owns which box), collect/writer/save (writing), reader/load
(reading only the needed bytes), atomic (temporary names, fsync, rename, fault injection), sync (the
file rendezvous of a real job), shared_dir (every rank writes into one directory: checked before any
write), discovery/manager (newest complete checkpoint, periodic saves), ownership and run_root
(markers: what may be replaced or removed, one run per root), schema (metadata checked before any
allocation), rng_arrays (generator states as plain arrays: a checkpoint is data, never code),
state (stable names for model and optimizer state), zero_state (a ZeRO optimizer's flat chunks as
global tensors), pipeline_state (each stage's ranks save their stage under the model's names), leaves
(the state-leaf protocol those two use), reshard_state (layout changes by round-trip), schedule_follow (a
save from a post-step hook takes the loop's scheduler step after it).
"""
from autoparallel.checkpoint.discovery import resolve_checkpoint
from autoparallel.checkpoint.errors import (CheckpointCorruptError, CheckpointError, CheckpointLayoutError,
                                            CheckpointMismatchError, CheckpointOwnershipError, CheckpointRootError,
                                            CheckpointSaveError)
from autoparallel.checkpoint.load import (CheckpointInfo, load_merged_state_dict, load_state_dict,
                                          read_checkpoint_info)
from autoparallel.checkpoint.manager import CheckpointManager
from autoparallel.checkpoint.reshard_state import reconfigure, reshard_state
from autoparallel.checkpoint.save import save_state_dict
from autoparallel.checkpoint.state import training_state
from autoparallel.checkpoint.verify import verify_checkpoint

__all__ = ["save_state_dict", "load_state_dict", "load_merged_state_dict", "read_checkpoint_info",
           "CheckpointManager", "CheckpointInfo", "reshard_state", "reconfigure", "training_state",
           "verify_checkpoint", "resolve_checkpoint", "CheckpointError", "CheckpointCorruptError",
           "CheckpointMismatchError", "CheckpointSaveError", "CheckpointOwnershipError", "CheckpointRootError",
           "CheckpointLayoutError"]
