"""Dispatch is a reversible mode: ``ap.install()`` returns a handle whose ``uninstall()`` puts back every name
autoparallel patched in paddle (enumerated here independently of the patch ledger: every module attribute and
class attribute whose value changed to a function defined in autoparallel), and installing again works."""
import sys
import types

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel import dispatch_handle, patches

_OWN = ("autoparallel", "spmd_rules", "reshard")


def _classes():
    from paddle.amp import grad_scaler as gs
    from paddle.jit.dy2static.program_translator import StaticFunction
    from paddle.nn.initializer.initializer import Initializer

    return [paddle.Tensor, StaticFunction, Initializer, gs.AmpScaler, gs.GradScaler]


def _snapshot(extra=()) -> dict:
    """(owner, name) -> value of every attribute of every loaded non-autoparallel module and of the patched
    classes and objects."""
    snap = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or name.split(".", 1)[0] in _OWN:
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for k, v in items:
            snap[(name, k)] = v
    for owner in _classes() + list(extra):
        for k, v in list(vars(owner).items()):
            snap[(id(owner), k)] = v
    return snap


def _ours(v) -> bool:
    mod = getattr(v, "__module__", None) or ""
    return mod.split(".", 1)[0] in _OWN


_GONE = object()


def test_uninstall_restores_every_patched_name(monkeypatch):
    was = dispatch_handle.installed()
    ap.uninstall(force=True)
    user = types.ModuleType("user_model_lib")          # a library that imported ops by name
    user.relu, user.swiglu, user.matmul = F.relu, F.swiglu, paddle.matmul
    monkeypatch.setitem(sys.modules, "user_model_lib", user)
    layer = paddle.nn.TransformerEncoderLayer(8, 2, 16)  # holds F.relu as an attribute
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "127.0.0.1:1")
    before = _snapshot([layer])
    try:
        handle = ap.install()
        from autoparallel.comm.groups import install_group_store_fix
        install_group_store_fix()                          # paddle.distributed.new_group (launched jobs)
        from autoparallel.monitor import _comm_timer
        _comm_timer.install()                              # the monitor's collective timer
        assert paddle.distributed.all_reduce is not before[("paddle.distributed", "all_reduce")]
        during = _snapshot([layer])
        patched = {k for k, v in during.items() if before.get(k, _GONE) is not v and _ours(v)}
        assert len(patched) > 1000 and len(patches.recorded()) >= len(patched)
        for key in [("paddle", "matmul"), ("paddle.nn.functional", "linear"), ("user_model_lib", "relu"),
                    ("user_model_lib", "swiglu"), ("paddle.distributed", "new_group"),
                    (id(paddle.Tensor), "__add__"), (id(paddle.Tensor), "add_"), (id(paddle.Tensor), "float"),
                    (id(paddle.Tensor), "__setitem__"), (id(_classes()[1]), "__call__"),
                    (id(_classes()[2]), "_lazy_init"), (id(_classes()[4]), "scale"), (id(layer), "activation"),
                    ("paddle", "is_tensor"), ("paddle", "sort")]:            # sort: a guarded callable
            assert key in patched, key
        assert handle.installed and dispatch_handle.installed()
        restored = handle.uninstall(force=True)
        assert restored >= len(patched)
        after = _snapshot([layer])
        wrong = [k for k in patched if after.get(k, _GONE) is not before.get(k, _GONE)]
        assert wrong == []
        assert not any(_ours(getattr(paddle.Tensor, n, None)) for n in dir(paddle.Tensor) if not n.startswith("__"))
        assert user.relu is F.relu and paddle.distributed.new_group.__module__.startswith("paddle")
        assert paddle.distributed.all_reduce is before[("paddle.distributed", "all_reduce")]   # wraps keep __module__
    finally:
        if was:
            ap.install()


def test_disttensor_op_after_uninstall_raises_then_entry_point_reinstalls():
    was = dispatch_handle.installed()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        x = np.arange(8, dtype="float32").reshape(4, 2)
        dt = ap.shard_tensor(paddle.to_tensor(x), mesh, [ap.Shard(0)])
        np.testing.assert_allclose((dt * 2).numpy(), x * 2)
        ap.uninstall(force=True)
        assert paddle.matmul.__module__.startswith("paddle")
        with pytest.raises(RuntimeError, match="uninstalled"):
            dt * 2
        with pytest.raises(RuntimeError, match="uninstalled"):
            dt.add_(dt)
        dt2 = ap.shard_tensor(paddle.to_tensor(x), mesh, [ap.Replicate()])     # an entry point installs again
        assert dispatch_handle.installed()
        np.testing.assert_allclose(paddle.matmul(dt, dt2.T).numpy(), x @ x.T, rtol=1e-6)
        np.testing.assert_allclose((dt + dt2).numpy(), 2 * x)
    if not was:
        ap.uninstall(force=True)


def test_dispatch_mode_context_restores_previous_state():
    was = dispatch_handle.installed()
    ap.uninstall(force=True)
    orig = paddle.matmul
    with ap.dispatch_mode(force=True) as handle:
        assert paddle.matmul is not orig and handle.installed
        with ap.dispatch_mode(force=True):         # nested: stays installed on the inner exit
            pass
        assert paddle.matmul is not orig
    assert paddle.matmul is orig and not dispatch_handle.installed()
    if was:
        ap.install()


