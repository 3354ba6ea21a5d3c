import functools
import gc
import os
import subprocess
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from autoparallel.testing.markers import KINDS, classify, python_command  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOTS = (TESTS, os.path.join(os.path.dirname(TESTS), "tools"))     # where a test's own code lives


def pytest_collection_modifyitems(config, items):
    """Every test gets one of the markers pure / sim / dist (autoparallel/testing/markers.py: dist starts
    processes, sim runs ``ap.simulate``, pure neither); a module's own ``pytestmark`` kind is kept."""
    for item in items:
        if any(item.get_closest_marker(k) for k in KINDS):
            continue
        fn = getattr(item, "function", None)
        if fn is None:
            continue
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}) or {}
        fixtures = tuple(d.func for ds in defs.values() for d in ds)
        if (fn, fixtures) not in _KIND:                   # parametrized items share their function's kind
            _KIND[fn, fixtures] = classify(fn, fixtures, ROOTS)
        item.add_marker(getattr(pytest.mark, _KIND[fn, fixtures]))


_KIND: dict = {}


def pytest_collection_finish(session):
    """The real-rank jobs that share a launch (dist_scripts/shared_launch.py) run for the modules with a selected
    dist test only."""
    from dist_scripts import shared_launch

    shared_launch.select_modules({item.module.__name__ for item in session.items
                                  if getattr(item, "module", None) and item.get_closest_marker("dist")})


def pytest_sessionfinish(session):
    """An xdist worker hands its launches and job timings to the controller (``pytest_testnodedown``)."""
    from dist_scripts import shared_launch

    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["shared_launch"] = (list(shared_launch.launches), dict(shared_launch.timings),
                                                            dict(shared_launch.cpu_timings))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``make test`` runs on two pytest-xdist workers with ``--dist loadscope``; the units and their order are
    ``xdist_units.py``'s: the tests reading shared real-rank jobs' results are one unit (one worker makes each
    world size's one launch), every other test is in its module's unit, and the costliest units start first."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    import xdist_units

    class SharedLaunchScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return xdist_units.scope(nodeid)

        def _assign_work_unit(self, node):
            if not getattr(self, "_by_cost", False):      # once, before the first unit goes out
                self._by_cost = True
                order = sorted(self.workqueue.items(), key=lambda kv: -xdist_units.cost(kv[1]))
                self.workqueue.clear()
                self.workqueue.update(order)
            super()._assign_work_unit(node)

    return SharedLaunchScheduling(config, log)


@pytest.hookimpl(optionalhook=True)          # an xdist hook: pytest without xdist must not reject it
def pytest_testnodedown(node, error):
    from dist_scripts import shared_launch

    launches, timings, cpu = getattr(node, "workeroutput", {}).get("shared_launch", ([], {}, {}))
    shared_launch.launches.extend(tuple(x) for x in launches)
    shared_launch.timings.update(timings)
    shared_launch.cpu_timings.update(cpu)


def pytest_terminal_summary(terminalreporter):
    from dist_scripts import shared_launch

    for nproc, jobs, wall in shared_launch.launches:
        terminalreporter.write_line(f"shared launch: {jobs} jobs on {nproc} ranks in {wall:.0f} s")
    if shared_launch.timings:
        terminalreporter.write_line("shared launch jobs (s, slowest rank): " + ", ".join(
            f"{name} {s:.0f}" for name, s in sorted(shared_launch.timings.items(), key=lambda x: -x[1])))
    if shared_launch.cpu_timings:
        terminalreporter.write_line("shared launch jobs (CPU s, all ranks): " + ", ".join(
            f"{name} {s:.0f}" for name, s in sorted(shared_launch.cpu_timings.items(), key=lambda x: -x[1])))


# ---- the rule checked while tests run: only a 'dist' test starts Python processes ------------------------------
_running = {"item": None, "started": {}}
_popen_init = subprocess.Popen.__init__


def _watched_init(self, args, *a, **k):
    cmd = python_command(args)
    item = _running["item"]
    if cmd is not None and item is not None:
        _running["started"].setdefault(item.nodeid, cmd)
    return _popen_init(self, args, *a, **k)


subprocess.Popen.__init__ = _watched_init


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running["item"] = item
    try:
        yield
    finally:
        _running["item"] = None


def pytest_runtest_teardown(item, nextitem):
    cmd = _running["started"].pop(item.nodeid, None)
    if cmd is not None and item.get_closest_marker("dist") is None:
        kinds = [k for k in KINDS if item.get_closest_marker(k)]
        pytest.fail(f"marked {kinds} but started a process ({cmd}): a test that starts processes is 'dist' "
                    f"(autoparallel/testing/markers.py: teach the rule or set pytestmark)", pytrace=False)


_module_seen = {"path": None}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """At each new test module: collect, then freeze what survives (``gc.freeze``). What earlier modules leave
    alive (paddle holds layers and tensors from C++ that nothing in Python reaches) otherwise piles up in a
    long-lived worker: every later cyclic collection walks it, and so does every ``gc.get_objects()`` walk of
    the library (``shard_layer``'s optimizer repointing, ``uninstall``'s check): a lazy-init case took 0.1 s alone,
    0.6 s after two modules, 2.2 s late in the suite (docs/test_suite.md). Frozen objects are not collected and not listed by ``gc.get_objects``;
    a module's own objects (its module-scope fixtures included) are made after its freeze and stay visible."""
    path = item.nodeid.split("::", 1)[0]
    if path != _module_seen["path"]:
        _module_seen["path"] = path
        gc.collect()
        gc.freeze()


def _reset_current_run():
    mod = sys.modules.get("autoparallel.auto_checkpoint")
    if mod is not None:
        mod.reset()


@pytest.fixture(autouse=True)
def _fresh_current_run():
    """Each test starts without a 'current run' left by another (the no-argument article calls act on it) and
    leaves none behind."""
    _reset_current_run()
    yield
    _reset_current_run()


@pytest.fixture(autouse=True)
def _no_retained_graphs_left():
    """A test that backwarded with ``retain_graph=True`` leaves no held graph to the next: while one is held, the
    next backward passes walk their graphs from ``grad_fn``, which keeps those graphs (and the models they reach)
    alive in paddle 3.3 (autoparallel/retained_graph.py), and the leak tests of a later test would count them."""
    yield
    mod = sys.modules.get("autoparallel.retained_graph")
    if mod is not None:
        mod._HELD.clear()


@pytest.fixture
def scratch_rule():
    """A list of the SPMD rule names a test registers: unregistered after the test."""
    from spmd_rules import unregister_spmd_rule

    names = []
    yield names
    for n in names:
        unregister_spmd_rule(n)
