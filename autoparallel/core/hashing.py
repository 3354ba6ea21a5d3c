"""Value objects that hash once: ``_hash`` is kept, left out of a pickle and computed again on loading."""
from __future__ import annotations


class HashedOnce:
    """Keeps ``hash(self._hash_key())`` in ``_hash``; a pickle omits it (string hashes differ between
    processes) and loading computes it again. The class defines ``__hash__`` itself (returning ``_hash``)."""
    __slots__ = ()

    def _hash_key(self):
        raise NotImplementedError(f"{type(self).__name__} must define _hash_key()")

    def _rehash(self) -> None:
        object.__setattr__(self, "_hash", hash(self._hash_key()))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._rehash()
