"""ap.to_static (the captured graph) fed from the loaders users bring: a dataset of dict items (paddle reads
their values in order, the last one the label), nested items, and a loader over paddle's DistributedBatchSampler
that yields each rank's own part."""
import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.testing import paddleformers_models as pf

pytestmark = [pytest.mark.sim, pytest.mark.skipif(not pf.available(), reason="PaddleFormers is not installed")]

B, T, LR = 4, 8, 0.1


class DictItems(paddle.io.Dataset):
    """{input_ids, attention_mask, labels} per item, as a tokenised text dataset yields them."""

    def __init__(self, n=8, nested=False):
        rng = np.random.default_rng(0)
        self.ids = rng.integers(0, pf.VOCAB, (n, T)).astype("int64")
        self.labels = rng.integers(0, pf.VOCAB, (n, T)).astype("int64")
        self.mask = np.ones((n, T), "int64")
        self.mask[1::2, :2] = 0                       # some left padding: the mask changes the loss
        self.nested = nested

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if self.nested:
            return (self.ids[i], self.mask[i]), self.labels[i]
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class CausalLMLoss(paddle.nn.Layer):
    """The loss as a Layer over the model's output (a tuple, logits first) and the labels."""

    def forward(self, out, labels):
        logits = out.logits if hasattr(out, "logits") else out[0]
        return paddle.nn.functional.cross_entropy(logits.reshape([-1, pf.VOCAB]), labels.reshape([-1]))


def _strategy(dp=2, tp=1):
    s = ap.Strategy()
    s.data_parallel.degree = dp
    s.tensor_parallel.degree = tp
    return s


def _reference(ds, steps=2, family="qwen3"):
    model = pf.build(family, 0)
    opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
    loss_fn, losses = CausalLMLoss(), []
    for i in range(steps):
        ids, mask, labels = (paddle.to_tensor(a[i * B:(i + 1) * B]) for a in (ds.ids, ds.mask, ds.labels))
        loss = loss_fn(model(ids, mask), labels)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: p.numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("nested", [False, True], ids=["dict", "nested"])
def test_a_loader_of_dict_or_nested_items_gives_paddles_fields_and_equals_one_process(nested):
    """paddle's dist.to_static reads a dict item as its values in order and flattens nested items; the spec
    reader took the dict (or the inner tuple) as one field and failed on dtype('O') (or stacked ids and mask into
    one [B, 2, T] field)."""
    ds = DictItems(nested=nested)
    ref, ref_params = _reference(ds)
    loader = paddle.io.DataLoader(ds, batch_size=B, shuffle=False)
    with ap.simulate(world_size=4):
        model = pf.build("qwen3", 0)
        dm = ap.to_static(model, loader, CausalLMLoss(), paddle.optimizer.SGD(LR, parameters=model.parameters()),
                          _strategy(2, 2))
        assert dm._specs == [([B, T], "int64")] * 3
        dm.train()
        got = []
        for batch in loader:
            # paddle's call forms: a list of the fields, or the nested item's parts as arguments
            got.append(float(dm(list(batch.values())) if isinstance(batch, dict) else dm(*batch)))
            if len(got) == 2:
                break
        params = dm.state_dict(True)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    for name, value in ref_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_loader_over_a_per_rank_distributed_batch_sampler_is_refused():
    """Each rank's DistributedBatchSampler part read as the global batch: every rank would keep its slice of a
    different batch (half of the data dropped at dp 2, tensor-parallel replicas disagreeing), silently."""
    ds = DictItems()
    with ap.simulate(world_size=2):
        model = pf.build("qwen3", 0)
        opt = paddle.optimizer.SGD(LR, parameters=model.parameters())
        per_rank = paddle.io.DataLoader(ds, batch_sampler=paddle.io.DistributedBatchSampler(
            ds, batch_size=B, num_replicas=2, rank=0))
        with pytest.raises(ValueError, match="splits the dataset over 2 replicas .*plain batch sampler"):
            ap.to_static(model, per_rank, CausalLMLoss(), opt, _strategy())
        whole = paddle.io.DataLoader(ds, batch_sampler=paddle.io.DistributedBatchSampler(
            ds, batch_size=B, num_replicas=1, rank=0))
        assert ap.to_static(model, whole, CausalLMLoss(), opt, _strategy())._specs == [([B, T], "int64")] * 3


def test_gemma3_whose_norm_casts_a_float32_weight_to_float32_equals_one_process():
    """Gemma3's norm computes ``1.0 + self.weight.float()``: on the plain parameter the capture saw, paddle's
    ``.float()`` of a float32 tensor is the tensor itself (no op); on the distributed parameter of the run it
    recorded a cast, and the run no longer matched the captured graph ("pinned layouts expected op 9 to be 'add',
    the forward ran 'cast'") at every layout. Same-dtype conversions (``float()``, ``type_as``, ...) of a
    distributed tensor are now the tensor itself, as paddle's."""
    ds = DictItems()
    ref, ref_params = _reference(ds, family="gemma3")
    loader = paddle.io.DataLoader(ds, batch_size=B, shuffle=False)
    with ap.simulate(world_size=2):
        model = pf.build("gemma3", 0)
        dm = ap.to_static(model, loader, CausalLMLoss(), paddle.optimizer.SGD(LR, parameters=model.parameters()),
                          _strategy(2, 1))
        dm.train()
        got = [float(dm(list(batch.values()))) for _, batch in zip(range(2), loader)]
        params = dm.state_dict(True)
        w = ap.shard_tensor(paddle.ones([2]), ap.ProcessMesh([0, 1]), [ap.Replicate()])
        assert w.float() is w and w.type_as(paddle.ones([1])) is w and w.double() is not w
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    for name, value in ref_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
