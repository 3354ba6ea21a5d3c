"""The runtime's NCCL branches, run on gloo: the world says "nccl" and the paddle.distributed calls gloo cannot make
(reduce_scatter, alltoall, alltoall_single, ReduceOp.AVG, float16 / bfloat16 all_reduce) are exact doubles
(``autoparallel.testing.nccl_doubles``). One 2-rank job (tests/dist_scripts/nccl_path_worker.py): the doubles
against paddle's documented semantics; reshards with a backend branch under gloo and "nccl" (same values, the
native call made); DP, ZeRO-1/2/3 (``shard_optimizer`` and ``parallelize``) and TP + SP trained under "nccl" against
one process. In-process: the transport's native reduce_scatter along any axis and for avg, over a fake
``paddle.distributed`` of two ranks."""
import os
import pathlib

import numpy as np
import paddle
import pytest

from autoparallel.comm import transport as T
from autoparallel.testing.models import build, parameters_np, trained_reference
from dist_scripts import shared_launch
from nccl_path_worker import LOOPS, loop, make_opt

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_scripts", "nccl_path_worker.py")
JOB = shared_launch.job(__name__, "nccl_path", WORKER, 2, args=lambda out: [out], timeout=200)
JOB4 = shared_launch.job(__name__, "nccl_path4", WORKER, 4, args=lambda out: [out, "four"], timeout=200)
RUNS = ["dp2", "tp2_sp", "parallelize_zero1", "parallelize_zero2", "parallelize_zero3",
        "shard_optimizer_zero1", "shard_optimizer_zero2", "shard_optimizer_zero3"]
STEPS = 3


@pytest.fixture(scope="module")
def run():
    out, ranks = shared_launch.results(JOB)
    return pathlib.Path(out), ranks


@pytest.fixture(scope="module")
def reference():
    return trained_reference("gpt", STEPS)


# ---- the doubles ------------------------------------------------------------------------------------------------
def test_doubles_follow_paddles_documented_semantics(run):
    for res in run[1]:
        bad = [k for k, v in res["doubles"].items() if k != "calls" and v is not True]
        assert not bad, f"rank {res['rank']}: doubles differing from paddle's semantics: {bad}"


def test_each_double_was_called(run):
    calls = run[1][0]["doubles"]["calls"]
    assert calls["reduce_scatter"] == 4 and calls["alltoall"] == 1 and calls["alltoall_single"] == 1
    assert calls["all_reduce:avg"] == 2 and calls["all_reduce:float16"] == 1
    assert calls["all_reduce:bfloat16"] == 1 and calls["all_reduce:async"] == 2


# ---- reshards -----------------------------------------------------------------------------------------------------
def _cases(run, backend):
    return [(res["rank"], c) for res in run[1] for c in res["reshards"][backend]]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_reshard_values_and_gradients_match_the_full_tensor(run, backend):
    bad = [(r, c["case"]) for r, c in _cases(run, backend) if not c["ok"] or c.get("grad_ok") is False]
    assert not bad, bad


def test_reshard_values_under_nccl_equal_gloos_emulation(run):
    for res in run[1]:
        gloo = {c["case"]: c for c in res["reshards"]["gloo"] if "value" in c}
        for c in res["reshards"]["nccl"]:
            if "value" in c:
                assert np.array_equal(np.array(c["value"]), np.array(gloo[c["case"]]["value"])), c["case"]


def test_negative_control_members_in_the_wrong_order_fail(run):
    for res in run[1]:
        assert res["reshards"]["negative"] == {"P(sum) -> S(0)": False, "S(0) -> S(1)": False}


def _native(case: str, backend: str) -> set:
    """The paddle.distributed call a reshard makes on ``backend`` (gloo: the emulations)."""
    src, dst = case.split(" -> ")
    if "P(" in src and "S(" in dst:
        return {"reduce_scatter"} if backend == "nccl" else {"all_reduce"}
    if "S(" in src and "S(" in dst:
        return {"alltoall"} if backend == "nccl" else {"send", "recv"}
    return {"all_reduce"}


