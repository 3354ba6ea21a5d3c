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
