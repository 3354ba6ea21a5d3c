"""The world the monitor measures in: its size, whether it is simulated, and gathering every rank's timings."""
from __future__ import annotations

import json


def _simulated() -> bool:
    from autoparallel.comm.world import current_world

    return current_world().is_simulated


def _world_size() -> int:
    from autoparallel.comm.world import current_world

    return current_world().world_size


def _all_gather_json(obj, world_size: int) -> dict:
    """{rank: obj} from every rank: all_gather of the payload lengths, then of the padded payloads."""
    import numpy as np
    import paddle
    import paddle.distributed as dist

    payload = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).astype(np.int32)
    lengths = []
    dist.all_gather(lengths, paddle.to_tensor([len(payload)], dtype="int64"))
    size = max([int(t.numpy()[0]) for t in lengths] + [1])
    padded = np.zeros(size, dtype=np.int32)
    padded[:len(payload)] = payload
    parts = []
    dist.all_gather(parts, paddle.to_tensor(padded))
    out = {}
    for r, (n, part) in enumerate(zip(lengths, parts)):
        data = part.numpy()[:int(n.numpy()[0])].astype(np.uint8).tobytes()
        out[r] = json.loads(data.decode())
    return out