def test_each_reshard_makes_its_backends_call(run):
    for backend in ("gloo", "nccl"):
        for r, c in _cases(run, backend):
            assert set(c["calls"]) == _native(c["case"], backend), (backend, r, c["case"], c["calls"])


def test_nccl_reductions_run_natively(run):
    """avg as ReduceOp.AVG, float16 without an fp32 upcast; P -> S(1) and P(avg) -> S(d) by reduce_scatter
    (not all_reduce + slice)."""
    by = {c["case"]: c["native"] for _, c in _cases(run, "nccl")}
    assert by["[6, 4] float32 P(avg) -> R"] == {"all_reduce": 1, "all_reduce:avg": 1}
    assert by["[6, 4] float16 P(sum) -> R"] == {"all_reduce": 1, "all_reduce:float16": 1}
    for case in ("[5, 6] float32 P(sum) -> S(1)", "[6, 4] float32 P(avg) -> S(0)", "[4, 6] bfloat16 P(avg) -> S(1)",
                 "[6, 4] float16 P(sum) -> S(0)"):
        assert by[case] == {"reduce_scatter": 1}, (case, by[case])
    assert all(not c["native"] for _, c in _cases(run, "gloo"))


def test_four_ranks_reshards_under_nccl(run):
    """reshard_worker's cases on 4 ranks (2-D meshes, a mesh [[3, 1], [2, 0]] whose order is not the groups',
    uneven shards) under "nccl": every shard and gradient equals the full tensor's, with the native calls."""
    ranks = shared_launch.results(JOB4)[1]
    bad = [(res["rank"], c["case"]) for res in ranks for c in res["reshards"] if not (c["ok"] and c["grad_ok"])]
    assert not bad, bad
    by = {c["case"]: c["calls"] for c in ranks[0]["reshards"]}
    assert by["[6, 6] mesh [[3, 1], [2, 0]] R,P(sum) -> S(0),S(1)"] == {"reduce_scatter": 1}
    assert by["[7, 6] mesh [[0, 1], [2, 3]] S(0),S(0) -> S(1),R"] == {"all_gather": 1, "alltoall": 1}
    assert by["[6, 8] mesh [0, 1, 2, 3] S(0) -> S(1)"] == {"alltoall": 1}
    assert all("send" not in c and "recv" not in c for c in by.values())


# ---- training -----------------------------------------------------------------------------------------------------
def _matches_one_process(out, ranks, name, reference):
    ref_losses, ref_params = reference
    for res in ranks:
        got = res["training"][name]["losses"]
        assert np.allclose(got, ref_losses, rtol=1e-5, atol=1e-5), (name, res["rank"], got, ref_losses)
    saved = np.load(pathlib.Path(out) / f"{name}.npz")
    assert np.allclose(saved["losses"], ref_losses, rtol=1e-5, atol=1e-5)
    bad = [n for n, v in ref_params.items() if not np.allclose(saved["param/" + n], v, rtol=1e-5, atol=1e-5)]
    assert not bad, f"{name}: parameters differ from one process: {bad}"


@pytest.mark.parametrize("name", RUNS)
def test_training_under_nccl_matches_one_process(run, reference, name):
    _matches_one_process(*run, name, reference)


@pytest.mark.parametrize("name", LOOPS)
def test_asynchronous_buckets_read_by_the_step_match_one_process(run, name):
    """With ``sync_op=False`` tasks that reduce only when waited for (a read before ``wait()`` sees the local
    gradient): global-norm clipping, two accumulation micro-steps, ``clip_grad_norm_`` by hand before the step."""
    m = build("gpt")
    opt = make_opt(name, m.parameters())
    _matches_one_process(*run, name, (loop(name, m, opt), parameters_np(m)))
    assert run[1][0]["training"][name]["calls"].get("all_reduce:async", 0) >= STEPS


