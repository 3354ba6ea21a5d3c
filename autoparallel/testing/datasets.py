"""Small datasets that tests and tools share: token id pairs (inputs, labels) and their paddle loader."""
from __future__ import annotations

import numpy as np
import paddle


class TokenPairs(paddle.io.Dataset):
    """``rows`` (input ids, label ids) pairs of ``seq`` tokens below ``vocab``, drawn from a fixed numpy seed."""

    def __init__(self, vocab: int, rows: int, seq: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.x = rng.integers(0, vocab, (rows, seq)).astype("int64")
        self.y = rng.integers(0, vocab, (rows, seq)).astype("int64")

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self):
        return len(self.x)


def token_pair_loader(vocab: int, batch: int, seq: int, batches: int = 2) -> paddle.io.DataLoader:
    """A paddle DataLoader of ``batches`` batches of ``batch`` token pairs (a BatchSampler, drop_last)."""
    data = TokenPairs(vocab, batches * batch, seq)
    return paddle.io.DataLoader(data, batch_sampler=paddle.io.BatchSampler(data, batch_size=batch, drop_last=True))
