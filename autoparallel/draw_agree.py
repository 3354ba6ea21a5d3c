"""Random draws whose result every rank must hold alike: ``paddle.multinomial`` over distributed probabilities
(the next tokens of ``generate``'s sampling). Its composite (``spmd_rules/composites_more.py``) makes one draw from
the global probabilities on each rank, from that rank's own generator. Ranks seeded differently -- or not at all:
each process then starts from its own random state -- would each keep their own tokens, and the next forward of a
tensor-parallel model would combine the shards of different sequences (silently wrong tokens, different on every
rank). So on real ranks the draw of the first rank of the probabilities' mesh is broadcast to the others, as
PaddleFormers' own sampling does over its model-parallel group. Under one seed on every rank the draws were equal
already: the broadcast leaves them unchanged. In the simulated world the draw is made once for all ranks.

Every other random op on distributed tensors runs under ``rng_agree.agreed_generator`` of its mesh
(``agreed_generator_call``, applied by ``dispatch_install`` to ``RANDOM_COMPOSITES``)."""
from __future__ import annotations

import paddle

from autoparallel.dist_tensor import is_dist
from autoparallel.rng_agree import agreed_generator, from_first, skip


def _mesh_of(args, kwargs):
    for v in (*args, *kwargs.values()):
        if is_dist(v):
            return v.mesh
    return None


def agreed_draw(fn):
    """``fn`` (a draw returning a plain tensor) followed by a broadcast of the first mesh rank's result."""
    def run(*args, **kwargs):
        out = fn(*args, **kwargs)
        mesh = _mesh_of(args, kwargs)
        if mesh is None or skip(mesh) or is_dist(out) or not isinstance(out, paddle.Tensor):
            return out                          # one draw already, or a traced value (no data to send)
        return from_first(out, mesh)

    run.__name__ = getattr(fn, "__name__", "draw")
    run.__doc__ = getattr(fn, "__doc__", None)
    return run


def agreed_generator_call(fn):
    """``fn`` (a composite drawing on distributed tensors) run under ``agreed_generator`` of its inputs' mesh."""
    def run(*args, **kwargs):
        with agreed_generator(_mesh_of(args, kwargs)):
            return fn(*args, **kwargs)

    run.__name__ = getattr(fn, "__name__", "draw")
    run.__doc__ = getattr(fn, "__doc__", None)
    return run


RANDOM_COMPOSITES = frozenset(
    [f"paddle.Tensor.{n}_" for n in ("bernoulli", "cauchy", "exponential", "geometric", "log_normal", "normal",
                                     "uniform")]
    + [f"paddle.{n}" for n in ("bernoulli", "bernoulli_", "binomial", "cauchy_", "geometric_", "log_normal",
                               "log_normal_", "normal", "normal_", "poisson", "rand_like", "randint_like",
                               "randn_like", "standard_gamma", "linalg.pca_lowrank", "linalg.svd_lowrank")]
    + [f"paddle.nn.functional.{n}" for n in ("fractional_max_pool2d", "fractional_max_pool3d", "gumbel_softmax",
                                             "rrelu")])

