"""Checks shared by the cross-strategy checkpoint tests and their worker: every box of every tensor a
training state holds in this process against the merged checkpoint (``ap.load_merged_state_dict``), and
the state's entry names."""

import numpy as np


from autoparallel.checkpoint.flatten import flatten  # noqa: E402
from autoparallel.checkpoint.layout import local_box  # noqa: E402
from autoparallel.checkpoint.leaves import HeldElsewhere, ShardedLeaf  # noqa: E402
from autoparallel.dist_tensor import as_dist, is_dist  # noqa: E402
from autoparallel.local_mode import local_mode  # noqa: E402


def held_boxes(leaf) -> list:
    """[(global offsets, numpy array)] of what this process holds of ``leaf``."""
    if isinstance(leaf, HeldElsewhere):
        return []
    if isinstance(leaf, ShardedLeaf):
        return leaf.held_boxes()
    with local_mode():
        if is_dist(leaf):
            dt = as_dist(leaf)
            return [(local_box(dt.spec, r)[0], t.numpy()) for r, t in sorted(dt.locals.items())]
        return [((0,) * len(leaf.shape), leaf.numpy())]


def mismatches(state: dict, merged: dict) -> tuple:
    """(names whose held boxes differ from the merged checkpoint, number of boxes compared)."""
    bad, n = [], 0
    for name, (_, _, leaf) in flatten(state).items():
        if not hasattr(leaf, "shape") and not isinstance(leaf, ShardedLeaf):
            continue
        full = merged[name]
        for off, array in held_boxes(leaf):
            n += 1
            want = full[tuple(slice(o, o + s) for o, s in zip(off, array.shape))]
            if want.shape != array.shape or not np.array_equal(want, array):
                bad.append(f"{name} at {list(off)}")
    return bad, n


def tensor_names(state: dict) -> list:
    return sorted(flatten(state))
