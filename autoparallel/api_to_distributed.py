"""paddle's ``dist.to_distributed(model, optimizer, dataloader, device_num, node_num=1, config=None)``: a model, an
optimizer and a loader with no distributed code go in; the planner's choice comes out.

    model, opt, loader = ap.to_distributed(model, opt, loader, device_num=4)
    for inputs, labels in loader():
        loss = model(inputs, labels=labels) ...

paddle matches its model against a LLaMA decoder pattern and picks a preset mesh by device count; here the
planner chooses (``ap.parallelize`` with ``auto_mode="full"``, docs/planner_auto.md): the global batch is the
loader's batch size, the sequence length the first ``config.input_spec``'s second dim (else the model config's),
``config.sequence_parallel`` a constraint of the search. The loader is ``ap.shard_dataloader`` over the chosen
mesh's data dim; a pipelined plan takes plain batches, the same on every rank (docs/pipeline.md), so its loader
yields the user's batches, checked on real ranks to agree. ``device_num x node_num`` must be the world that runs it.
"""
from __future__ import annotations

from collections.abc import Mapping

from autoparallel.config.fields import integral


class ToDistributedConfig:
    """paddle's ``ToDistributedConfig``: ``input_spec`` (a list of ``paddle.static.InputSpec``; the first one's
    second dim is the sequence length the planner prices) and ``sequence_parallel`` (True: only plans that split
    sequences over the tensor-parallel dim)."""

    def __init__(self):
        self.input_spec = None
        self.sequence_parallel = False


def to_distributed(model, optimizer, dataloader, device_num, node_num=1, config=None):
    """Returns ``(model, optimizer, loader)``: the model and optimizer as ``ap.parallelize`` builds them under the
    planner's strategy (``ap.chosen_strategy(model)`` / ``ap.chosen_plan(model)`` say which and why), the loader a
    ``ShardDataloader`` splitting each batch over the data dim."""
    from autoparallel import layer_state
    from autoparallel.api_data import shard_dataloader
    from autoparallel.api_env import get_world_size
    from autoparallel.parallelize import parallelize
    from autoparallel.strategy import Strategy

    world = _world_of(device_num, node_num)
    if world != get_world_size():
        raise ValueError(f"to_distributed: device_num x node_num = {world} must be the world running it, got a "
                         f"world of {get_world_size()} ranks")
    seq_len, sp = _read_config(config)
    strategy = Strategy()
    strategy.auto_mode, strategy.global_batch_size = "full", _global_batch(dataloader)
    strategy.sequence_parallel.enable = sp
    model, optimizer = parallelize(model, optimizer, strategy=strategy, seq_len=seq_len)
    mesh = layer_state.mesh_of(model)
    if mesh is None:                                    # a pipelined model: plain batches on every rank
        return model, optimizer, SameOnEveryRank(dataloader, world)
    dims = "data" if "data" in mesh.dim_names and mesh.get_dim_size("data") > 1 else None
    return model, optimizer, shard_dataloader(dataloader, mesh, shard_dims=dims)


class SameOnEveryRank:
    """A pipelined model's loader: the user's batches as they come (``loader()``, ``iter(loader)``, ``len``), each
    tensor checked on real ranks to be the same on every rank (``data_agree``: a shuffle seeded per rank would
    feed the stages different batches)."""

    def __init__(self, dataloader, world: int):
        from autoparallel.mesh import ProcessMesh

        self._loader, self._mesh = dataloader, ProcessMesh(list(range(world)), dim_names=["world"])

    def __iter__(self):
        from autoparallel.data_agree import check_agree

        for batch in self._loader:
            for i, t in enumerate(_tensors(batch)):
                check_agree(t, self._mesh, None, False, f"batch tensor {i}")
            yield batch

    def __call__(self):
        return iter(self)

    def __len__(self):
        return len(self._loader)


def _tensors(batch) -> list:
    """The paddle tensors of a batch (a tensor, or lists, tuples and mappings of them), in order."""
    import paddle

    if isinstance(batch, paddle.Tensor):
        return [batch]
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return [t for x in items for t in _tensors(x)]


def _world_of(device_num, node_num) -> int:
    out = 1
    for name, value in (("device_num", device_num), ("node_num", node_num)):
        n = integral(value)
        if n is None or n < 1:
            raise TypeError(f"to_distributed: {name} must be a positive int, got {value!r}")
        out *= n
    return out


def _read_config(config):
    """(sequence length or None, sequence parallel) of paddle's or our ``ToDistributedConfig``."""
    if config is None:
        return None, False
    if not hasattr(config, "input_spec") or not hasattr(config, "sequence_parallel"):
        raise TypeError(f"to_distributed: config must be a ToDistributedConfig (input_spec, sequence_parallel), got "
                        f"{type(config).__name__}")
    if not isinstance(config.sequence_parallel, bool):
        raise TypeError(f"to_distributed: config.sequence_parallel must be True or False, got "
                        f"{config.sequence_parallel!r}")
    specs = config.input_spec
    if not specs:
        return None, config.sequence_parallel
    shape = list(getattr(specs[0], "shape", None) or [])
    seq = integral(shape[1]) if len(shape) >= 2 else None
    if seq is None or seq < 1:
        raise ValueError(f"to_distributed: config.input_spec[0] must have a known sequence length as its second dim "
                         f"(shape [batch, seq, ...]), got shape {shape}")
    return seq, config.sequence_parallel


def _global_batch(dataloader) -> int:
    """The loader's batch size: the global batch of one step (paddle's loader here is not yet distributed)."""
    sampler = getattr(dataloader, "batch_sampler", None)
    size = getattr(sampler, "batch_size", None) or getattr(dataloader, "batch_size", None)
    n = integral(size)
    if n is None or n < 1:
        raise ValueError(f"to_distributed: the dataloader must have a batch size (paddle.io.DataLoader with "
                         f"batch_size or a BatchSampler), got {type(dataloader).__name__} with batch size {size!r}")
    return n
