"""paddle.distributed.Strategy objects given to ap entry points (``ap.to_static``, ``ap.parallelize``): converted
to our Strategy field by field; each paddle field is mapped or refused as config/paddle_compat.py says."""
from __future__ import annotations

from autoparallel.config.paddle_compat import PADDLE_ONLY
from autoparallel.strategy import Strategy

__all__ = ["from_paddle_strategy", "is_paddle_strategy", "as_strategy"]


def is_paddle_strategy(x) -> bool:
    return type(x).__module__.startswith("paddle") and hasattr(x, "sharding") and hasattr(x, "gradient_merge")


def from_paddle_strategy(ps):
    """Our Strategy for a ``paddle.distributed.Strategy`` object: every field that differs from a fresh paddle
    Strategy is applied by name (mapped or refused, as above)."""
    fresh = type(ps)()
    config = {}
    base_keys = ("auto_mode", "seed") + tuple(PADDLE_ONLY["Strategy"])
    for key in base_keys:
        v = getattr(ps, key, None)
        if v != getattr(fresh, key, None):
            config[key] = v
    for key in SECTIONS:
        mine, base = getattr(ps, "_" + key, None), getattr(fresh, "_" + key, None)
        if mine is None:
            continue
        diff = {k: v for k, v in vars(mine).items() if not k.startswith("_") and v != vars(base).get(k)}
        if diff:
            config[key] = diff
    _unread(ps, base_keys, config)
    return Strategy(config)


SECTIONS = ("sharding", "gradient_merge", "pipeline", "amp", "fused_passes", "recompute", "mp_optimization",
            "dp_optimization", "sp_optimization")


def _unread(ps, base_keys, config) -> None:
    """Keys of the config dict ``ps`` was built from that paddle stored but never read (an unknown section, a
    misspelt field): added to ``config`` as given, so that ``Strategy(config)`` refuses them by name."""
    for key, value in (getattr(ps, "_config_dict", None) or {}).items():
        section = getattr(ps, "_" + key, None) if key in SECTIONS else None
        if section is not None and isinstance(value, dict):
            extra = {k: v for k, v in value.items() if k not in vars(section)}
            if extra:
                config.setdefault(key, {}).update(extra)
        elif key not in SECTIONS and key not in base_keys:
            config[key] = value


def as_strategy(x):
    """Ours for a ``paddle.distributed.Strategy``; anything else unchanged (for the caller's own type check)."""
    return from_paddle_strategy(x) if is_paddle_strategy(x) else x
