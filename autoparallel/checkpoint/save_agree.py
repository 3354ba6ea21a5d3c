"""Before a save makes any collective, its ranks agree that they make the same ones, in the same order.

A save's only collectives are the reductions of Partial entries (collect.py) and the exchange of the save's
name. gloo pairs collectives by order, so ranks reaching a save with different Partial entries (a key one rank
lacks, a different order) would pair one entry's reduction with another's: the same shape mixes the values
silently, another shape hangs until gloo's 30 s timeout. So every rank first shares, in one exchange, the save's
name and the list of reductions it is about to make (name, shape, dtype, mesh, in order); any two ranks that share
a mesh must list the same reductions on the meshes they share, or every rank raises ``CheckpointSaveError``
naming the first difference, before any reduction. A rank whose own arguments are wrong (a value that is not
JSON, an existing path) sends its error in the exchange, so every rank raises it at once (the others prefixed
with that rank) instead of waiting for a rank that has left the save. A rank that never reaches the save (the
others wait in the exchange) fails that exchange, which is reported as such rather than as a bare gloo timeout.
The exchange also carries each rank's absolute path and probe file, so ranks that would write into different
directories stop before any write (shared_dir.py).
"""
from __future__ import annotations

import numpy as np

from autoparallel.checkpoint.errors import CheckpointOwnershipError, CheckpointSaveError
from autoparallel.checkpoint.sync import all_gather_json as _all_gather_json


def reductions(flat: dict, rank: int) -> list:
    """[[name, shape, dtype, process ids]] of the Partial entries this rank reduces, in save order."""
    from autoparallel.dist_tensor import DistTensor, as_dist, is_dist
    from autoparallel.placement import Partial

    out = []
    for name, (_, _, leaf) in flat.items():
        if not (isinstance(leaf, DistTensor) or is_dist(leaf)):
            continue
        spec = as_dist(leaf).spec
        pids = [int(p) for p in np.asarray(spec.mesh.process_ids).reshape(-1)]
        if rank in pids and any(isinstance(p, Partial) for p in spec.placements):
            out.append([name, [int(s) for s in spec.shape], str(spec.dtype), pids])
    return out


def first_difference(lists: list):
    """The first pair of ranks whose reductions on the meshes they share differ, described; None if none."""
    for r, mine in enumerate(lists):
        for s in range(r + 1, len(lists)):
            a = [e for e in mine if s in e[3]]
            b = [e for e in lists[s] if r in e[3]]
            if a == b:
                continue
            i = next(i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i])
            show = [_show(x[i]) if i < len(x) else "nothing" for x in (a, b)]
            return (f"rank {r} reduces {show[0]} where rank {s} reduces {show[1]} (reduction {i} of the Partial "
                    f"entries on their shared meshes)")
    return None


_ERRORS = {c.__name__: c for c in (TypeError, ValueError, FileExistsError, FileNotFoundError, PermissionError,
                                    NotADirectoryError, CheckpointOwnershipError)}


def _show(entry) -> str:
    name, shape, dtype, pids = entry
    return f"{name!r} {shape} {dtype} on ranks {pids}"


def agree(flat: dict, token: str, final: str, problem: BaseException = None, probe: str = None) -> str:
    """Rank 0's ``token`` on every rank once they agree on the save's reductions (module docstring) and see one
    checkpoint directory (shared_dir.py); arms the watchdog first (every rank of a save passes here together).
    ``problem``: this rank's own input error, raised on every rank (the others' prefixed with this rank)
    instead of leaving them in the exchange. ``probe``: this rank's probe file (shared_dir.leave_probe)."""
    from autoparallel.checkpoint import shared_dir, sync

    multi, rank, world_size = sync.job()
    if not multi:
        if problem is not None:
            raise problem
        return token
    from autoparallel import watchdog

    watchdog.start_default()
    try:
        with watchdog.op("checkpoint start (all_gather)"):
            error = None if problem is None else [type(problem).__name__, str(problem)]
            parts = _all_gather_json({"token": token, "reduce": reductions(flat, rank), "error": error,
                                      "final": final, "probe": probe})
        if not all(isinstance(p, dict) and isinstance(p.get("token"), str) and isinstance(p.get("reduce"), list)
                   for p in parts):
            raise ValueError("a rank's answer is not a save's")
    except (RuntimeError, ValueError) as e:    # a peer in another collective: gloo times out or pairs garbage
        raise CheckpointSaveError(f"checkpoint {final}: the ranks did not start the save together (every rank of "
                                  f"the job must call save_state_dict at the same point): {e}") from None
    if problem is not None:
        raise problem
    for r, p in enumerate(parts):
        if p.get("error"):
            name, text = p["error"]
            if name in _ERRORS:
                raise _ERRORS[name](f"(rank {r}) {text}")
            raise CheckpointSaveError(f"(rank {r}) {name}: {text}")   # a Ctrl-C, an unexpected error: named
    problem = first_difference([p["reduce"] for p in parts])
    if problem is not None:
        raise CheckpointSaveError(f"checkpoint {final}: the ranks' states differ, nothing was written: {problem}; "
                                  f"every rank passes the same Partial entries in the same order")
    probes = [p.get("probe") for p in parts]
    if all(isinstance(x, str) for x in probes):        # decided on the gathered parts: the same on every rank
        shared_dir.check_visible(probes, f"checkpoint {final}", rank, world_size,
                                 paths=[p.get("final") for p in parts])
    return parts[0]["token"]
