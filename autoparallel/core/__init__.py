"""The pure core: the vocabulary every other layer speaks, with no paddle import.

    placement.py     Shard / Replicate / Partial, their short strings ("S(0)", "R", "P(sum)") and chunk sizes
    mesh.py          ProcessMesh (its process groups are made in autoparallel.comm.groups, by name)
    spec.py          DistSpec: mesh, placements, global shape, dtype
    collective.py    Collective: the names of the steps of a reshard plan
    capabilities.py  what each backend runs natively, and how a missing collective is emulated
    cost.py          alpha-beta cost formulas of the collectives
    topology.py      the fabric behind a cluster's links
    cluster.py       ClusterSpec: devices, nodes, links; presets and spec strings

``spmd_rules``, ``reshard`` and ``autoparallel.planner`` build on these modules; the runtime (dispatch,
collectives, worlds) builds on all of them. Importing this package imports numpy and the standard library only.
"""
