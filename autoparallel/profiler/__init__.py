"""ap.profile: a per-rank step-time breakdown (see api.py)."""
from autoparallel.profiler.api import Profile, averaged, profile

__all__ = ["Profile", "averaged", "profile"]