def test_loss_fn_taken_before_install_is_routed():
    from autoparallel import dispatch

    was = dispatch_handle.installed()
    ap.uninstall(force=True)
    loss_fn = F.cross_entropy                          # the original, taken before dispatch is installed
    ap.install()
    routed = dispatch.routed_form(loss_fn)
    assert routed is not loss_fn and routed is F.cross_entropy
    assert dispatch.routed_form(np.sum) is np.sum
    if not was:
        ap.uninstall(force=True)


def test_ledger_restores_raw_descriptors_and_absent_names_and_holds_no_object():
    import gc

    class Base:
        def inherited(self):
            return "base"

    class Owner(Base):
        @staticmethod
        def static():
            return "static"

        @property
        def prop(self):
            return "prop"

    class Holder:
        pass

    raw_static, raw_prop = vars(Owner)["static"], vars(Owner)["prop"]
    holder = Holder()
    holder.op = F.relu
    mark = len(patches.recorded())
    patches.patch(Owner, "static", lambda: "patched")
    patches.patch(Owner, "prop", "patched")
    patches.patch(Owner, "inherited", lambda self: "patched")     # absent from Owner's own dict
    patches.patch(holder, "op", F.gelu)
    assert Owner.static() == "patched" and Owner().inherited() == "patched"
    assert len(patches.recorded()) == mark + 4
    del holder
    gc.collect()
    assert len(patches.recorded()) == mark + 3                     # the ledger kept no reference to it
    was = dispatch_handle.installed()
    ap.uninstall(force=True)
    assert vars(Owner)["static"] is raw_static and vars(Owner)["prop"] is raw_prop
    assert "inherited" not in vars(Owner) and Owner().inherited() == "base"
    if was:
        ap.install()


def test_an_install_failing_part_way_is_rolled_back(monkeypatch):
    from autoparallel import dispatch_install

    was = dispatch_handle.installed()
    ap.uninstall(force=True)
    orig = paddle.matmul
    real = dispatch_install.install_all

    def failing():
        real()                                      # everything patched, then a failure
        raise RuntimeError("boom")

    monkeypatch.setattr(dispatch_install, "install_all", failing)
    with pytest.raises(RuntimeError, match="boom"):
        ap.install()
    assert paddle.matmul is orig and not dispatch_handle.installed()
    monkeypatch.undo()
    if was:
        ap.install()


def test_an_op_bound_to_tensor_later_becomes_a_disttensor_method():
    """A library that binds a routed op as a new ``paddle.Tensor`` method after autoparallel was imported:
    the DistTensor method routes it too (and its in-place form); an unrelated new name does not."""
    from autoparallel.dist_tensor_ops import OpMethods, original

    paddle.Tensor.lib_tanh = original(paddle.tanh)
    paddle.Tensor.lib_tanh_ = original(paddle.Tensor.tanh_)
    try:
        with ap.simulate(world_size=2):
            mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
            x = np.linspace(-1, 1, 8, dtype="float32").reshape(4, 2)
            dt = ap.shard_tensor(paddle.to_tensor(x), mesh, [ap.Shard(0)])
            np.testing.assert_allclose(dt.lib_tanh().numpy(), np.tanh(x), rtol=1e-6)
            assert "lib_tanh" in vars(OpMethods)
            dt.lib_tanh_()
            np.testing.assert_allclose(dt.numpy(), np.tanh(x), rtol=1e-6)
            with pytest.raises(AttributeError):
                dt.no_such_method
    finally:
        for name in ("lib_tanh", "lib_tanh_"):
            delattr(paddle.Tensor, name)
            if name in vars(OpMethods):
                delattr(OpMethods, name)


def test_uninstall_refuses_while_a_layer_holds_distributed_parameters():
    """A DistParameter is a paddle tensor holding its shard: without dispatch paddle would compute on the shard
    silently, so uninstall refuses while a live layer holds one (force=True accepts it)."""
    ap.install()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        layer = paddle.nn.Linear(4, 6)
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(1)])
        name = layer.weight.name
        assert name in dispatch_handle._held_dist_params()
        with pytest.raises(RuntimeError, match="live layers hold .* distributed parameter"):
            ap.uninstall()
        assert dispatch_handle.installed() and paddle.matmul.__module__.startswith("autoparallel")
        with pytest.raises(TypeError, match="force"):
            ap.uninstall(force="yes")
        del layer
        assert name not in dispatch_handle._held_dist_params()


def test_a_block_patch_and_a_patch_put_back_leave_no_ledger_entry():
    owner = types.ModuleType("owner_lib")
    owner.f = orig = lambda: "paddle"
    n0 = len(patches.recorded())
    with patches.swapped(owner, {"f": lambda: "ours", "g": 1}):
        assert owner.f() == "ours" and owner.g == 1
        assert len(patches.recorded()) == n0 + 2             # undo() meanwhile would find them
    assert owner.f is orig and not hasattr(owner, "g") and len(patches.recorded()) == n0
    patches.patch(owner, "f", lambda: "again")
    patches.put_back(owner, "f", orig)
    assert owner.f is orig and len(patches.recorded()) == n0


def test_an_uninstall_inside_a_block_patch_is_not_reverted_by_its_exit():
    was = dispatch_handle.installed()
    owner = types.ModuleType("owner_lib")
    owner.f = orig = lambda: "paddle"
    patches.patch(owner, "f", lambda: "installed")
    try:
        with patches.swapped(owner, {"f": lambda: "block"}):
            assert owner.f() == "block"
            ap.uninstall(force=True)                         # while the block runs
            assert owner.f is orig
        assert owner.f is orig                               # the exit must not put the undone patch back
    finally:
        patches.put_back(owner, "f", orig)
        if was:
            ap.install()
