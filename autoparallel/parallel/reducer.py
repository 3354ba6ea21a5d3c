"""Gradient reductions launched from backward hooks, bucket by bucket, in backward order.

A Reducer holds buckets of parameters in launch order and hooks every local tensor of them (every held
rank's in the simulated world):

* after the tensor's gradient is accumulated (``Tensor._register_backward_hook``: once per backward pass,
  also for a parameter used twice, whose uses autograd sums first) it counts the gradient. When every
  held rank of every parameter of the next bucket has its ``expected`` count (one per backward pass,
  ``gradient_accumulation_steps`` per optimizer step) the owner's ``launch(i, params)`` runs: buckets
  launch strictly in order, so every rank issues the same collectives in the same order, and nothing is
  launched on non-final accumulation micro-steps;
* before a gradient is accumulated (``Tensor.register_hook``) into a parameter already reduced (more
  backward passes than expected, or a backward after the step without ``clear_grad``) it asks the owner
  to turn the reduced value back into partial sums (``to_partial(p)``) and reduces the parameter again
  later, so the result is right either way.

``flush()`` (the optimizer step) reduces what backward did not (a bucket holding a parameter that got no
gradient, and the buckets after it), waits for every launch and starts a new window; a second flush
without new gradients does nothing. ``reset()`` (``clear_grad``) forgets the window. A count seen above
``expected`` in a window raises ``expected`` for the next ones. Launches on a backend that overlaps
(``sync_op=False`` on NCCL) are waited for when the last bucket is launched (the end of backward), before
a parameter of theirs is touched again, and at ``flush()``.
"""
from __future__ import annotations

import weakref

import paddle

from autoparallel.comm.world import current_world
from autoparallel.compat import SideData, register_after_accumulate_hook
from autoparallel.local_mode import local_mode
from autoparallel.no_sync import suspended


