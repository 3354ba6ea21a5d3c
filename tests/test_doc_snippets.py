"""The code README.md and docs/*.md show runs as written (tools/check_snippets.py reads the markers).

Every ```python block carries a marker; the ``run`` ones execute here, in this process, inside
``ap.simulate`` when they ask for ranks; a few are checked against one process. The example command lines'
flags parse with the examples' own parser, and every ``ap.<name>`` the docs mention exists.
"""
import dataclasses
import os
import shlex

import numpy as np
import paddle
import pytest

from tools.check_snippets import (ABSENT, all_snippets, extract, missing_imports, missing_names, program,
                                  public_names)
from tools._snippet_commands import command_lines, script_files, split_command

SNIPPETS = all_snippets()
RUN = [s for s in SNIPPETS if s.lang == "python" and s.marker == "run"]

# extra lines run after a block, in its world: values against one process computed in the same world
CHECKS = {
    ("README.md", "y2 = ap.reshard(y, mesh"): """
assert str(y.placements) == "[S(0), S(1)]" and str(y2.placements) == "[R, R]", (y.placements, y2.placements)
ref = F.gelu(paddle.matmul(x.full(), w.full()))
np.testing.assert_allclose(y2.full().numpy(), ref.numpy(), rtol=1e-4, atol=1e-3)   # K=1024 sums
""",
    ("README.md", 'plan = {"blocks.*.attn.qkv"'): """
assert str(model.blocks[0].attn.qkv.weight.placements) == "[R, S(1)]", model.blocks[0].attn.qkv.weight.placements
paddle.seed(0)
ref = GPT(config)                                 # the same weights in one process, before the step
want = float(F.cross_entropy(ref(ids), labels).mean())
np.testing.assert_allclose(float(loss), want, rtol=1e-5)
""",
    ("docs/fused_ops.md", 'check_user_rule("my_centre"'): """
from spmd_rules import unregister_spmd_rule
unregister_spmd_rule("my_centre")
assert failures and all(f.startswith("my_centre") for f in failures), failures
assert check_user_rule("my_centre", centre, np.random.rand(5, 4)) == ["my_centre: no rule registered "
                                                                      "(register_spmd_rule('my_centre'))"]
""",
    ("docs/export_and_inference.md", "state = ap.full_state_dict(model)"): """
ref = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.GELU(), paddle.nn.Linear(16, 8))
ref.set_state_dict(paddle.load("model.pdparams"))   # the saved file loads into the unparallelized model
sample = paddle.randn([3, 8])
want = ref(sample).numpy()
np.testing.assert_allclose(plain(sample).numpy(), want, rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(paddle.jit.load("infer/model")(sample).numpy(), want, rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(model(sample).full().numpy(), want, rtol=1e-5, atol=1e-6)
""",
    ("docs/lora.md", "model.save_pretrained(path)"): """
from paddleformers.peft import LoRAModel
one = LoRAModel.from_pretrained(LlamaForCausalLM(config), path)    # one process, the adapter saved above
full = ap.full_state_dict(model)
lora = {n: v for n, v in one.state_dict().items() if "lora" in n}
assert lora and all(n in full for n in lora), (sorted(lora)[:3], sorted(full)[:3])
for n, v in lora.items():
    np.testing.assert_allclose(full[n].numpy(), v.numpy(), rtol=1e-6, err_msg=n)
""",
    ("docs/lazy_init.md", "paddle.LazyGuard()"): """
paddle.seed(0)
eager = GPT(cfg)                                  # the same seed, built eagerly in one process
full = ap.full_state_dict(model)
assert sorted(full) == sorted(eager.state_dict())
for name, value in eager.state_dict().items():
    np.testing.assert_array_equal(full[name].numpy(), value.numpy(), err_msg=name)
""",
}


