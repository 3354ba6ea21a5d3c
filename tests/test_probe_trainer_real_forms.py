"""In one process: what decides how PaddleFormers' Trainer and hapi run on several launched ranks -- the Trainer
options refused there (its own hybrid parallelism, its default sharding="stage1", mixed precision), the model
layouts refused (no ap.parallelize data dim), and the import hook that patches a module imported after
autoparallel installed its patches."""
import sys
import types

import paddle
import pytest

import autoparallel as ap
from autoparallel import after_import, trainer_ranks, trainer_resume


def args(**kw):
    base = dict(tensor_model_parallel_size=-1, pipeline_model_parallel_size=-1, sep_parallel_size=-1,
                context_parallel_size=-1, expert_model_parallel_size=-1, enable_auto_parallel=False, fp16=False,
                bf16=False, use_expert_parallel=False, sharding=[], save_checkpoint_format="flex_checkpoint")
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("kw,named", [({"sharding": [types.SimpleNamespace(value="stage1")]}, "sharding='stage1'"),
                                      ({"tensor_model_parallel_size": 2}, "tensor_model_parallel_size=2"),
                                      ({"bf16": True}, "bf16=True"),
                                      ({"save_checkpoint_format": "unified_checkpoint"}, "unified_checkpoint")])
def test_trainer_options_of_its_own_parallelism_are_refused(kw, named):
    with pytest.raises(NotImplementedError, match=named):
        trainer_ranks._refuse_options(args(**kw), 2)
    trainer_ranks._refuse_options(args(), 2)                  # plain mode passes


def test_layout_needs_the_data_dim_of_parallelize():
    with ap.simulate(world_size=2):
        plain = ap.shard_layer(paddle.nn.Linear(2, 2), ap.ProcessMesh([0, 1], dim_names=["dp"]))
        with pytest.raises(NotImplementedError, match="no such mesh"):
            trainer_ranks.layout(plain, 2, "hapi's paddle.Model")
        s = ap.Strategy()
        s.data_parallel.degree = 2
        model, _ = ap.parallelize(paddle.nn.Linear(2, 2), None, strategy=s)
        r = trainer_ranks.layout(model, 2, "hapi's paddle.Model")
        assert (r.dp, r.index) == (2, 0)


def test_after_import_runs_once_as_the_import_ends(tmp_path, monkeypatch):
    (tmp_path / "ap_probe_late_module.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import.watch("ap_probe_late_module", lambda: seen.append(sys.modules["ap_probe_late_module"].VALUE))
    after_import.watch("ap_probe_late_module", lambda: seen.append("second"))   # runs too, in order
    try:
        import ap_probe_late_module  # noqa: F401
        assert seen == [7, "second"] and "ap_probe_late_module" not in after_import._PENDING
        after_import.watch("ap_probe_late_module", lambda: seen.append("again"))   # already imported: nothing
        assert seen == [7, "second"]
    finally:
        sys.modules.pop("ap_probe_late_module", None)
        after_import._PENDING.pop("ap_probe_late_module", None)


def test_trainer_checkpoint_forms_over_a_distributed_model():
    """The flex checkpoint (the default) passes with save_steps under ZeRO (it was refused there); a format that
    writes paddle.save(optimizer.state_dict()) on the saving rank only, or reads another layout, is refused."""
    def targs(**kw):
        base = dict(save_strategy="steps", save_checkpoint_format="flex_checkpoint",
                    load_checkpoint_format="flex_checkpoint", ignore_save_lr_and_optim=False)
        return types.SimpleNamespace(**{**base, **kw})

    trainer_resume.refuse_forms(targs(), "T")
    trainer_resume.refuse_forms(targs(save_checkpoint_format=None, save_strategy="no"), "T")   # nothing saved
    for kw, named in (({"save_checkpoint_format": None}, "save_checkpoint_format=None"),
                      ({"save_checkpoint_format": "unified_checkpoint"}, "unified_checkpoint"),
                      ({"load_checkpoint_format": None}, "load_checkpoint_format=None"),
                      ({"load_from_hf": True}, "load_from_hf=True"),
                      ({"sharded_model_from_ema": True}, "sharded_model_from_ema=True")):
        with pytest.raises(NotImplementedError, match=named):
            trainer_resume.refuse_forms(targs(**kw), "T")
