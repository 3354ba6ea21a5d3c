"""What ``ap.parallelize`` / ``ap.DataParallel`` did to a model, and how ``ap.Optimizer`` finds it again."""
from __future__ import annotations

import dataclasses

from autoparallel import layer_state
from autoparallel.mesh import ProcessMesh
from autoparallel.strategy import Strategy


@dataclasses.dataclass
class Build:
    """What ``parallelize`` / ``ap.DataParallel`` did to a model, for the optimizer side of the same build
    (``ap.Optimizer`` finds it on the model its optimizer's parameters belong to)."""
    strategy: Strategy
    mesh: ProcessMesh | None
    by_name: dict                      # original parameter name -> the model's (distributed) parameter
    lazy: bool                         # parameters still lazy: ZeRO-3 draws each rank's chunks itself
    model: object = None
    pipe: object = None                # pp > 1: the PipelineModule
    optimizer: object = None           # the wrapper the build returned, once built


BUILT: list = []      # weak references to models built by ap.parallelize / ap.DataParallel (ap.Optimizer finds them)


def find_build(params):
    """(build, {id(plain parameter): its distributed replacement}) of the model ``params`` belong to."""
    for ref in reversed(BUILT):
        model = ref()
        build = layer_state.build_of(model)
        if build is None:
            continue
        own = {id(p) for p in model.parameters()}
        if build.pipe is not None:
            if any(id(p) in own or p.name in build.by_name for p in params):
                return build, {id(p): p for p in params if p.name in build.by_name}
            continue
        replaced = {id(p): build.by_name[p.name] for p in params if id(p) not in own and p.name in build.by_name}
        if any(id(p) in own for p in params) or replaced:
            return build, replaced
    return None, {}


SHARDED: list = []    # weak references to layers distributed by ap.shard_layer


def remember_sharded(layer) -> None:
    import weakref

    SHARDED[:] = [r for r in SHARDED if r() is not None and r() is not layer] + [weakref.ref(layer)]


def model_of_params(params):
    """The model built by ap.parallelize / ap.DataParallel, else the layer distributed by ap.shard_layer, whose
    parameters ``params`` are (None if none)."""
    ids = {id(p) for p in params}
    for ref in list(reversed(BUILT)) + list(reversed(SHARDED)):
        model = ref()
        if model is not None and ids & {id(p) for p in model.parameters()}:
            return model
    return None
