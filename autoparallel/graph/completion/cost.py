"""Step 5, cost: seconds per training step of an op's layout, its reshards and gradient reductions."""
from __future__ import annotations

import numpy as np

from autoparallel.graph.completion.sources import _storable
from autoparallel.placement import Partial
from autoparallel.spec import DistSpec


class CostModel:
    """Seconds per training step under a cluster spec: compute, reshards and their adjoints, gradient
    reductions. The reshard planner prices every collective (gloo emulations included)."""

    def __init__(self, mesh, cluster=None):
        from autoparallel.comm.world import planning_cluster

        self.mesh = mesh
        self.cluster = cluster if cluster is not None else planning_cluster()
        self.peak = self.cluster.device.flops("float32")
        self.links = [self.cluster.link_for(mesh.all_groups(m)[0]) for m in range(mesh.ndim)]
        self._memo = {}

    def reshard_plan(self, spec: DistSpec, dst):
        """The reshard planner's ReshardPlan from ``spec`` to layout ``dst`` (memoised)."""
        from reshard import plan_reshard

        key = ("plan", spec, tuple(dst))
        if key not in self._memo:
            self._memo[key] = plan_reshard(spec.shape, spec.dtype, spec.mesh, spec.placements, tuple(dst),
                                           cluster=self.cluster)
        return self._memo[key]

    plan = reshard_plan                 # the earlier name of reshard_plan

    def reshard(self, spec: DistSpec, dst, grad: bool) -> float:
        """Forward reshard seconds, plus the backward adjoint when the tensor needs a gradient (priced as the
        cheapest reshard of the gradient back: its Partial dims read as Replicate)."""
        dst = tuple(dst)
        if dst == spec.placements:
            return 0.0
        key = ("reshard", spec, dst, grad)
        c = self._memo.get(key)
        if c is None:
            c = self.seconds(spec, dst)
            back_src, back_dst = _storable(dst), _storable(spec.placements)
            if grad and back_src != back_dst:
                c += self.seconds(spec.with_placements(back_src), back_dst)
            self._memo[key] = c
        return c

    def reshard_table(self, specs: tuple, dsts: tuple, grad: bool):
        """``reshard(s, d, grad)`` for every spec ``s`` of ``specs`` (rows) and layout ``d`` of ``dsts``
        (columns), memoised whole: every repeated block of a model meets the same layouts, so an edge costs one
        lookup instead of one per pair."""
        key = ("table", specs, dsts, grad)
        table = self._memo.get(key)
        if table is None:
            table = np.array([[self.reshard(s, d, grad) for d in dsts] for s in specs], dtype=float)
            table = self._memo[key] = table.reshape(len(specs), len(dsts))
            table.flags.writeable = False
        return table

    def seconds(self, spec: DistSpec, dst) -> float:
        """Cost of the cheapest reshard (the reshard planner's optimum), from one Dijkstra per source layout
        over the planner's own state graph and step prices."""
        dst = tuple(dst)
        if any(p.is_partial() and p.reduce_type != "sum" for p in dst):
            return self.reshard_plan(spec, dst).seconds
        key = ("dist", spec)
        table = self._memo.get(key)
        if table is None:           # shared by every completion on the same cluster (reshard.cache: bounded)
            from reshard import cache

            table = self._memo[key] = cache.memo(("distances", spec, self.cluster), lambda: self._distances(spec))
        if dst not in table:
            return self.reshard_plan(spec, dst).seconds
        return table[dst]

    def _distances(self, spec: DistSpec) -> dict:
        import heapq

        from reshard import cache
        from reshard.planner import pricer
        from reshard.transitions import moves

        price = pricer(spec.shape, spec.dtype, spec.mesh, self.cluster)
        targets = tuple(Partial("sum") for _ in range(self.mesh.ndim))
        memo = cache.memo(("step_prices", spec.shape, spec.dtype, spec.mesh, self.cluster), dict)
        dist = {spec.placements: 0.0}
        heap = [(0.0, 0, spec.placements)]
        tick = 1
        while heap:
            d, _, u = heapq.heappop(heap)
            if d > dist[u]:
                continue
            for collective, i, v in moves(u, self.mesh.shape, spec.ndim, targets):
                k = (collective, i, price.local_nbytes(u), u[i])
                c = memo.get(k)
                if c is None:
                    c = memo[k] = price.price(collective, i, u).seconds
                nd = d + c
                if nd < dist.get(v, float("inf")):
                    dist[v] = nd
                    heapq.heappush(heap, (nd, tick, v))
                    tick += 1
        return dist

    def compute(self, flops: float, res) -> float:
        """Forward + backward (3x) FLOPs of the op, split over the mesh dims where it shards something."""
        frac = 1.0
        for m in range(self.mesh.ndim):
            if any(s is not None and s.placements[m].is_shard() for s in res.inputs + res.outputs):
                frac /= self.mesh.shape[m]
        return 3.0 * flops * frac / self.peak

    def grad_all_reduce(self, spec: DistSpec, dims, latency: bool = True) -> float:
        """All-reduce of a gradient laid out like ``spec`` over mesh ``dims`` (bucketed: no latency)."""
        from autoparallel.comm.cost import collective_bytes, collective_steps

        total = 0.0
        b = spec.local_nbytes()
        for m in dims:
            n = self.mesh.shape[m]
            link = self.links[m]
            total += collective_bytes("all_reduce", b, n) / link.bandwidth_Bps
            if latency:
                total += collective_steps("all_reduce", n) * link.latency_s
        return total


def split_dims(res, mesh) -> list:
    return [m for m in res.split_mesh_dims() if mesh.shape[m] > 1]


def use_cost(cm, spec: DistSpec, req: DistSpec, res, grad: bool, direct_param: bool) -> float:
    """Seconds to feed a tensor laid out as ``spec`` into an op (result ``res``) requiring ``req``: the
    reshard (and adjoint) plus the gradient reduction over split dims where ``req`` is replicated — bucketed
    when a parameter is used as stored, an all_reduce in backward otherwise (dispatch's rule)."""
    c = cm.reshard(spec, req.placements, grad)
    if grad:
        dims = [m for m in split_dims(res, cm.mesh) if req.placements[m].is_replicate()]
        if dims:
            stored = direct_param and spec.placements == req.placements
            c += cm.grad_all_reduce(req, dims, latency=not stored)
    return c
