"""``paddle.distributed.load_state_dict`` / ``load_merged_state_dict`` of a checkpoint autoparallel wrote (from a
tensor-parallel model and its Adam states), in a fresh ``python -c`` process that only imports autoparallel
(before or after paddle) and makes no other autoparallel call: the plain model and optimizer get the saved global
values. Before: paddle's reader ran and failed ("No metadata file ends with '.metadata'"), since the routing was
installed with the first distributed tensor. Without importing autoparallel paddle's reader still runs and fails
with that message (the format is autoparallel's; docs/checkpoints.md)."""
import json
import subprocess
import sys

import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.testing.launch import child_env
from loops2_helpers import Parallelize
from test_probe_ckpt_paddle_api import build, steps

LOADER = r'''
{imports}
import json, sys
import numpy as np
import paddle
from paddle import nn


class MLP(nn.Layer):                  # tests/loops2_helpers.py's, without importing the test helpers
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(paddle.tanh(self.fc1(x)))


with paddle.utils.unique_name.guard():
    paddle.seed(11)
    m = MLP()
    sched = paddle.optimizer.lr.StepDecay(learning_rate=0.05, step_size=1, gamma=0.5)
    opt = paddle.optimizer.Adam(sched, parameters=m.parameters())
    paddle.nn.functional.mse_loss(m(paddle.ones([8, 6])), paddle.zeros([8, 4])).backward()
    opt.step()                      # the accumulators exist, with other values
    opt.clear_grad()
paddle.distributed.load_state_dict(m.state_dict(), {path!r} + "/m")
sd = opt.state_dict()
paddle.distributed.load_state_dict(sd, {path!r} + "/o")
opt.set_state_dict(sd)
print("IMPORTED", "autoparallel" in sys.modules, flush=True)
merged = paddle.distributed.load_merged_state_dict({path!r} + "/m")
out = {{"model": {{k: v.numpy().tolist() for k, v in m.state_dict().items()}},
        "opt": {{k: np.asarray(v).tolist() for k, v in opt.state_dict().items() if k != "LR_Scheduler"}},
        "merged": {{k: v.numpy().tolist() for k, v in merged.items()}}}}
print("RESULT" + json.dumps(out))
'''


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp")
    with ap.simulate(world_size=4), paddle.utils.unique_name.guard():
        m, opt, sched = build(Parallelize(tp=2))
        steps(Parallelize(tp=2), m, opt, sched, 0)
        want_m, want_o = ap.full_state_dict(m), ap.full_state_dict(opt)
        paddle.distributed.save_state_dict(m.state_dict(), str(path / "m"))
        paddle.distributed.save_state_dict(opt.state_dict(), str(path / "o"))
    return str(path), {k: v.numpy() for k, v in want_m.items()}, \
        {k: np.asarray(v) for k, v in want_o.items() if k != "LR_Scheduler"}


def _load(path, imports):
    code = LOADER.format(imports=imports, path=path)
    p = subprocess.run([sys.executable, "-c", code], env=child_env({"OMP_NUM_THREADS": "1"}), capture_output=True,
                       text=True, timeout=300)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    return (json.loads(line[0][len("RESULT"):]) if line else None), p.stdout + p.stderr


@pytest.mark.parametrize("imports", ["import paddle\nimport autoparallel", "import autoparallel\nimport paddle"])
def test_fresh_process_loads_our_checkpoint(saved, imports):
    path, want_m, want_o = saved
    got, err = _load(path, imports)
    assert got is not None, err[-3000:]
    assert sorted(got["model"]) == sorted(want_m) and sorted(got["opt"]) == sorted(want_o) and len(want_o) >= 8
    for k, v in want_m.items():
        np.testing.assert_allclose(np.asarray(got["model"][k]), v, err_msg=k)
        np.testing.assert_allclose(np.asarray(got["merged"][k]), v, err_msg=k)
    for k, v in want_o.items():
        np.testing.assert_allclose(np.asarray(got["opt"][k]), v, err_msg=k)


def test_without_autoparallel_paddle_reader_refuses(saved):
    """Not routed without the import: paddle's own reader fails loudly (no value is loaded)."""
    got, err = _load(saved[0], "import paddle")
    assert got is None and "No metadata file ends with '.metadata'" in err and "IMPORTED" not in err