@pytest.mark.parametrize("name", ["dp2_tp2_sp", "dp2_tp2_sp_zero2"])
def test_four_ranks_training_under_nccl_matches_one_process(reference, name):
    """DP 2 x TP 2 + SP (asynchronous buckets on the data groups [0, 2], [1, 3], reduce_scatters on the model
    groups), and with ZeRO-2 over the data groups."""
    out, ranks = shared_launch.results(JOB4)
    _matches_one_process(out, ranks, name, reference)
    calls = ranks[0]["training"][name]["calls"]
    assert calls.get("reduce_scatter", 0) >= 10 * STEPS
    assert calls.get("all_reduce:async", 0) == (STEPS if name == "dp2_tp2_sp" else 0)


def test_training_took_the_nccl_branches(run):
    calls = {name: run[1][0]["training"][name]["calls"] for name in RUNS}
    assert calls["dp2"].get("all_reduce:async", 0) == STEPS          # the bucket launched with sync_op=False
    for stage in (2, 3):
        for api in ("parallelize", "shard_optimizer"):
            assert calls[f"{api}_zero{stage}"].get("reduce_scatter", 0) == STEPS, (api, stage)
    for api in ("parallelize", "shard_optimizer"):
        assert "reduce_scatter" not in calls[f"{api}_zero1"]
    # sequence parallel: the gradient of every sequence gather is a native reduce_scatter along the sequence dim
    assert calls["tp2_sp"].get("reduce_scatter", 0) >= 10 * STEPS, calls["tp2_sp"]


def test_asynchronous_buckets_are_collectives_like_the_others(run):
    """The sync_op=False bucket launch goes through the transport: counted by ``count_collectives`` (and noted in
    the collective log, agreed in the strict mode, named by the watchdog) as gloo's synchronous one is."""
    for res in run[1]:
        t = res["training"]
        assert t["dp2"]["calls"]["all_reduce:async"] == STEPS
        assert t["dp2"]["logical"] == t["dp2_gloo"]["logical"], (t["dp2"]["logical"], t["dp2_gloo"]["logical"])


# ---- in process: the transport's native reduce_scatter ----------------------------------------------------------
class _TwoRankDist:
    """``paddle.distributed`` of a two-rank group seen from rank 0, whose peer holds ``peer``."""

    class ReduceOp:
        SUM, MAX, MIN, AVG = 0, 1, 2, 4

    def __init__(self, peer):
        self.peer, self.calls = peer, []

    def all_reduce(self, tensor, op=0, group=None, sync_op=True):
        self.calls.append("all_reduce")
        total = tensor + self.peer.astype(tensor.dtype)
        paddle.assign(total / 2 if op == self.ReduceOp.AVG else total, output=tensor)

    def reduce_scatter(self, tensor, tensor_list, op=0, group=None, sync_op=True):
        self.calls.append("reduce_scatter")
        mine = tensor_list[0]                       # rank 0 receives the reduction of every member's first part
        theirs = paddle.split(self.peer_front, 2, axis=0)[0]
        total = mine + theirs.astype(mine.dtype)
        paddle.assign(total / 2 if op == self.ReduceOp.AVG else total, output=tensor)


@pytest.mark.parametrize("axis,op", [(0, "sum"), (1, "sum"), (2, "sum"), (1, "avg"), (0, "avg")])
def test_native_reduce_scatter_along_any_axis(monkeypatch, axis, op):
    """NCCL has reduce_scatter for any layout: a P -> S(axis) reshard, the sequence-parallel gradient (axis 1) and
    avg run it natively, not as an all_reduce of the whole tensor (twice the bytes) and a slice."""
    rng = np.random.default_rng(axis)
    x, peer = (rng.standard_normal([4, 6, 2]).astype("float32") for _ in range(2))
    fake = _TwoRankDist(paddle.to_tensor(peer))
    fake.peer_front = paddle.moveaxis(fake.peer, axis, 0)
    t = T.RealTransport(0, "nccl")
    monkeypatch.setattr(T.RealTransport, "_dist", staticmethod(lambda: fake))
    monkeypatch.setattr(T.RealTransport, "_group", lambda self, ranks: None)
    got = t._reduce_scatter({0: paddle.to_tensor(x)}, [0, 1], op, axis)[0].numpy()
    full = (x + peer) / (2 if op == "avg" else 1)
    assert fake.calls == ["reduce_scatter"]
    np.testing.assert_allclose(got, np.split(full, 2, axis=axis)[0], rtol=1e-6)


