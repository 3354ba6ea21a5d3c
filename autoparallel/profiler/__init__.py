"""ap.profile: a per-rank step-time breakdown (see session.py)."""
from autoparallel.profiler.session import Profile, averaged, profile

__all__ = ["Profile", "averaged", "profile"]
