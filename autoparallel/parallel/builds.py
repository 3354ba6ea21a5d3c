"""What ``ap.parallelize`` / ``ap.DataParallel`` did to a model, and how ``ap.Optimizer`` finds it again."""
from __future__ import annotations

from autoparallel import layer_state
from autoparallel.compat import WeakAttr
from autoparallel.mesh import ProcessMesh
from autoparallel.strategy import Strategy


class Build:
    """What ``parallelize`` / ``ap.DataParallel`` did to a model, for the optimizer side of the same build
    (``ap.Optimizer`` finds it on the model its optimizer's parameters belong to). Kept in ``layer_state`` under
    the model (or its pipeline) itself, so the model, pipeline and optimizer are held weakly: a strong reference
    from the record would keep the model alive after the user drops it."""
    model = WeakAttr()
    pipe = WeakAttr()                  # pp > 1: the PipelineModule
    optimizer = WeakAttr()             # the wrapper the build returned, once built

    def __init__(self, strategy: Strategy, mesh: ProcessMesh | None, by_name: dict, lazy: bool, model=None,
                 pipe=None, optimizer=None):
        self.strategy, self.mesh = strategy, mesh
        self.by_name = by_name         # original parameter name -> the model's (distributed) parameter
        self.lazy = lazy               # parameters still lazy: ZeRO-3 draws each rank's chunks itself
        self.model, self.pipe, self.optimizer = model, pipe, optimizer
        self.optimizer_built = optimizer is not None

    def __setattr__(self, name, value):
        if name == "optimizer" and value is not None:
            object.__setattr__(self, "optimizer_built", True)     # stays True when the optimizer is dropped
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"Build(strategy={self.strategy}, mesh={self.mesh}, {len(self.by_name)} parameters)"


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
