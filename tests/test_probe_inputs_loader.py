"""``ap.shard_dataloader`` over the batches users load: nested dict fields, numpy batches, a last short batch, int32
ids, two epochs, a PaddleFormers model fed from it (simulated world); on 2 real gloo ranks (one shared launch job,
dist_scripts/inputs_worker.py) batches that differ across ranks raise instead of training on a mix of batches."""
import os

import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.testing import paddleformers_models as pf
from dist_scripts import shared_launch

JOB = shared_launch.job(__name__, "inputs_loader", os.path.join(os.path.dirname(__file__), "dist_scripts",
                                                                "inputs_worker.py"), 2, timeout=200)


class Nested(paddle.io.Dataset):
    """Items {"inputs": {"ids": int32 [4], "mask": [4]}, "labels": [1]} of numpy arrays; 10 items."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        ids = np.arange(i * 4, i * 4 + 4).astype("int32")
        return {"inputs": {"ids": ids, "mask": (ids % 3 > 0).astype("int64")}, "labels": np.array([i], "int64")}


def _leaves(b, out=None, path=""):
    out = {} if out is None else out
    if isinstance(b, dict):
        for k, v in b.items():
            _leaves(v, out, f"{path}/{k}")
    elif isinstance(b, (list, tuple)):
        for k, v in enumerate(b):
            _leaves(v, out, f"{path}/{k}")
    else:
        out[path] = b
    return out


def test_nested_fields_and_the_last_short_batch_over_two_epochs():
    """Every tensor of a nested dict field is laid out like its field (it stayed a plain tensor before); the last
    batch of 2 (10 items, batch 4, drop_last=False) splits 1 + 1; a second epoch gives the same batches."""
    plain = [_leaves(b) for b in paddle.io.DataLoader(Nested(), batch_size=4)]
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
        loader = ap.shard_dataloader(paddle.io.DataLoader(Nested(), batch_size=4), mesh, shard_dims="data")
        assert len(loader) == 3
        for _ in range(2):
            got = [_leaves(b) for b in loader]
            assert [list(g) for g in got] == [list(p) for p in plain] and len(got) == 3
            for g, p in zip(got, plain):
                for k, v in g.items():
                    assert v.placements == [ap.Shard(0), ap.Replicate()], k
                    assert str(v.dtype) == str(p[k].dtype) and np.array_equal(v.full().numpy(), p[k].numpy()), k
        assert [list(got[-1]["/inputs/ids"].local_of(r).shape) for r in range(4)] == [[1, 4]] * 4


def test_numpy_batches_are_laid_out_and_input_keys_without_a_dict_batch_raise():
    batches = [(np.arange(12, dtype="float32").reshape(4, 3), np.arange(4))]
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["data"])
        x, y = next(iter(ap.shard_dataloader(batches, mesh, shard_dims="data")))
        assert x.placements == [ap.Shard(0)] and np.array_equal(x.full().numpy(), batches[0][0])
        assert np.array_equal(y.full().numpy(), batches[0][1])
        with pytest.raises(ValueError, match=r"input_keys=\['x'\] names fields of a dict batch, but the loader "
                                             r"yields a tuple"):
            next(iter(ap.shard_dataloader(batches, mesh, input_keys=["x"], shard_dims="data")))


def test_a_list_of_meshes_lays_out_a_list_field_element_by_element():
    """paddle's nested ``meshes=[m0, [m0, m1]]``: field 1 (a list) has element j on mesh j (pipeline inputs on
    different stages); it raised a TypeError before. A tensor field given a list of meshes raises."""
    batch = [paddle.arange(8.0).reshape([4, 2]), [paddle.ones([4, 2]), paddle.zeros([4, 3])]]
    with ap.simulate(world_size=4):
        m0, m1 = ap.ProcessMesh([0, 1], dim_names=["d"]), ap.ProcessMesh([2, 3], dim_names=["d"])
        x, (a, b) = next(iter(ap.shard_dataloader([batch], [m0, [m0, m1]], shard_dims=["d", ["d", None]])))
        assert [(t.mesh.process_ids, t.placements) for t in (x, a, b)] == \
            [([0, 1], [ap.Shard(0)]), ([0, 1], [ap.Shard(0)]), ([2, 3], [ap.Replicate()])]
        assert np.array_equal(b.full().numpy(), np.zeros([4, 3])) and np.array_equal(x.full().numpy(), batch[0].numpy())
        with pytest.raises(ValueError, match="a list of 2 meshes lays out a list field element by element, but the "
                                             "field is a Tensor"):
            next(iter(ap.shard_dataloader([batch[0]], [[m0, m1]], shard_dims="d")))


@pytest.mark.skipif(not pf.available(), reason="paddleformers not installed (pip install -e .[models])")
def test_paddleformers_llama_fed_by_shard_dataloader_equals_one_process():
    """Dict batches (int32 ids, -100 labels filling data shard 0, a left-padding mask with position ids) through
    shard_dataloader into a Llama under dp2 x tp2 with sequence parallel: loss and one SGD step as one process."""
    ids, labels = pf.batch(0)
    labels[:2] = -100
    mask = np.ones(ids.shape, "int64")
    mask[2, :3] = 0
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    rows = [dict(input_ids=ids[i].astype("int32"), labels=labels[i], attention_mask=mask[i], position_ids=pos[i])
            for i in range(4)]

    def step(loader_of, layout=None):
        model = pf.build("llama", 0, fill_zeros=True)
        opt = paddle.optimizer.SGD(0.5, parameters=model.parameters())
        if layout:
            s = ap.Strategy()
            s.data_parallel.degree, s.tensor_parallel.degree, s.sequence_parallel.enable = 2, 2, True
            model, opt = ap.parallelize(model, opt, strategy=s)
        batch = next(iter(loader_of(paddle.io.DataLoader(rows, batch_size=4))))
        loss = pf.loss_of(model(**batch))
        loss.backward()
        opt.step()
        return float(loss), {n: (p.full() if hasattr(p, "full") else p).numpy() for n, p in model.named_parameters()}

    ref = step(lambda ld: ld)
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
        got = step(lambda ld: ap.shard_dataloader(ld, mesh, shard_dims="data"), layout=True)
    assert np.isclose(got[0], ref[0], rtol=1e-5)
    for n, v in ref[1].items():
        np.testing.assert_allclose(got[1][n], v, rtol=1e-4, atol=1e-5, err_msg=n)


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


def test_real_ranks_agreeing_batches_pass_and_disagreeing_ones_raise(ranks):
    """Seeded alike, the shuffled global batch is laid out (each rank holds its half; two epochs). paddle.seed does
    not seed the DataLoader's shuffle (numpy's generator does), and ``paddle.randint`` drawn per rank: each rank
    would keep a slice of a different batch; it raises naming the mesh dim."""
    for r in ranks:
        assert r["same_global"] is True, r
        for check in ("paddle_seed_only_shuffle", "rank_drawn"):
            assert r[check].startswith("ValueError") and "differs between the ranks [0, 1] of mesh dim 'data'" in \
                r[check] and "same global batch on every rank" in r[check], r[check]
        assert r["rank_drawn_unchecked"] == [4, 8], r       # check_agreement=False: laid out, no check


def test_real_ranks_split_parts(ranks):
    """is_dataset_splitted=True: paddle's DistributedBatchSampler with drop_last=False pads, so the last parts
    are short but equal (global 2 rows); parts of different sizes, and replicas (a tensor-parallel dim) holding
    different parts, raise."""
    for r in ranks:
        assert r["split_sampler"] == [[8, 3], [2, 3]], r
        assert r["split_uneven"].startswith("ValueError") and "local parts of different shapes" in r["split_uneven"]
        assert "differs between the ranks [0, 1] of mesh dim 'model'" in r["split_replicas_differ"], r


def test_real_ranks_loaders_of_different_lengths_raise_on_every_rank(ranks):
    """Split loaders of 3 and 2 batches: the rank whose loader ran out left its peer waiting in the next batch's
    collectives. Every rank now raises at that batch, naming the ranks that ran out, and later collectives pair."""
    for r in ranks:
        seen, message, after = r["split_lengths_differ"]
        assert seen == [80.0, 96.0], seen          # batch k: rank 0's 8 values of k, rank 1's 8 of 10 + k
        assert "ran out after 2 batches" in message and "the ranks [1]" in message, message
        assert after == 4.0
        assert r["same_lengths_end_together"] == [2, 2], r


def test_real_ranks_pipeline_meshes_loaders_of_different_lengths_raise_on_every_rank(ranks):
    """One mesh per field, [0] and [1] (a pipeline's stages), loaders of 3 and 2 batches: checked over the first
    field's mesh alone, rank 1 never took part and the ranks silently went through 3 and 2 batches. The check now
    runs over the union of the meshes (the whole world here): both ranks raise at the third batch."""
    for r in ranks:
        seen, message, *after = r["pipeline_lengths_differ"]
        assert seen == [0.0, 1.0], (seen, message)
        assert "ran out after 2 batches" in message and "the ranks [1]" in message, message
        assert after == [4.0]


def test_real_ranks_batches_of_different_structures_raise_on_every_rank(ranks):
    """A dict key missing, None for a tensor, another field count, a list field of another length for a list of
    meshes, a 0-d tensor for a split field: on rank 1 only. Every rank raises a ValueError naming the field and
    what differs, before the batch's collectives, and a collective afterwards pairs (the watchdog ended the job)."""
    want = {"key_missing": "batch field 'labels' is a tensor on some ranks and missing on others",
            "none_field": "batch field 1 is a tensor on some ranks and a plain value (no tensor) on others",
            "field_count": "the batch has 2 fields on some ranks and 3 on others",
            "list_length": "batch field 1 has 1 entries on some ranks and 2 on others",
            "zero_d_split": "batch field 1 has ndim 0 on some ranks and 1 on others"}
    for rank, r in enumerate(ranks):
        got = r["structure_differs"]
        assert isinstance(got, dict), got
        for case, text in want.items():
            assert len(got[case]) == 2, (case, got[case])
            message, after = got[case]
            assert "has a different structure on the ranks of the mesh [0, 1]" in message and text in message \
                and f"this rank {rank}" in message, (case, message)
            assert after == 4.0, case
