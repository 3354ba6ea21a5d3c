"""Worlds: where the ranks of a mesh live.

* ``RealWorld``: this process is one rank of a ``paddle.distributed`` job (or rank 0 of a world of one);
  a DistTensor holds this rank's shard only.
* ``SimWorld`` (``with ap.simulate(world_size=N):``): all N ranks live in this process; a DistTensor holds
  every rank's shard and collectives are computed in-process. Used by fast tests and for debugging a
  layout on a laptop.
"""
from __future__ import annotations

import contextlib

from autoparallel.config.fields import integral
from autoparallel.context import process as _process
from autoparallel.context import set_cluster_override as _set_override
from autoparallel.context import state as _state


class World:
    is_simulated = False
    backend = "gloo"

    def local_ranks(self, ranks) -> list[int]:
        """The ranks among ``ranks`` whose shards this process holds, in the given order."""
        raise NotImplementedError


class RealWorld(World):
    def __init__(self):
        import paddle
        import paddle.distributed as dist

        self.initialized = dist.is_initialized()
        # before init_parallel_env paddle reads them from the launcher's environment (PADDLE_TRAINER_ID /
        # PADDLE_TRAINERS_NUM): a shard placed then is this rank's own, not rank 0's on every rank
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backend = backend_of(paddle.get_device(), dist)

    def local_ranks(self, ranks) -> list[int]:
        return [r for r in ranks if r == self.rank]

    def __repr__(self):
        return f"RealWorld(rank={self.rank}, world_size={self.world_size}, backend={self.backend})"


def backend_of(device: str, dist) -> str:
    """The capability table's backend for this process: the default group's own (``dist.get_backend()``) once the
    parallel env is up, else read from the device. NCCL is "nccl"; gloo and every other backend (BKCL, XCCL) are
    "gloo", whose table emulates what it lacks: correct everywhere, if slower than a backend's native calls."""
    if dist.is_initialized():
        try:
            return "nccl" if str(dist.get_backend()).lower() == "nccl" else "gloo"
        except RuntimeError:                    # this rank is outside the global group: read the device
            pass
    return "nccl" if device.startswith("gpu") else "gloo"


class SimWorld(World):
    is_simulated = True
    backend = "sim"

    def __init__(self, world_size: int):
        size = integral(world_size)             # numpy ints as ints; bools and floats refused
        if size is None or size <= 0:
            raise ValueError(f"simulate(world_size) expects a positive int, got {world_size!r}")
        world_size = size
        if world_size > 2 ** 20:          # every rank's shard lives in this one process
            raise ValueError(f"simulate(world_size) expects at most 2**20 ranks (1,048,576; all of them live in "
                             f"this process), got {world_size}")
        self.world_size = world_size
        self.rank = 0

    def local_ranks(self, ranks) -> list[int]:
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"ranks {bad} are outside the simulated world of {self.world_size} ranks")
        return list(ranks)

    def __repr__(self):
        return f"SimWorld(world_size={self.world_size})"


class OneRankView(SimWorld):
    """The simulated world seen from one of its ranks (code that runs once per held rank, on that rank's
    shard: gradient hooks): that rank alone is held, as in a launched job."""

    def __init__(self, world: SimWorld, rank: int):
        super().__init__(world.world_size)
        self.rank = rank

    def local_ranks(self, ranks) -> list[int]:
        return [r for r in super().local_ranks(ranks) if r == self.rank]


@contextlib.contextmanager
def as_rank(rank: int):
    """In the simulated world, run the body as rank ``rank`` alone (OneRankView); elsewhere nothing changes."""
    world = current_world()
    if not world.is_simulated:
        yield world
        return
    _state.world_stack.append(OneRankView(world, rank))
    try:
        yield _state.world_stack[-1]
    finally:
        _state.world_stack.pop()


_real = None


def current_world() -> World:
    stack = _state.world_stack
    if stack:
        return stack[-1]
    global _real
    if _real is None or (not _real.initialized and _dist_initialized()):
        _real = RealWorld()
    return _real


def _dist_initialized() -> bool:
    import paddle.distributed as dist

    return dist.is_initialized()


def init_parallel_env() -> World:
    """The article's ``dist.init_parallel_env()``: initialise ``paddle.distributed`` in a process started by
    ``python -m paddle.distributed.launch`` (idempotent) and return this process's world. A single
    process (not launched) is a world of one; inside ``ap.simulate`` the simulated world needs nothing."""
    global _real
    stack = _state.world_stack
    if stack:
        return stack[-1]
    import paddle.distributed as dist

    if not dist.is_initialized():
        dist.init_parallel_env()
    _real = None
    return current_world()


def get_rank() -> int:
    return current_world().rank


@contextlib.contextmanager
def simulate(world_size: int):
    """Run every rank of a mesh in this process: ``with ap.simulate(world_size=8): ...``."""
    world = SimWorld(world_size)
    stack = _state.world_stack
    if stack is None:
        stack = _state.world_stack = []
    stack.append(world)
    try:
        yield world
    finally:
        stack.pop()


def set_cluster(cluster) -> None:
    """Price runtime reshards with ``cluster`` (a ClusterSpec, spec string or profile path; None resets)."""
    if cluster is None:
        _set_override(None)
        return
    from autoparallel.planner.cluster import parse_cluster

    _set_override(parse_cluster(cluster))


def __getattr__(name):
    if name == "_cluster_override":          # the override lives in autoparallel.context
        return _process.cluster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def planning_cluster():
    """The cluster runtime reshards are planned for: the override, else the default cluster with this
    world's backend (gloo prices its emulated collectives)."""
    if _process.cluster is not None:
        return _process.cluster
    from dataclasses import replace

    from autoparallel.planner.cluster import default_cluster

    backend = current_world().backend
    base = default_cluster()
    return base if backend in ("nccl", "sim") else replace(base, backend=backend, overlap=0.0)
