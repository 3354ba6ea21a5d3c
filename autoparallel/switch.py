"""An on/off flag held in a one-element list (read as ``flag[0]`` on hot paths) and a block that turns it off."""
import contextlib


@contextlib.contextmanager
def turned_off(flag: list):
    """``flag[0]`` is False inside the block and back to what it was after it (also on an exception)."""
    prev = flag[0]
    flag[0] = False
    try:
        yield
    finally:
        flag[0] = prev


_ON, _OFF = ("on", "1", "true", "yes"), ("off", "0", "false", "no")


def env_on(name: str, default: bool) -> bool:
    """An environment switch: ``on``/``1``/``true``/``yes`` or ``off``/``0``/``false``/``no`` (any case); unset or
    empty gives ``default``; anything else is a ``ValueError`` naming the variable."""
    import os

    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value not in _ON + _OFF:
        raise ValueError(f"{name} must be 'on' or 'off', got {value!r}")
    return value in _ON
