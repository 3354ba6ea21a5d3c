"""The other ranks of a checkpoint's collectives, played in this process (tests only).

``fake_peer``: this process as one rank of 2, its peer answering each all_gather with ``answer(own tensor, call
number)``. ``ThreadRanks``: every rank of a job played by a thread of this process; ``sync.job()`` answers each
thread's rank and ``paddle.distributed.all_gather`` exchanges the threads' tensors, so a collective agreement is
seen from every rank at once.
"""
import contextlib
import threading


def fake_peer(monkeypatch, answer, rank: int = 0):
    """This process as rank ``rank`` of 2; returns the list of tensors it sent, one per all_gather."""
    import paddle.distributed as dist

    from autoparallel.checkpoint import sync

    monkeypatch.setattr(sync, "job", lambda: (True, rank, 2))
    calls = []

    def all_gather(out, t):
        calls.append(t)
        peer = answer(t, len(calls))
        out.extend([t, peer] if rank == 0 else [peer, t])
    monkeypatch.setattr(dist, "all_gather", all_gather)
    return calls


class ThreadRanks:
    """``world_size`` ranks as threads: ``run(fn)`` calls ``fn(rank)`` on each and returns {rank: result or the
    exception it raised}. Inside ``single()`` a thread sees a one-process job (``sync.job()`` -> (False, 0, 1)),
    to stand for a step its real rank would do alone; so does every thread ``run`` did not start."""

    JOIN_S = 60.0                       # a thread still running then is reported as such, never waited on for good

    def __init__(self, monkeypatch, world_size: int):
        import paddle.distributed as dist

        from autoparallel.checkpoint import sync

        if world_size < 2:
            raise ValueError(f"ThreadRanks needs at least 2 ranks, got {world_size}")
        self.world_size = world_size
        self._local = threading.local()
        self._slots = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=self.JOIN_S)
        self.gathers = 0                # all_gathers completed (counted once, by rank 0)
        monkeypatch.setattr(sync, "job", self._job)
        monkeypatch.setattr(dist, "all_gather", self._all_gather)

    def _job(self):
        if getattr(self._local, "single", False) or getattr(self._local, "rank", None) is None:
            return False, 0, 1          # single(), or a thread run() did not start (the test's own checks)
        return True, self._local.rank, self.world_size

    @contextlib.contextmanager
    def single(self):
        self._local.single = True
        try:
            yield
        finally:
            self._local.single = False

    def _all_gather(self, out, t):
        self._slots[self._local.rank] = t
        self._barrier.wait()
        out.extend(list(self._slots))
        if self._local.rank == 0:
            self.gathers += 1
        self._barrier.wait()            # nobody overwrites a slot before every rank has read it

    def run(self, fn) -> dict:
        results = {}

        def body(r):
            self._local.rank = r
            try:
                results[r] = fn(r)
            except BaseException as e:
                results[r] = e
        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.JOIN_S)
        for r, t in enumerate(threads):
            if t.is_alive():
                results[r] = TimeoutError(f"rank {r} still running after {self.JOIN_S} s")
        return results