def test_gloo_reduce_scatter_stays_emulated(monkeypatch):
    fake = _TwoRankDist(paddle.ones([4, 6]))
    t = T.RealTransport(0, "gloo")
    monkeypatch.setattr(T.RealTransport, "_dist", staticmethod(lambda: fake))
    monkeypatch.setattr(T.RealTransport, "_group", lambda self, ranks: None)
    got = t._reduce_scatter({0: paddle.zeros([4, 6])}, [0, 1], "sum", 1)[0].numpy()
    assert fake.calls == ["all_reduce"] and got.shape == (4, 3) and np.all(got == 1)


# ---- in process: host reads of the global-norm clip -------------------------------------------------------------
def _count_host_reads(monkeypatch) -> list:
    """Every read of a tensor's value to the host from now on (``float(t)``, ``bool(t)``, ``t.numpy()``, ...)."""
    reads = []
    for name in ("__float__", "__bool__", "__int__", "numpy", "item", "tolist"):
        original = getattr(paddle.Tensor, name)
        monkeypatch.setattr(paddle.Tensor, name, lambda self, *a, __o=original, __n=name, **k: (
            reads.append(__n), __o(self, *a, **k))[1])
    return reads


def _grads(values, bad=None):
    """Parameters holding ``values`` as gradients; ``bad``: (index, value) written into one gradient."""
    params = []
    for i, v in enumerate(values):
        p = paddle.create_parameter(list(v.shape), "float32")
        g = v.copy()
        if bad is not None and bad[0] == i:
            g.reshape(-1)[0] = bad[1]
        p.grad = paddle.to_tensor(g)
        params.append(p)
    return params


@pytest.mark.parametrize("bad", [None, (3, np.inf), (0, np.nan)])
def test_amp_overflow_checks_read_the_device_once(monkeypatch, bad):
    """AMP's overflow checks (the AmpOptimizer's ``found_inf`` and paddle GradScaler's ``unscale_and_check``) keep
    the per-gradient flags on the device and read the agreed flag once, not once per gradient."""
    from autoparallel.parallel import amp, amp_scaler

    rng = np.random.default_rng(1)
    values = [rng.standard_normal(s).astype("float32") for s in ([3, 4], [5], [2, 2, 2], [7, 1], [6])]
    params = _grads(values, bad)
    opt = paddle.optimizer.SGD(0.1, parameters=params)
    reads = _count_host_reads(monkeypatch)
    found = amp.found_inf(params)
    assert found is (bad is not None) and len(reads) <= 1, reads
    reads.clear()
    found = amp_scaler.unscale_and_check(opt, 0.5)
    assert found is (bad is not None) and len(reads) <= 1, reads
    monkeypatch.undo()
    np.testing.assert_array_equal(params[1].grad.numpy(), values[1] * 0.5)


def test_global_norm_reads_the_device_once_per_mesh(monkeypatch):
    """On a GPU every read of a device value to the host (``float(t)``, ``t.numpy()``) waits for the device: the
    global norm of many gradients is summed on the device and read once per mesh, with the value a float64 sum
    of the per-tensor float32 square sums gives."""
    import autoparallel as ap
    from autoparallel.parallel import clip

    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s).astype("float32") for s in ([3, 4], [5], [2, 2, 2], [7, 1], [6])]
    want = sum(clip.square_sum(paddle.to_tensor(v)) for v in values) ** 0.5     # per tensor, read one by one
    reads = _count_host_reads(monkeypatch)
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        terms = [({r: paddle.to_tensor(v) for r in (0, 1)}, mesh, set()) for v in values]
        reads.clear()
        norm = clip.global_norm(terms)
    assert len(reads) <= 1, reads
    assert norm == want


