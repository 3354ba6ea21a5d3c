"""Random draws whose result every rank must hold alike: ``paddle.multinomial`` over distributed probabilities
(the next tokens of ``generate``'s sampling). Its composite (``spmd_rules/composites_more.py``) makes one draw from
the global probabilities on each rank, from that rank's own generator. Ranks seeded differently -- or not at all:
each process then starts from its own random state -- would each keep their own tokens, and the next forward of a
tensor-parallel model would combine the shards of different sequences (silently wrong tokens, different on every
rank). So on real ranks the draw of the first rank of the probabilities' mesh is broadcast to the others, as
PaddleFormers' own sampling does over its model-parallel group. Under one seed on every rank the draws were equal
already: the broadcast leaves them unchanged. In the simulated world the draw is made once for all ranks."""
from __future__ import annotations

import paddle

from autoparallel.comm.collectives import broadcast
from autoparallel.comm.world import current_world
from autoparallel.context import state as _ctx
from autoparallel.dist_tensor import is_dist


def _mesh_ranks(args, kwargs) -> list:
    for v in (*args, *kwargs.values()):
        if is_dist(v):
            return sorted(int(r) for r in v.mesh.process_ids)
    return []


def agreed_draw(fn):
    """``fn`` (a draw returning a plain tensor) followed by a broadcast of the first mesh rank's result."""
    def run(*args, **kwargs):
        out = fn(*args, **kwargs)
        world = current_world()
        ranks = _mesh_ranks(args, kwargs)
        if world.is_simulated or len(ranks) < 2 or world.rank not in ranks or _ctx.tracer is not None \
                or is_dist(out) or not isinstance(out, paddle.Tensor):
            return out                          # one draw already, or a traced value (no data to send)
        return broadcast({world.rank: out}, ranks, ranks[0])[world.rank]

    run.__name__ = getattr(fn, "__name__", "draw")
    run.__doc__ = getattr(fn, "__doc__", None)
    return run
