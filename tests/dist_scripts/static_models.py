"""Small models for completion tests and benchmarks: plain paddle Layers no tensor-parallel template knows.

    MLP            x -> fc1 -> gelu -> fc2
    AttentionBlock x -> qkv -> heads -> softmax attention -> proj
    ResidualMLP    x -> x + fc2(gelu(fc1(x))) -> head       (a residual branch)
    Mixer          MLP-Mixer: patch stem, token-mixing and channel-mixing MLPs with residuals, mean pool, head
"""
import paddle
import paddle.nn.functional as F
from paddle import nn


class MLP(nn.Layer):
    def __init__(self, d=16, hidden=64, out=None):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, out or d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class AttentionBlock(nn.Layer):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        qkv = self.qkv(x).reshape([b, t, h, 3 * (d // h)])
        q, k, v = paddle.split(qkv, 3, axis=-1)
        q, k, v = (z.transpose([0, 2, 1, 3]) for z in (q, k, v))
        probs = F.softmax(paddle.matmul(q, k, transpose_y=True) * (1.0 / (d // h) ** 0.5), axis=-1)
        y = paddle.matmul(probs, v).transpose([0, 2, 1, 3]).reshape([b, t, d])
        return self.proj(y)


class ResidualMLP(nn.Layer):
    def __init__(self, d=32, hidden=128, out=16):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.head = nn.Linear(d, out)

    def forward(self, x):
        return self.head(x + self.fc2(F.gelu(self.fc1(x))))


class MixerBlock(nn.Layer):
    def __init__(self, patches, channels, token_hidden, channel_hidden):
        super().__init__()
        self.norm1 = nn.LayerNorm(channels)
        self.token1 = nn.Linear(patches, token_hidden)
        self.token2 = nn.Linear(token_hidden, patches)
        self.norm2 = nn.LayerNorm(channels)
        self.chan1 = nn.Linear(channels, channel_hidden)
        self.chan2 = nn.Linear(channel_hidden, channels)

    def forward(self, x):                                            # [b, patches, channels]
        y = self.norm1(x).transpose([0, 2, 1])                       # [b, channels, patches]
        y = self.token2(F.gelu(self.token1(y))).transpose([0, 2, 1])
        x = x + y
        return x + self.chan2(F.gelu(self.chan1(self.norm2(x))))


class Mixer(nn.Layer):
    """MLP-Mixer on pre-cut patches: [b, patches, patch_dim] -> logits [b, classes]."""

    def __init__(self, patches=16, patch_dim=48, channels=64, token_hidden=64, channel_hidden=256, depth=2,
                 classes=10):
        super().__init__()
        self.stem = nn.Linear(patch_dim, channels)
        self.blocks = nn.LayerList([MixerBlock(patches, channels, token_hidden, channel_hidden)
                                    for _ in range(depth)])
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(axis=1))


def mse(out, target):
    return ((out - target) ** 2).mean()


def xent(logits, labels):
    return F.cross_entropy(logits, labels)