class Reducer:
    def __init__(self, buckets, launch, to_partial, expected: int = 1):
        if not isinstance(expected, int) or isinstance(expected, bool) or expected < 1:
            raise ValueError(f"expected gradients per step must be an int >= 1, got {expected!r}")
        self.buckets = [list(b) for b in buckets]
        self._launch, self._to_partial = launch, to_partial
        world = current_world()
        self._held = {id(p): world.local_ranks(p.mesh.process_ids) for b in self.buckets for p in b}
        self._where = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.expected = {id(p): expected for b in self.buckets for p in b}
        self._pending: dict = {}
        self._reduced: set = set()          # ids whose gradient holds its reduced value
        for b in self.buckets:
            for p in b:
                for r in self._held[id(p)]:
                    _attach(p.locals[r], self, p, r)
        self._new_window()

    # ---- windows ------------------------------------------------------------------------------------------
    def _new_window(self) -> None:
        self._counts: dict = {}
        for b in self.buckets:
            for p in b:
                for r in self._held[id(p)]:
                    _hook(p.locals[r])
        self._left = None                   # counted when backward starts (parameters frozen by then)
        self._next = 0
        self.launches: list = []            # (bucket index, or None for a subset, "backward" | "step")

    def reset(self) -> None:
        """The gradients were cleared."""
        self._wait()
        self._reduced.clear()
        self._new_window()

    def mark_reduced(self) -> None:
        """Every gradient holds its reduced value (the owner just reduced them all)."""
        self._reduced = set(self._where)

    def flush(self) -> int:
        """Reduce every gradient not reduced yet (whole buckets as planned, the rest together), wait for
        every launch; returns the number of launches."""
        launched = len(self.launches)
        for i in range(self._next, len(self.buckets)):
            if not any(id(p) in self._reduced for p in self.buckets[i]):
                self._start(i, "step")
        rest = [p for b in self.buckets for p in b if id(p) not in self._reduced]
        if rest:
            self._pending[None] = self._launch(None, rest)
            self._reduced |= {id(p) for p in rest}
            self.launches.append((None, "step"))
        self._wait()
        self._learn()
        n = len(self.launches) - launched
        self._new_window()
        return n

    def _learn(self) -> None:
        for b in self.buckets:
            for p in b:
                seen = max((self._counts.get((id(p), r), 0) for r in self._held[id(p)]), default=0)
                self.expected[id(p)] = max(self.expected[id(p)], seen)

    def detach(self) -> None:
        """Stop reacting to gradients (a new Reducer took over)."""
        self._wait()
        for b in self.buckets:
            for p in b:
                for r in self._held[id(p)]:
                    t = p.locals[r]
                    slot = _SLOTS.get(t)
                    if slot is not None and slot[0]() is self:
                        _SLOTS.set(t, None)

    # ---- hooks --------------------------------------------------------------------------------------------
    # called from autograd's hooks on every gradient: the common case (nothing reduced yet, no bucket
    # complete) only counts; local tensors and no recording only where something runs
    def before_accumulate(self, p, r) -> None:
        if id(p) not in self._reduced:
            return
        with local_mode(), paddle.no_grad():
            self._wait(self._where[id(p)])
            self._to_partial(p)
        self._reduced.discard(id(p))

    def _count_left(self) -> list:
        """Gradients each bucket waits for: its trainable tensors'. A frozen one (``stop_gradient``) gets
        none; one unfrozen since the window began has no hooks yet (paddle refuses hooks on a frozen tensor;
        they are added at the next window), so its bucket waits for the step this time."""
        return [sum(not p.locals[r].stop_gradient for p in b for r in self._held[id(p)]) for b in self.buckets]

    def after_accumulate(self, p, r) -> None:
        if suspended(p):                    # a backward inside model.no_sync(): not synchronised (no_sync.py)
            return
        if self._left is None:
            self._left = self._count_left()
        key = (id(p), r)
        c = self._counts[key] = self._counts.get(key, 0) + 1
        i = self._where[id(p)]
        if c == self.expected[id(p)] and i >= self._next:
            self._left[i] -= 1
            if self._left[self._next] == 0:
                with local_mode(), paddle.no_grad():
                    self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            self._start(self._next, "backward")
        if self._next == len(self.buckets):
            self._wait()                # the last bucket: backward is over, finish every launch

    # ---- launches -----------------------------------------------------------------------------------------
    def _start(self, i, phase) -> None:
        self._next = i + 1
        self._pending[i] = self._launch(i, self.buckets[i])
        self._reduced |= {id(p) for p in self.buckets[i]}
        self.launches.append((i, phase))

    def _wait(self, i="all") -> None:
        keys = list(self._pending) if i == "all" else [i] if i in self._pending else []
        for k in keys:
            handle = self._pending.pop(k)
            if handle is not None:
                handle.wait()


# ---- hook slots: one pair of hooks per tensor, pointing at the current Reducer -------------------------------
# a local tensor's slot: (weakref to the Reducer, weakref to the parameter, rank) or None when detached; a tensor
# is in _HOOKED once its hooks are registered (they stay for its lifetime and read the slot)
_SLOTS = SideData()


_HOOKED = SideData()                    # local tensors whose hooks are registered


def _hook(t) -> None:
    """Register ``t``'s hooks (once; not while it is frozen: paddle refuses hooks on a stop_gradient tensor)."""
    if t.stop_gradient or t in _HOOKED:
        return
    _HOOKED.set(t, True)
    ref = weakref.ref(t)
    t.register_hook(lambda g: _fire(ref, "before_accumulate"))
    register_after_accumulate_hook(t, lambda: _fire(ref, "after_accumulate"))


def _attach(t, reducer, p, r) -> None:
    _SLOTS.set(t, (weakref.ref(reducer), weakref.ref(p), r))


def _fire(ref, what):
    t = ref()
    slot = _SLOTS.get(t) if t is not None else None
    if slot is None:
        return None
    reducer, p = slot[0](), slot[1]()
    if reducer is not None and p is not None:
        getattr(reducer, what)(p, slot[2])
    return None
