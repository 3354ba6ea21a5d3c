"""ZeRO stage 3 over lazily created parameters.

At stage 3 a rank owns one chunk of each parameter's flattened local shard (the chunk is the master weight,
the local data is released between uses). Here each rank's chunk is streamed straight from the
initialiser, so the local data is never allocated: the parameters start released, exactly as after a
step, and the first forward gathers them. Parameters outside the optimizer are materialised whole, in the
same creation-order pass.
"""
from __future__ import annotations

from autoparallel import layer_state
from autoparallel.lazy_init.params import (DEFAULT_CHUNK, is_lazy, lazy_parameters, materialize_params,
                                          padding_rows, parameter_names)
from autoparallel.parallel.sharding import ZeroOptimizer


class LazyZeroOptimizer(ZeroOptimizer):
    """A ZeroOptimizer whose master chunks of lazy parameters come from their initialisers."""

    chunk_elements = DEFAULT_CHUNK

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "_lazy_chunks" not in self.__dict__:          # this rank holds no shard: still advance the stream
            self._lazy_chunks = self._stream()

    def _make_inner(self, r):
        if "_lazy_chunks" not in self.__dict__:
            self._lazy_chunks = self._stream()
        return super()._make_inner(r)

    def _initial_chunk(self, p, r, dtype=None):
        streamed = self._lazy_chunks.get(id(p), {}).get(r)
        return streamed.astype(dtype or "float32") if streamed is not None else super()._initial_chunk(p, r, dtype)

    def _stream(self) -> dict:
        """One creation-order pass over the model: managed lazy parameters keep their ZeRO chunk only."""
        ranges = {}
        for p in self.params:
            if is_lazy(p):
                ranges[id(p)] = {}
                for r in self.held:
                    layout, k = self._layout([p], r), self.groups.index(r)
                    a = layout.starts[0][k]
                    ranges[id(p)][r] = (a, a + layout.sizes[0][k])
        report, chunks = materialize_params(lazy_parameters(self.model), ranges, self.chunk_elements,
                                            parameter_names(self.model), padding_rows(self.model))
        self.init_report = report
        layer_state.put(self.model, "init_report", report)
        return chunks


def apply_zero_lazy(model, optimizer, mesh, stage: int, dp_dim: str = "data", degree: int | None = None,
                    offload: bool = False, gradient_accumulation_steps: int = 1, bucket_bytes: int = 25 * 2**20,
                    **options):
    """``apply_zero`` (same arguments) for a model whose parameters are still lazy: stage 3 streams each
    rank's chunk; stages 1 and 2 keep whole local shards, so the model is materialised first."""
    from autoparallel.lazy_init.params import materialize
    from autoparallel.parallel.sharding import STAGES, apply_zero

    if stage not in STAGES:
        raise ValueError(f"sharding stage must be one of {STAGES}, got {stage!r}")
    if stage != 3:
        materialize(model)
        return apply_zero(model, optimizer, mesh, stage, dp_dim, degree, offload, gradient_accumulation_steps,
                          bucket_bytes, **options)
    from autoparallel.parallel.zero_params import install_stage3

    opt = LazyZeroOptimizer(model, optimizer, mesh, stage, dp_dim, degree, offload, gradient_accumulation_steps,
                            bucket_bytes, **options)
    install_stage3(model, opt)
    return opt
