"""The shared launches of the real-rank tests (dist_scripts/shared_launch.py, bundle_worker.py): a script runs in a
bundle as it runs alone (argv, environment, one write_result), each job's result or error reaches its own tests,
the jobs after a failed one run again, a job past its own deadline stops the launch."""
import os
import textwrap

import pytest

from autoparallel.testing.launch import Job as Launched
from dist_scripts import bundle_worker, shared_launch

SCRIPT = '''
import os, sys
from autoparallel.testing.launch import write_result
{body}
'''


def script(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(SCRIPT.format(body=textwrap.dedent(body)))
    return str(path)


@pytest.fixture
def registry(monkeypatch):
    """A fresh outcome table: the session's own shared jobs are left alone."""
    monkeypatch.setattr(shared_launch, "_outcome", {})
    monkeypatch.setattr(shared_launch, "timings", {})
    monkeypatch.setattr(shared_launch, "cpu_timings", {})
    return shared_launch._outcome


# ---- one script inside the bundle worker ---------------------------------------------------------------------
def test_a_script_runs_as_main_with_its_argv_and_env_and_leaves_neither(tmp_path, monkeypatch):
    monkeypatch.delenv("AP_TEST_X", raising=False)
    path = script(tmp_path, "echo", 'write_result({"argv": sys.argv[1:], "x": os.environ["AP_TEST_X"], '
                                    '"main": __name__})')
    argv = list(os.sys.argv)
    got = bundle_worker.run({"name": "echo", "script": path, "args": ["a", 2], "env": {"AP_TEST_X": "7"}})
    assert got == {"argv": ["a", "2"], "x": "7", "main": "__main__"}
    assert "AP_TEST_X" not in os.environ and os.sys.argv == argv


@pytest.mark.parametrize("body,match", [("write_result(1)\nwrite_result(2)", "reported 2 results"),
                                        ("pass", "reported 0 results"),
                                        ("write_result(1)\nsys.exit(3)", "exited with code 3"),
                                        ("raise KeyError('boom')", "boom")])
def test_a_script_that_does_not_report_once_is_an_error(tmp_path, body, match):
    with pytest.raises((RuntimeError, KeyError), match=match):
        bundle_worker.run({"name": "s", "script": script(tmp_path, "s", body), "args": []})


def test_a_clean_sys_exit_is_success(tmp_path):
    path = script(tmp_path, "ok", "write_result(5)\nsys.exit(0)")
    assert bundle_worker.run({"name": "ok", "script": path, "args": []}) == 5


# ---- collecting a launch's outcome ----------------------------------------------------------------------------
def jobs(*names, timeout=10.0):
    return [shared_launch.Job("m", n, f"{n}.py", 2, timeout=timeout) for n in names]


def launched(results, tails="", stopped=None, codes=(0, 0)):
    return Launched("bundle_worker.py", 2, list(codes), results, tails, "", stopped)


def test_every_finished_job_gets_its_results_and_the_failed_one_its_traceback(registry):
    a, b, c = jobs("a", "b", "c")
    res = launched([{"done": {"a": 1}, "failed": "b", "error": "Traceback\nValueError: rank 0 broke"},
                    {"done": {"a": 2}, "failed": None}], codes=(1, 1))
    rest = shared_launch._collect([a, b, c], res, {"a": "/out/a", "b": "/out/b", "c": "/out/c"}, {"b": 0})
    assert rest == [c]
    assert registry["a"] == ("/out/a", [1, 2])
    assert "ValueError: rank 0 broke" in registry["b"] and "--- rank 0" in registry["b"] and "c" not in registry


def test_a_gloo_start_up_failure_is_retried_then_reported(registry):
    a, b = jobs("a", "b")
    flakes = {"a": 0, "b": 0}
    res = launched([None, None], tails="pair.cc: Connection refused", codes=(1, 1))
    for attempt in range(1, shared_launch.ATTEMPTS):
        assert shared_launch._collect([a, b], res, {}, flakes) == [a, b] and registry == {}
    assert shared_launch._collect([a, b], res, {}, flakes) == [b]
    assert "Connection refused" in registry["a"]


def test_a_reported_exception_is_a_failure_even_when_peers_log_a_lost_connection(registry):
    a, b = jobs("a", "b")
    res = launched([{"done": {}, "failed": "a", "error": "ValueError: broken"}, None],
                   tails="rank 0: Connection refused", codes=(1, 1))
    assert shared_launch._collect([a, b], res, {}, {"a": 0}) == [b]
    assert "ValueError: broken" in registry["a"]


def test_a_stopped_launch_names_the_job_that_overran(registry):
    a, b = jobs("a", "b")
    res = launched([{"done": {"a": 0}}, {"done": {"a": 0}}], stopped="stopped: job 'b' ran past its 10 s",
                   codes=(-9, -9))
    assert shared_launch._collect([a, b], res, {"a": "/a", "b": "/b"}, {"b": 0}) == []
    assert "job 'b' ran past its 10 s" in registry["b"] and registry["a"] == ("/a", [0, 0])


def test_each_job_has_its_own_deadline_from_when_a_rank_starts_it(tmp_path, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(shared_launch.time, "monotonic", lambda: now[0])
    watch = shared_launch._Deadlines(jobs("a", "b", timeout=10.0))

    def at(*index):
        for r, i in enumerate(index):
            (tmp_path / f"progress.rank{r}").write_text(str(i))
        return watch(str(tmp_path))

    now[0] = 109.0
    assert at(0, 0) is None
    now[0] = 109.5
    assert at(1, 0) is None                   # rank 0 starts b at 109.5; rank 1 still in a
    now[0] = 110.5
    assert "job 'a' ran past its 10 s" in at(1, 0)
    now[0] = 119.0
    assert at(1, 1) is None                   # b counts from 109.5
    now[0] = 120.0
    assert "job 'b' ran past its 10 s" in at(1, 1)
    assert at(2, 2) is None                   # all done


# ---- on real ranks ----------------------------------------------------------------------------------------------
def test_real_ranks_a_failing_job_is_reported_and_the_jobs_after_it_run_again(tmp_path, registry, monkeypatch):
    """2 gloo ranks: the middle job raises on rank 1 only while rank 0 goes on into the next job's collective;
    the launch ends (no hang), the first job's results and the failure's traceback are kept, and the last job
    runs in a second launch."""
    monkeypatch.setattr(shared_launch, "launches", [])
    ok = script(tmp_path, "ok", "import paddle.distributed as dist\nwrite_result(dist.get_rank())")
    # both ranks meet first: rank 1 fails only once rank 0 has recorded "ok" (a loaded machine let rank 1 finish
    # "ok" and fail before rank 0 had finished "ok", whose results then died with the launch)
    boom = script(tmp_path, "boom", """
        import paddle, paddle.distributed as dist
        dist.all_reduce(paddle.to_tensor([1.0]))
        if dist.get_rank() == 1:
            raise ValueError("rank 1 broke on purpose")
        write_result("survived")""")
    total = script(tmp_path, "total", """
        import paddle, paddle.distributed as dist
        x = paddle.to_tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(x)
        write_result(float(x))""")
    first, middle, last = (shared_launch.Job("m", n, p, 2, timeout=120.0)
                           for n, p in (("ok", ok), ("boom", boom), ("total", total)))
    shared_launch._run_bundle([first, middle, last])
    assert registry["ok"][1] == [0, 1]
    assert "ValueError: rank 1 broke on purpose" in registry["boom"] and "--- rank 1" in registry["boom"]
    assert registry["total"][1] == [3.0, 3.0]
    assert [(n, k) for n, k, _ in shared_launch.launches] == [(2, 3), (2, 1)]
