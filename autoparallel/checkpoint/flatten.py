"""Nested state dicts <-> flat names ("model/fc1.weight").

Names join the keys of the nested dicts with "/", so keys may contain dots (parameter names do) but not
"/". Leaves are tensors, numpy arrays and JSON values; a dict is always descended into.
"""
from __future__ import annotations

SEP = "/"


def flatten(state: dict, prefix: str = "") -> dict:
    """{name: (container, key, leaf)} for every leaf of a nested dict, in insertion order."""
    if not isinstance(state, dict):
        raise TypeError(f"a state must be a dict (nested dicts allowed), got {type(state).__name__}")
    out: dict = {}
    _walk(state, prefix, out)
    return out


def _walk(d: dict, prefix: str, out: dict) -> None:
    for key, value in d.items():
        text = str(key)
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise TypeError(f"state keys must be str or int, got {type(key).__name__} {key!r} under "
                            f"{prefix or '<root>'!r}")
        if SEP in text or not text:
            raise ValueError(f"state key {text!r} under {prefix or '<root>'!r} must be non-empty and must not "
                             f"contain {SEP!r} (it separates nested keys in checkpoint names)")
        name = f"{prefix}{SEP}{text}" if prefix else text
        if isinstance(value, dict):
            _walk(value, name, out)
        else:
            if name in out:
                raise ValueError(f"two state keys flatten to the same name {name!r} (an int and a str key?)")
            out[name] = (d, key, value)


def unflatten(flat: dict) -> dict:
    """{"a/b": v} -> {"a": {"b": v}}."""
    root: dict = {}
    for name, value in flat.items():
        parts = name.split(SEP)
        node = root
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return root
