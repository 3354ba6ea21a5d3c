"""Speech in the simulated 4-rank world. PaddleFormers 1.2 ships no speech or omni model: ``whisper`` and
``qwen3_omni_moe`` hold a processor only (``pf.PROCESSOR_ONLY``; a test fails the day a model appears). What a user
trains on these inputs is their own encoder-decoder: here a Whisper-shaped one (a conv1d front end over the log-mel
features of PaddleFormers' ``WhisperFeatureExtractor``, pre-norm encoder and decoder layers named as Whisper's --
q/k/v/out_proj, fc1/fc2, cross attention, tied output embedding) under DP, the seed's shard function extended to
fc1/fc2/out_proj (TP), both on a 2x2 mesh, and ``auto_mode="full"``: loss and every gradient equal one process,
then one AdamW step and a forward do."""
import importlib
import pathlib

import numpy as np
import pytest

from autoparallel.testing import paddleformers_models as pf

pytestmark = pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")

import paddle  # noqa: E402
import paddle.nn.functional as F  # noqa: E402

import autoparallel as ap  # noqa: E402
from test_probe_heads_classifiers import check  # noqa: E402

MEL, D, HEADS, VOCAB, FRAMES, T = 16, 32, 4, 50, 100, 6


class Attention(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.q_proj, self.v_proj, self.out_proj = (paddle.nn.Linear(D, D) for _ in range(3))
        self.k_proj = paddle.nn.Linear(D, D, bias_attr=False)             # Whisper's key has no bias

    def forward(self, x, memory=None, causal=False):
        memory = x if memory is None else memory
        b, t, _ = x.shape
        s = memory.shape[1]

        def heads(y, n):
            return y.reshape([b, n, HEADS, D // HEADS]).transpose([0, 2, 1, 3])

        q, k, v = heads(self.q_proj(x), t), heads(self.k_proj(memory), s), heads(self.v_proj(memory), s)
        w = paddle.matmul(q, k, transpose_y=True) * (D // HEADS) ** -0.5
        if causal:
            w = w + paddle.triu(paddle.full([t, t], -1e9), 1)
        out = paddle.matmul(F.softmax(w, axis=-1), v).transpose([0, 2, 1, 3]).reshape([b, t, D])
        return self.out_proj(out)


class Block(paddle.nn.Layer):
    def __init__(self, cross):
        super().__init__()
        self.self_attn, self.self_attn_layer_norm = Attention(), paddle.nn.LayerNorm(D)
        self.encoder_attn = Attention() if cross else None
        self.encoder_attn_layer_norm = paddle.nn.LayerNorm(D) if cross else None
        self.fc1, self.fc2, self.final_layer_norm = paddle.nn.Linear(D, 2 * D), paddle.nn.Linear(2 * D, D), \
            paddle.nn.LayerNorm(D)

    def forward(self, x, memory=None):
        x = x + self.self_attn(self.self_attn_layer_norm(x), causal=memory is not None)
        if memory is not None:
            x = x + self.encoder_attn(self.encoder_attn_layer_norm(x), memory)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperShaped(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.conv1 = paddle.nn.Conv1D(MEL, D, 3, padding=1)
        self.conv2 = paddle.nn.Conv1D(D, D, 3, stride=2, padding=1)
        pos = np.arange(FRAMES // 2)[:, None] / 10000 ** (np.arange(0, D, 2) / D)
        self.register_buffer("enc_pos", paddle.to_tensor(np.concatenate([np.sin(pos), np.cos(pos)], 1), "float32"))
        self.encoder = paddle.nn.LayerList([Block(False) for _ in range(2)])
        self.embed_tokens = paddle.nn.Embedding(VOCAB, D)
        self.embed_positions = paddle.nn.Embedding(T, D)
        self.decoder = paddle.nn.LayerList([Block(True) for _ in range(2)])
        self.enc_norm, self.dec_norm = paddle.nn.LayerNorm(D), paddle.nn.LayerNorm(D)

    def forward(self, input_features, decoder_input_ids, labels):
        x = F.gelu(self.conv2(F.gelu(self.conv1(input_features)))).transpose([0, 2, 1]) + self.enc_pos
        for block in self.encoder:
            x = block(x)
        memory = self.enc_norm(x)
        y = self.embed_tokens(decoder_input_ids) + self.embed_positions(paddle.arange(decoder_input_ids.shape[1]))
        for block in self.decoder:
            y = block(y, memory)
        logits = paddle.matmul(self.dec_norm(y), self.embed_tokens.weight, transpose_y=True)     # tied proj_out
        return F.cross_entropy(logits, labels.unsqueeze(-1), ignore_index=-100)


def build(seed=0):
    paddle.seed(seed)
    model = WhisperShaped()
    pf._fill_zeros(model, seed)
    return model


def speech_batch(seed=0, b=4):
    """Log-mel features of four waveforms of different lengths (PaddleFormers' extractor pads them to 1 s),
    decoder ids after a start token and labels with -100 after each transcript's end."""
    from paddleformers.transformers.whisper.processor import WhisperFeatureExtractor

    rng = np.random.default_rng(seed)
    extractor = WhisperFeatureExtractor(feature_size=MEL, chunk_length=1)
    waves = [0.1 * rng.standard_normal(n).astype("float32") for n in np.resize([16000, 9000, 5000, 12000], b)]
    features = np.asarray(extractor(waves, sampling_rate=16000)["input_features"], "float32")
    lens = np.resize([T, 4, 2, 5], b)
    tokens = rng.integers(2, VOCAB, (b, T))
    labels = np.where(np.arange(T)[None] < lens[:, None], tokens, -100).astype("int64")
    ids = np.concatenate([np.ones((b, 1), "int64"), np.where(labels[:, :-1] < 0, 0, labels[:, :-1])], 1)
    return {"input_features": features, "decoder_input_ids": ids, "labels": labels}


def test_speech_families_ship_a_processor_and_no_model():
    import paddleformers.transformers as t

    for family, processor in pf.PROCESSOR_ONLY.items():
        assert family in pf.NOT_TEXT
        folder = pathlib.Path(t.__file__).parent / family
        assert not list(folder.glob("modeling*.py")), f"{family} now ships a model: run it here"
        assert hasattr(importlib.import_module(f"paddleformers.transformers.{family}"), processor)


def test_features_are_real_log_mels_and_the_model_reads_them():
    """The extractor's output is what the model sees (not zeros: a negative control on the data), and the
    padded tail of a short waveform differs from a long one's."""
    batch = speech_batch()
    assert batch["input_features"].shape == (4, MEL, FRAMES)
    f = batch["input_features"]
    assert np.abs(f[0, :, -10:] - f[2, :, -10:]).max() > 0.1
    loss = build()(**{k: paddle.to_tensor(v) for k, v in batch.items()})
    other = dict(batch, input_features=np.zeros_like(f))
    assert abs(float(loss) - float(build()(**{k: paddle.to_tensor(v) for k, v in other.items()}))) > 1e-4


@pytest.fixture
def speech_shard_fn(monkeypatch):
    """The seed's shard function with Whisper's names: fc1 column-parallel, fc2 and out_proj row-parallel."""
    monkeypatch.setattr(pf, "COL", pf.COL + ("fc1",))
    monkeypatch.setattr(pf, "ROW", pf.ROW + ("fc2", "out_proj"))


@pytest.mark.parametrize("mode", ["tp", "dptp", "full4", "full2"])     # full4: dp=4; full2: dp=2 x tp=2
def test_whisper_shaped_model_equals_one_process(mode, speech_shard_fn):
    check(build, speech_batch(), mode)


def test_the_extended_names_shard_the_model(speech_shard_fn):
    with ap.simulate(world_size=4):
        model = ap.shard_layer(build(), pf.mesh_2x2(), pf.seed_shard_fn)
        place = {n: str(p.placements) for n, p in model.named_parameters()}
    assert place["decoder.0.fc1.weight"] == place["encoder.1.self_attn.q_proj.weight"] == "[R, S(1)]"
    assert place["decoder.1.encoder_attn.out_proj.weight"] == place["encoder.0.fc2.weight"] == "[R, S(0)]"
    assert place["conv1.weight"] == "[R, R]"
