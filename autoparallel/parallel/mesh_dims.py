"""The [data, model] mesh of ``ap.parallelize``: its dim names, how it is built from the degrees, checked."""
from __future__ import annotations

from autoparallel.mesh import ProcessMesh


DATA, MODEL = "data", "model"


def build_mesh(dp: int, tp: int) -> ProcessMesh:
    """Ranks 0..dp*tp-1 as a [data, model] mesh, model fastest-varying: a TP group is tp consecutive ranks,
    which ``paddle.distributed.launch`` places on one node; data-parallel groups span the nodes."""
    return ProcessMesh([[d * tp + t for t in range(tp)] for d in range(dp)], dim_names=[DATA, MODEL])


def check_mesh(mesh, dp: int, tp: int) -> ProcessMesh:
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"mesh must be an ap.ProcessMesh, got {type(mesh).__name__}")
    if mesh.dim_names != [DATA, MODEL] or mesh.shape != [dp, tp]:
        raise ValueError(f"mesh must have dims ['data', 'model'] and shape [dp, tp] = [{dp}, {tp}] for this "
                         f"strategy, got dims {mesh.dim_names} and shape {mesh.shape}")
    return mesh