# ---- in process: a GPU's device moves -----------------------------------------------------------------------------
def test_to_another_device_is_refused_on_a_gpu_too(monkeypatch):
    """``x.to("cpu")`` of a distributed tensor whose shards are on a GPU moves nothing: refused by name, as
    ``x.cpu()`` is (it returned the GPU tensor itself: the device check assumed the default place was the CPU)."""
    import autoparallel as ap

    with ap.simulate(world_size=2):
        x = ap.shard_tensor(paddle.ones([4]), ap.ProcessMesh([0, 1], dim_names=["x"]), [ap.Shard(0)])
        assert x.to("cpu") is x and x.to(paddle.CPUPlace()) is x       # already there (this machine's CPU)
        monkeypatch.setattr(paddle.device, "get_device", lambda: "gpu:0")     # the shards' device: a GPU
        for where in ("cpu", paddle.CPUPlace()):
            with pytest.raises(NotImplementedError, match="another device"):
                x.to(where)


# ---- in process: which backend a launched rank's world reports -----------------------------------------------------
@pytest.mark.parametrize("device,initialized,group_backend,expected", [
    ("gpu:0", False, None, "nccl"),         # before init_parallel_env: read from the device
    ("cpu", False, None, "gloo"),
    ("gpu:0", True, "NCCL", "nccl"),
    ("gpu:0", True, "GLOO", "gloo"),        # gloo on GPUs: the emulations, not NCCL-only calls that gloo refuses
    ("xpu:0", True, "BKCL", "gloo"),        # another backend: the conservative table (emulated, exact reductions)
    ("cpu", True, "GLOO", "gloo"),
])
def test_the_world_reports_the_default_groups_backend(monkeypatch, device, initialized, group_backend, expected):
    import paddle.distributed as dist

    from autoparallel.comm.world import RealWorld

    monkeypatch.setattr(paddle, "get_device", lambda: device)
    monkeypatch.setattr(dist, "is_initialized", lambda: initialized)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: group_backend)
    assert RealWorld().backend == expected


@pytest.mark.parametrize("backend,own_store", [("GLOO", True), ("NCCL", False)])
def test_the_gloo_store_workaround_leaves_other_backends_groups_to_paddle(monkeypatch, backend, own_store):
    """Each new gloo group gets its own TCPStore (paddle 3.3.1's gloo groups collide on the global store's keys);
    a group of another backend is made by paddle as it is, on paddle's store."""
    import paddle.distributed as dist

    from autoparallel import compat, patches
    from autoparallel.comm import groups

    made, seen = [], []

    class Store:
        def set(self, key, value):
            seen.append("published")

        def get(self, key):
            return b"127.0.0.1:1"

    def fake_new_group(ranks=None, *args, **kwargs):
        made.append(list(ranks))
        return "group"

    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "127.0.0.1:6170,127.0.0.1:6171")
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(compat, "TCPStore", lambda *a: seen.append("own store") or "store")
    monkeypatch.setattr(compat, "default_store", lambda: Store())
    monkeypatch.setattr(compat, "set_default_store", lambda s: None)
    monkeypatch.setattr(dist, "new_group", fake_new_group)
    monkeypatch.setattr(groups, "_STORE_FIX", [False])
    groups.install_group_store_fix()
    try:
        assert dist.new_group([0, 1]) == "group" and made == [[0, 1]]
        assert (seen == ["own store"]) is own_store, seen
    finally:
        patches.put_back(dist, "new_group", fake_new_group)     # the ledger forgets the patch; monkeypatch undoes
