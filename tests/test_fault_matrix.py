"""Two cases of the fault matrix (tools/fault_matrix.py) on 2 real gloo ranks running the training example with
its default watchdog: a rank SIGSTOPped in the middle of a checkpoint save, and the rank hosting the TCP store
SIGKILLed in a backward. Every survivor exits non-zero naming the lost rank and its own operation in flight,
within 2 x the heartbeat timeout, and the previous checkpoint stays intact. (``--resume`` after each fault, bit
for bit against an uninterrupted run, is in the full matrix: docs/reliability.md.)"""
import re
import shutil
import tempfile

import pytest


from tools import fault_matrix

TIMEOUT = 4.0                   # AP_WATCHDOG_TIMEOUT of these runs (the README's matrix uses the default)
ENV = {"AP_WATCHDOG_TIMEOUT": str(TIMEOUT)}


@pytest.fixture(scope="module")
def base():
    path = tempfile.mkdtemp(prefix="ap_fault_test_")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _check_named(result, victim: int, op: str):
    assert result["fault_injected"], result
    run = result["run"]
    assert run["code"] != 0 and not run["timed_out"]
    for rank, message in result["messages"].items():
        assert message is not None, run["logs"][rank][-2000:]
        assert re.search(rf"rank {victim} (lost|reported)", message) or f"rank {victim} lost" in message, message
        assert "Exiting with code 75" in message and "This rank was in '" in message
    assert any(op in m for m in result["messages"].values()), result["messages"]
    assert result["seconds_to_all_exited"] is not None
    assert result["seconds_to_all_exited"] <= 2 * TIMEOUT + 3.0, result["per_rank"]


def test_a_rank_frozen_in_a_save_is_named(base):
    result = fault_matrix.run_case(base, "save", "stop", 1, 2, env=ENV)
    _check_named(result, 1, "checkpoint rendezvous")
    message = result["messages"][0]
    assert "is stopped (SIGSTOP?); it was last in 'checkpoint write'" in message, message
    assert result["seconds_to_all_exited"] >= TIMEOUT - 2.0, result["per_rank"]    # a stopped rank may resume
    assert result["after"]["complete"] == [2] and result["after"]["verified"] == {2: True}
    assert len(result["after"]["partial"]) <= 1


def test_the_store_host_killed_in_a_backward_is_named_at_once(base):
    result = fault_matrix.run_case(base, "backward", "kill", 0, 2, env=ENV)
    _check_named(result, 0, "all_reduce")
    message = result["messages"][1]
    assert "rank 0 lost: the TCP store at" in message and "hosted by rank 0 is unreachable" in message, message
    assert result["seconds_to_all_exited"] <= TIMEOUT, result["per_rank"]
    assert result["after"]["complete"] == [2] and result["after"]["verified"] == {2: True}
