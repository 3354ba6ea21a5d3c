"""`autoparallel reshard`: plan and explain a reshard.

    autoparallel reshard --shape 4096,4096 --dtype float32 --mesh 2x4 --from "S(0),R" --to "R,S(1)"
                         [--cluster 1x8:A100-80GB | profile.json] [--backend gloo] [--json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys

from autoparallel.cli_checks import MAX_DEVICES, bounded, tensor_bytes
from autoparallel.core.mesh import mesh_from_shape
from autoparallel.core.spec import dtype_bytes
from autoparallel.core.cluster import parse_cluster
from reshard.planner import plan_reshard
from reshard.validate import check_cluster

USAGE_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autoparallel reshard",
                                description="Plan the cheapest redistribution of a tensor between two layouts.")
    p.add_argument("--shape", required=True, help="global shape, e.g. 4096,4096")
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument("--mesh", required=True, help="mesh shape over ranks 0..N-1 row-major, e.g. 2x4")
    p.add_argument("--dim-names", default=None, help="mesh dim names, e.g. data,model")
    p.add_argument("--from", dest="src", default=None, help='source placements, e.g. "S(0),R" (default: all R)')
    p.add_argument("--to", dest="dst", required=True, help='destination placements, e.g. "R,S(1)"')
    p.add_argument("--cluster", default=None, help="cluster spec like 1x8:A100-80GB or a profile .json "
                                                   "(default: nodes of 8 A100 on NVLink + InfiniBand)")
    p.add_argument("--backend", default=None, help="price collectives with this backend's capabilities (nccl, gloo)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def parse_ints(text: str, sep: str, what: str, example: str, allow_empty: bool = False) -> list:
    """``"4096,4096"`` -> [4096, 4096]; ``"2x4"`` with ``sep="x"`` -> [2, 4]."""
    text = text.strip()
    if allow_empty and text in ("", "[]", "()"):
        return []
    if not re.fullmatch(rf"\s*\d+\s*(?:{re.escape(sep)}\s*\d+\s*)*", text.strip("[]()")):
        raise ValueError(f"malformed {what} {text!r}: expected integers separated by {sep!r}, e.g. {example}")
    return [int(t) for t in text.strip("[]()").split(sep)]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:                     # argparse already printed usage or help
        return int(e.code or 0)
    try:
        plan = make_plan(args)
    except (ValueError, TypeError, NotImplementedError, OSError) as e:
        text = str(e).replace("src_placements:", "--from:", 1).replace("dst_placements:", "--to:", 1)
        print(f"autoparallel reshard: error: {text}", file=sys.stderr)
        return USAGE_ERROR
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan)
    return 0


def make_plan(args):
    """The plan an argument namespace asks for (raises ValueError/TypeError on bad input)."""
    shape = parse_ints(args.shape, ",", "--shape", "4096,4096", allow_empty=True)
    tensor_bytes("--shape", shape, dtype_bytes(args.dtype))
    mesh_shape = parse_ints(args.mesh, "x", "--mesh", "2x4")
    if any(s <= 0 for s in mesh_shape):
        raise ValueError(f"--mesh needs positive sizes, got {args.mesh!r}")
    ranks = bounded(f"--mesh {args.mesh}: its rank count", math.prod(mesh_shape), MAX_DEVICES, "ranks")
    names = [n.strip() for n in args.dim_names.split(",")] if args.dim_names else None
    mesh = mesh_from_shape(mesh_shape, names, create_groups=False)
    cluster = check_cluster(parse_cluster(args.cluster) if args.cluster else None)
    if args.backend:
        cluster = check_cluster(dataclasses.replace(cluster, backend=args.backend))
    if args.cluster:
        bounded("--cluster", cluster.world_size, MAX_DEVICES, "devices")
        if cluster.world_size < ranks:
            raise ValueError(f"--cluster {args.cluster!r} has {cluster.world_size} devices, fewer than the "
                             f"{ranks} ranks of --mesh {args.mesh}")
    src = args.src if args.src is not None else ",".join(["R"] * mesh.ndim)
    return plan_reshard(shape, args.dtype, mesh, src, args.dst, cluster)
