"""``paddle.nn.utils.parameters_to_vector`` / ``vector_to_parameters`` over distributed parameters.

paddle's pair flattens each parameter's values into one 1-D tensor (a copy, a new leaf with
``stop_gradient=False``) and writes such a vector back slice by slice. With distributed parameters the vector is
the one a single process builds: each distributed parameter contributes its global value (gathered: every rank
runs the call, as every rank of a training loop does), and writing back gives each distributed parameter its
global slice through ``set_value``, which lays it out on the shards (and on ZeRO's master chunks).
"""
from __future__ import annotations

import paddle

from autoparallel.dist_tensor import is_dist


def _shape(p) -> list:
    return list(p.global_shape) if is_dist(p) else list(p.shape)


def parameters_to_vector(parameters, name=None):
    params = list(parameters)
    if not params:
        raise ValueError("paddle.nn.utils.parameters_to_vector: no parameters given")
    with paddle.no_grad():
        parts = [(p.full() if is_dist(p) else p).detach().reshape([-1]) for p in params]
        out = paddle.concat(parts, axis=0)
    out.stop_gradient = False
    return out


def vector_to_parameters(vec, parameters, name=None):
    params = list(parameters)
    sizes = [int(paddle.to_tensor(_shape(p)).prod()) if _shape(p) else 1 for p in params]
    if is_dist(vec):
        vec = vec.full()
    if list(vec.shape) != [sum(sizes)]:
        raise ValueError(f"paddle.nn.utils.vector_to_parameters: the vector has shape {list(vec.shape)}, the "
                         f"parameters hold {sum(sizes)} values (global shapes {[_shape(p) for p in params]})")
    start = 0
    with paddle.no_grad():
        for p, n in zip(params, sizes):
            p.set_value(vec[start:start + n].reshape(_shape(p)))
            start += n