def _check_for(snip) -> str:
    rel = os.path.relpath(snip.path, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return "".join(code for (path, marker), code in CHECKS.items() if path == rel and marker in snip.text)


@pytest.mark.sim
@pytest.mark.parametrize("snip", RUN, ids=[s.where() for s in RUN])
def test_marked_block_runs(snip, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                       # a block may write files (a plot, a profile)
    snip.text += "\nimport numpy as np\n" + _check_for(snip)
    code = compile(program(snip), snip.where(), "exec")
    exec(code, {"__name__": "__snippet__"})


LAUNCH = [s for s in SNIPPETS if s.lang == "python" and s.marker == "launch"]


@pytest.mark.sim
@pytest.mark.parametrize("snip", LAUNCH, ids=[s.where() for s in LAUNCH])
def test_launch_program_runs_in_simulation(snip, tmp_path, monkeypatch, capsys):
    """A program shown for ``paddle.distributed.launch`` runs unchanged in ``ap.simulate`` with as many ranks
    (the real launch: ``tools/check_snippets.py --launch``); what it prints on rank 0 is printed once."""
    monkeypatch.chdir(tmp_path)
    snip.options = f"world_size={int(snip.options.split()[0])}"
    exec(compile(program(snip), snip.where(), "exec"), {"__name__": "__snippet__"})
    out = capsys.readouterr().out
    if "LlamaForCausalLM" in snip.text:               # the README's: 5 steps, the tied head vocab-parallel
        assert "True [R, S(0)]" in out, out
        text = snip.text.replace("degree = 2, 2", "degree = 1, 1")      # the same program on one rank
        text = text.split("\nif dist.get_rank() == 0:\n    print(model.lm_head")[0]    # (plain weights there)
        assert text != snip.text
        one = dataclasses.replace(snip, options="world_size=1", text=text)
        exec(compile(program(one), snip.where(), "exec"), {"__name__": "__snippet__"})
        want = capsys.readouterr().out
        np.testing.assert_allclose(_losses(out), _losses(want), rtol=1e-5)
        assert len(_losses(out)) == 5


def _losses(out: str) -> list:
    return [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")]


def test_checks_name_existing_blocks():
    """Each value check above finds its block (a renamed block must not leave its check behind)."""
    for path, marker in CHECKS:
        assert any(s.where().startswith(path + ":") and marker in s.text for s in RUN), (path, marker)


def test_every_python_block_is_marked(tmp_path):
    unmarked = [s.where() for s in SNIPPETS if s.lang == "python" and s.marker not in ("run", "launch", "skip")]
    assert unmarked == []
    doc = tmp_path / "x.md"                           # negative control: an unmarked block is seen as such
    doc.write_text("text\n\n```python\nprint(1)\n```\n\n<!-- snippet: run world_size=2 -->\n```python\nx\n```\n")
    found = extract(str(doc))
    assert [(s.marker, s.option("world_size")) for s in found] == [("", None), ("run", "2")]


def test_run_blocks_cover_the_readme():
    """The README's python blocks all run (here or, the launch one, under tools/check_snippets.py --launch)."""
    readme = [s for s in SNIPPETS if s.path.endswith("README.md") and s.lang == "python"]
    assert readme and all(s.marker in ("run", "launch") for s in readme), [(s.where(), s.marker) for s in readme]


def test_public_names_exist(tmp_path):
    assert len(public_names()) > 40
    assert missing_names() == []
    import autoparallel
    for name in ABSENT:                               # documented as absent: the error names the way
        with pytest.raises(AttributeError, match="sequence_parallel"):
            getattr(autoparallel, name)
    (tmp_path / "docs").mkdir()                       # negative control: a name that is not there
    (tmp_path / "README.md").write_text("call `ap.parallelize` then `ap.no_such_thing(x)`\n")
    assert missing_names(str(tmp_path)) == [("no_such_thing", "README.md:1")]


def test_documented_imports_exist(tmp_path):
    assert missing_imports() == []
    (tmp_path / "docs").mkdir()                       # negative control
    (tmp_path / "README.md").write_text("from autoparallel.profiler import averaged, no_such_helper\n")
    assert missing_imports(str(tmp_path)) == [("autoparallel.profiler.no_such_helper", "README.md:1")]


def _example_commands():
    out = []
    for where, cmd in command_lines(sorted({s.path for s in SNIPPETS}) + script_files(), extract):
        kind, target, args = split_command(cmd)
        if kind == "path" and target.startswith("examples/train_"):
            out.append((where, target, args))
    return out


EXAMPLES = _example_commands()


def test_example_command_lines_parse():
    """The flags every shown example command (docs and the examples' own docstrings) passes parse with the
    example's own parser."""
    from train_common import make_parser
    assert len(EXAMPLES) >= 8
    for where, target, args in EXAMPLES:
        model = "llama-tiny" if "llama" in target else "gpt-tiny"
        make_parser(model).parse_args(args)
    with pytest.raises(SystemExit):                   # negative control: a flag the example does not have
        make_parser("gpt-tiny").parse_args(shlex.split("--dp 2 --no-such-flag"))


def test_launch_separator_is_handed_on():
    """``launch ... train_gpt.py -- --auto`` (as the docs write it): the flags after ``--`` reach the script."""
    kind, target, args = split_command("python -m paddle.distributed.launch --nproc_per_node 4 "
                                       "examples/train_gpt.py -- --auto --steps 2")
    assert (kind, target, args) == ("path", "examples/train_gpt.py", ["--auto", "--steps", "2"])
    assert paddle.__version__                         # the suite's paddle, for the record in a failure
    assert np.__version__
