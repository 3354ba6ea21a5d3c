"""Minimum-cost path with deterministic ties (Dijkstra over an explicit graph, heapq).

Costs within a relative ``RTOL`` of the optimum count as equal (so float rounding never decides between,
say, one all_reduce and the reduce_scatter + all_gather that moves the same bytes); among equal-cost paths
the one with fewer steps wins, then the one whose sequence of state keys is lexicographically smallest.
"""
from __future__ import annotations

import heapq
from collections import deque
from itertools import count
from typing import Callable, Hashable, Iterable

RTOL = 1e-9


class Graph:
    """Every state reachable from ``start``; ``adj[u]`` maps ``v`` to ``(cost, data)`` of the cheapest u->v edge."""

    def __init__(self, start: Hashable, neighbors: Callable[[Hashable], Iterable[tuple]]):
        self.adj = {}
        todo = deque([start])
        self.adj[start] = None
        while todo:
            u = todo.popleft()
            out = {}
            for v, cost, data in neighbors(u):
                if v not in out or cost < out[v][0]:
                    out[v] = (cost, data)
                if v not in self.adj:
                    self.adj[v] = None
                    todo.append(v)
            self.adj[u] = out
        self.radj = {u: {} for u in self.adj}
        for u, out in self.adj.items():
            for v, (cost, data) in out.items():
                self.radj[v][u] = (cost, data)


def distances(edges: dict, source: Hashable) -> dict:
    """Dijkstra from ``source`` over ``edges[u] = {v: (cost, data)}``."""
    dist = {source: 0.0}
    tick = count()
    heap = [(0.0, next(tick), source)]
    while heap:
        d, _, u = heapq.heappop(heap)
        if d > dist[u]:
            continue
        for v, (cost, _) in edges[u].items():
            nd = d + cost
            if nd < dist.get(v, float("inf")):
                dist[v] = nd
                heapq.heappush(heap, (nd, next(tick), v))
    return dist


def near(total: float, best: float) -> bool:
    """Is ``total`` equal to the optimum ``best`` up to float rounding?"""
    return total <= best + RTOL * best


def best_path(graph: Graph, src: Hashable, dst: Hashable, key: Callable[[Hashable], str]) -> list:
    """Edges ``(u, v, data)`` of the cheapest src->dst path, ties broken by step count then ``key`` order."""
    if src == dst:
        return []
    d_src, d_dst = distances(graph.adj, src), distances(graph.radj, dst)
    if dst not in d_src:
        raise ValueError(f"no path from {key(src)} to {key(dst)}")
    best = d_src[dst]
    inf = float("inf")

    def on_best(u, v, cost):
        return near(d_src.get(u, inf) + cost + d_dst.get(v, inf), best)

    # hop counts to dst inside the subgraph of edges that lie on some optimal path
    hops = {dst: 0}
    todo = deque([dst])
    while todo:
        v = todo.popleft()
        for u, (cost, _) in graph.radj[v].items():
            if u not in hops and on_best(u, v, cost):
                hops[u] = hops[v] + 1
                todo.append(u)
    path, u = [], src
    while u != dst:
        options = [(key(v), v, data) for v, (cost, data) in graph.adj[u].items()
                   if hops.get(v) == hops[u] - 1 and on_best(u, v, cost)]
        _, v, data = min(options, key=lambda o: o[0])
        path.append((u, v, data))
        u = v
    return path
