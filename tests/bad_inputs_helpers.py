"""A per-case deadline for bad-input tests: a case that hangs fails in seconds instead of stalling the suite."""
import contextlib
import signal

CASE_SECONDS = 20.0


class CaseHang(BaseException):
    """Raised by the deadline (a BaseException, so code catching Exception cannot swallow it)."""


@contextlib.contextmanager
def deadline(seconds: float = CASE_SECONDS):
    def expired(signum, frame):
        raise CaseHang(f"the case ran beyond {seconds:g} s: a hang")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
