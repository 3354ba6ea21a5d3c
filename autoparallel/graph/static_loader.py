"""ap.to_static's batch shapes read from a loader's metadata (batch size and ``dataset[0]``), in paddle's reading:
a dict item is its values in order, nested lists / tuples are flattened; no batch is drawn from the loader."""
from __future__ import annotations

import numpy as np
import paddle

from autoparallel.spec import normalize_dtype

__all__ = ["loader_specs"]


def loader_specs(loader):
    """[(shape, dtype)] of one loader batch from its metadata (batch size and ``dataset[0]``)."""
    bs = getattr(loader, "global_batch_size", None) or getattr(loader, "batch_size", None)
    if bs is None:
        bs = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    dataset = getattr(loader, "dataset", None)
    if dataset is None and getattr(loader, "loaders", None):      # DistributedDataLoader: one per data rank
        dataset = getattr(next(iter(loader.loaders.values())), "dataset", None)
    if not bs or dataset is None:
        raise TypeError(f"to_static cannot read batch shapes from a {type(loader).__name__} (it exposes no "
                        f"batch_size and dataset); pass input_spec=[(shape, dtype), ...] for the batch fields")
    _check_per_rank_sampler(loader)
    out = []
    fields = _item_fields(dataset[0])
    for f in fields:
        if isinstance(f, paddle.Tensor):
            shape, dtype = list(f.shape), normalize_dtype(f.dtype)
        elif isinstance(f, (bool, int, float)):                  # python scalars collate to int64 / float32
            shape, dtype = [], "int64" if isinstance(f, (bool, int)) else "float32"
        else:
            a = np.asarray(f)
            shape, dtype = list(a.shape), normalize_dtype(a.dtype)
        out.append(([int(bs)] + shape, dtype))
    return out


def _item_fields(item) -> list:
    """A dataset item's batch fields as paddle's ``dist.to_static`` reads them: a dict's values in order,
    nested lists / tuples flattened (``((ids, mask), labels)`` is three fields)."""
    if isinstance(item, dict):
        item = list(item.values())
    if not isinstance(item, (tuple, list)):
        return [item]
    return [f for x in item for f in (_item_fields(x) if isinstance(x, (tuple, list, dict)) else [x])]


def _check_per_rank_sampler(loader) -> None:
    """A loader over paddle's DistributedBatchSampler with several replicas yields each rank's own part; read as
    the global batch, every rank would keep its slice of a different batch (data dropped, replicas disagreeing)."""
    from autoparallel.api_data import per_rank_sampler

    sampler = getattr(loader, "batch_sampler", None)
    if not getattr(loader, "_split", False) and per_rank_sampler(sampler):
        raise ValueError(f"to_static: the loader's DistributedBatchSampler splits the dataset over {sampler.nranks} "
                         f"replicas (this rank: {sampler.local_rank}), but a DistModel batch is the global batch, the "
                         f"same on every rank; build the loader with a plain batch sampler (or "
                         f"DistributedBatchSampler(num_replicas=1)) so that every rank reads the whole batch")
