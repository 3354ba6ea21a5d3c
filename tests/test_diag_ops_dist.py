"""The diagonal / window / scatter / count / statistics tables on 4 real gloo ranks (job ``diag_ops`` of the shared
4-rank launch, dist_scripts/diag_ops_worker.py): each call with its inputs split along dim 0 or dim 1 (uneven: a
rank holds no row of 5 or 6) or Partial on a mesh of 4, or on a 2 x 2 mesh split along the first and last dims;
value and every input's gradient equal to one process. The same tables run in the simulated world in
tests/test_probe_fresh_diag_ops.py and test_probe_fresh_value_ops.py; here the collectives (gathers, Partial sums,
the histogram's sum of shard counts) are gloo's."""
import os

import numpy as np
import pytest

from dist_scripts import shared_launch

HERE = os.path.join(os.path.dirname(__file__), "dist_scripts")
JOB = shared_launch.job(__name__, "diag_ops", os.path.join(HERE, "diag_ops_worker.py"), 4, timeout=400)


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


def _tables():
    from dist_scripts.diag_ops_worker import KINDS, tables

    return tables(), KINDS


def test_every_call_on_real_ranks_equals_one_process(ranks):
    from layout_sweep_helpers import reference

    table, kinds = _tables()
    bad = []
    for name, (fn, xs, ref) in table.items():
        want, _, want_grads = reference(ref or fn, xs)
        for kind in kinds:
            for rank, r in enumerate(ranks):
                got = r[f"{name}@{kind}"]
                if isinstance(got, str):
                    bad.append(f"{name}@{kind} rank {rank}: {got}")
                    continue
                pairs = [("value", np.asarray(got["value"]), want)] + \
                    [(f"grad {i}", np.asarray(g), w) for i, (g, w) in enumerate(zip(got["grads"], want_grads))]
                bad += [f"{name}@{kind} rank {rank} {what}" for what, g, w in pairs
                        if g.shape != w.shape or not np.allclose(g, w, rtol=1e-4, atol=1e-5)]
    assert bad == []
    assert len(table) == 29 + 71 and len(ranks) == 4          # every call of both tables, on every rank
