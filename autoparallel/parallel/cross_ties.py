"""A parameter shared by two models stays one parameter when each model is parallelized on its own call
(a teacher and a student sharing an embedding, a policy and a value model sharing a backbone weight):

    teacher.emb.weight = student.emb.weight
    student, opt = ap.parallelize(student, opt, strategy=s)
    teacher, _ = ap.parallelize(teacher, None, strategy=s)    # teacher.emb.weight is student.emb.weight

``ap.parallelize`` replaces the parameters of the model it is given; the other model would keep the original
(stale from then on) or get a second replacement of its own, and the two would train apart. Every replacement is
remembered by the original it replaced (``remember``); a later parallelize of another model holding that
original repoints its holders to the earlier replacement (``join``). The shared parameter has one layout: a
second model asking for another mesh or placements is a ``TiedLayoutError``.
"""
from __future__ import annotations

from autoparallel.compat import SideData
from autoparallel.parallel.ties import TiedLayoutError, _layout, groups

_REPLACED = SideData()          # original parameter -> its distributed replacement (the first one made)


def join(model, before: list, replaced: dict) -> dict:
    """``replaced`` ({id(original): replacement}, from ties.repoint) with every original that an earlier
    build already replaced mapped to that earlier replacement, whose holders in ``model`` are repointed;
    then this build's replacements are remembered."""
    out = dict(replaced)
    for key, slots in groups(before).items():
        original, new = slots[0].param, replaced.get(key)
        old = _REPLACED.get(original)
        if old is None or new is None or new is old:
            continue
        if _layout(old) != _layout(new):
            raise TiedLayoutError(
                f"parameter {slots[0].path} of {type(model).__name__} is shared with a model parallelized "
                f"earlier, which laid it out as {list(old.placements)} on {old.mesh}; this build gives it "
                f"{list(new.placements)} on {new.mesh}. A parameter shared by two models has one layout: parallelize "
                f"both on the same mesh and leave the shared parameter out of one model's tp_plan (it then uses "
                f"the other's layout)")
        for s in slots:
            s.layer._parameters[s.attr] = old
        out[key] = old
    remember(before, out)
    return out


def remember(before: list, replaced: dict) -> None:
    for key, slots in groups(before).items():
        new = replaced.get(key)
        if new is not None and slots[0].param not in _REPLACED:
            _REPLACED.set(slots[0].param, new)
