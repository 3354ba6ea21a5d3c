"""The test kinds (autoparallel/testing/markers.py): dist when a test's own code starts processes, sim when it
runs ap.simulate, pure otherwise -- followed through helpers, fixtures and tables of functions; the
transport counter's view of one real rank."""
import subprocess

import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.comm.counter import _Counting, count_collectives
from autoparallel.planner import calibrate
from autoparallel.testing.markers import classify, kind_of_source, python_command

# the sample functions below name launchers and ap.simulate but the tests only read them: pure by declaration
pytestmark = pytest.mark.pure


def _starts_a_process():
    subprocess.run(["true"])


def _simulates():
    with ap.simulate(world_size=2):
        pass


def _calls_helper_that_simulates():
    return _simulates()


def _plain():
    return np.zeros(3)


TABLE = [_plain, _starts_a_process]


def _runs_the_table():
    return [f() for f in TABLE]


def _runs_calibration():
    return calibrate.run_ranks(2, [1024], repeat=1)


def test_kind_follows_helpers_tables_and_package_launchers():
    assert classify(_plain) == "pure"
    assert classify(_simulates) == "sim"
    assert classify(_calls_helper_that_simulates) == "sim"
    assert classify(_runs_the_table) == "dist"
    assert classify(_runs_calibration) == "dist"
    assert classify(_plain, fixtures=[_simulates]) == "sim"          # a fixture's code counts
    assert classify(_simulates, fixtures=[_starts_a_process]) == "dist"


def test_kind_of_source_and_python_commands():
    assert kind_of_source("launch(script, 4)") == "dist" and kind_of_source("self._launch(i)") == "pure"
    assert kind_of_source("with ap.simulate(world_size=4):") == "sim"
    assert python_command(["python3", "-c", "pass"]) == "python3 -c pass"
    assert python_command(["sleep", "30"]) is None


class _OneRank:
    """A real rank's transport (rank 1 of 4) that moves nothing."""
    backend, rank = "gloo", 1

    def send_recv(self, xs, pairs, recv_like):
        return {}

    def all_reduce(self, xs, ranks, op):
        return xs


def test_a_real_rank_counts_the_pairs_it_takes_part_in():
    t = _Counting(_OneRank())
    like = {d: ([2, 3], "float32") for d in range(4)}
    x = paddle.zeros([2, 3], dtype="float32")
    with count_collectives() as log:
        t.send_recv({1: x}, [(1, 2), (0, 3), (3, 1), (2, 2)], like)
        t.all_reduce({1: x}, [1, 3], "sum")
    assert [(c.kind, c.group, c.nbytes) for c in log.calls] == [
        ("send_recv", (1, 2), 24), ("send_recv", (1, 3), 24), ("all_reduce", (1, 3), 24)]
    assert log.counts(rank=1) == {"send_recv": 2, "all_reduce": 1} and log.counts(rank=0) == {}
    assert log.bytes_sent(rank=1) == 24 + 24 + 24          # all_reduce over 2: 2 (n-1)/n b = b
