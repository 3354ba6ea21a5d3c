"""DeepSpeed's pipeline schedule simulated event by event (TrainSchedule's instruction order, blocking
rendezvous transfers) against the planner's pricing of it: (m + p - 1)·(t_f + t_b) plus
pp_sends_per_step(serial=True) transfers on the critical path."""
import numpy as np
import pytest

from autoparallel.planner.cost_model import pp_sends_per_step


def _train_schedule(s, p, m):
    """Stage ``s``'s instructions, as deepspeed/runtime/pipe/schedule.py TrainSchedule.steps emits them."""
    out, prev = [], -1
    for k in range(2 * (m + p - 1)):
        forward = k % 2 == s % 2
        if forward:
            j = (k // 2 if k % 2 == 0 else (k - 1) // 2) - s // 2
        else:
            j = k // 2 - p + (s + 1) // 2 if k % 2 == 0 else (k - 1) // 2 - p + 1 + s // 2
        if forward and s > 0:
            out += [("send_grad", s - 1, prev)] * (0 <= prev < m) + [("recv_act", s - 1, j)] * (0 <= j < m)
        if not forward and s < p - 1:
            out += [("recv_grad", s + 1, j)] * (0 <= j < m) + [("send_act", s + 1, prev)] * (0 <= prev < m)
        if 0 <= j < m:
            out.append(("F" if forward else "B", None, j))
        prev = j
    return out


PARTNER = {"send_grad": "recv_grad", "recv_grad": "send_grad", "send_act": "recv_act", "recv_act": "send_act"}


def simulate(p, m, t_f, t_b, t_send):
    """Step time: each stage runs its instructions in order; a transfer starts when both ends reach it."""
    prog = [_train_schedule(s, p, m) for s in range(p)]
    at, clock = [0] * p, [0.0] * p
    while any(at[s] < len(prog[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while at[s] < len(prog[s]):
                op, peer, j = prog[s][at[s]]
                if op in ("F", "B"):
                    clock[s] += t_f[s] if op == "F" else t_b[s]
                elif at[peer] < len(prog[peer]) and prog[peer][at[peer]] == (PARTNER[op], s, j):
                    clock[s] = clock[peer] = max(clock[s], clock[peer]) + t_send
                    at[peer] += 1
                else:
                    break
                at[s] += 1
                moved = True
        assert moved, "the schedule deadlocked"
    return max(clock)


@pytest.mark.parametrize("p,m", [(4, 32), (8, 16), (6, 6)])
def test_uniform_stages_without_transfers_are_one_f_one_b(p, m):
    assert simulate(p, m, [1.0] * p, [3.0] * p, 0.0) == pytest.approx((m + p - 1) * 4.0)


@pytest.mark.parametrize("p,m,heavier", [(4, 32, 0.0), (8, 16, 0.0), (8, 16, 0.07)])
def test_serial_transfers_are_priced_as_the_schedule_runs_them(p, m, heavier):
    t_f, t_b, c = [1.0] * p, [3.0] * p, 0.08
    t_f[-1] *= 1 + heavier
    t_b[-1] *= 1 + heavier                      # the last stage carries the head
    sim = simulate(p, m, t_f, t_b, c)
    t_max, total = 4.0 * (1 + heavier), sum(f + b for f, b in zip(t_f, t_b))
    compute = m * t_max + (total - t_max)       # the planner's m·t_max + bubble
    serial = compute + pp_sends_per_step(np.array([p]), 1, np.array([m]), serial=True)[0] * c
    batched = compute + pp_sends_per_step(np.array([p]), 1, np.array([m]))[0] * c
    assert 0.95 * serial <= sim <= serial * (1 + 1e-12)      # priced within 5%, never below the schedule
    if not heavier:                                         # (uneven stages hide part of the transfers in slack)
        assert sim > batched                                # negative control: Megatron's batched count is short
