"""Run the code the README and docs show, as written.

Every fenced block of README.md and docs/*.md is read. A python block is run when a marker comment
stands on the line before its fence:

    <!-- snippet: run -->                       the block alone, in a fresh process
    <!-- snippet: run world_size=4 -->          inside ``ap.simulate(world_size=4)``
    <!-- snippet: run setup=gpt world_size=4 --> after the named setup below (the names a fragment
                                                assumes: model, opt, mesh, s, ids, labels ...)
    <!-- snippet: launch 4 -->                  a whole program for ``paddle.distributed.launch``
    <!-- snippet: skip REASON -->               shown, not run (a fragment, a GPU, a printed output)

A ``python`` command line shown for a tool or an example (in a fence or in inline code) is checked by
parsing its flags with the script's own argparse parser (nothing runs past ``parse_args``).
``ap.<name>`` anywhere in the text must be a public name of ``autoparallel``.

    python tools/check_snippets.py                  # run the marked blocks, check flags and names
    python tools/check_snippets.py --list           # the table of blocks and their markers
    python tools/check_snippets.py --launch         # also the marked launch programs (slow)
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import subprocess
import sys
import tempfile

try:
    from tools._snippet_commands import check_command, command_lines, script_files
except ImportError:         # run as `python tools/check_snippets.py`: this file's folder is on the path
    from _snippet_commands import check_command, command_lines, script_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
MARKER = re.compile(r"<!--\s*snippet:\s*(\w+)\s*(.*?)\s*-->")
AP_NAME = re.compile(r"(?<![\w.])(?:ap|auto_parallel)\.([A-Za-z_]\w*)")
# names the docs say are deliberately absent: reaching for them raises AttributeError naming the way
ABSENT = {"SequenceParallelBegin"}
FROM_IMPORT = re.compile(r"from ((?:autoparallel|spmd_rules|reshard)(?:\.\w+)*) import (\w+(?:,\s*\w+)*)")

_GPT = """
import paddle, paddle.nn.functional as F
import autoparallel as ap
import autoparallel as auto_parallel     # the article's spelling
from models.gpt import GPT, PRESETS
paddle.seed(0)
config = cfg = PRESETS["gpt-tiny"]
model = GPT(config)
opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
ids = x = data = paddle.randint(0, config.vocab_size, [4, 16])
labels = y = paddle.randint(0, config.vocab_size, [4, 16])
s = strategy = ap.Strategy()
s.data_parallel.degree, s.tensor_parallel.degree = 2, 2
"""
_MLP = """
import paddle
import autoparallel as ap
paddle.seed(0)
model = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.GELU(), paddle.nn.Linear(16, 8))
opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
s = ap.Strategy()
s.tensor_parallel.degree = 2
model, opt = ap.parallelize(model, opt, strategy=s, tp_plan={"0": ap.ColWiseParallel(), "2": ap.RowWiseParallel()})
"""
_PF_LLAMA = """
import paddle
import autoparallel as ap
from paddleformers.transformers import LlamaConfig, LlamaForCausalLM
paddle.seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, fuse_rms_norm=False)
model = LlamaForCausalLM(config)
s = ap.Strategy()
s.data_parallel.degree, s.tensor_parallel.degree = 2, 2
path = "lora_out"
"""
SETUPS = {
    # what the fragments assume: a small GPT (model, opt, config / cfg), a 2x2 ["data", "model"] mesh,
    # a batch (ids / x, labels / y) and a dp=2 tp=2 Strategy (s / strategy)
    "gpt": _GPT,
    # the same, parallelized (the model and optimizer a step runs on)
    "gpt_parallel": _GPT + "model, opt = ap.parallelize(model, opt, strategy=s)\n",
    # a small MLP on 8 features, tensor parallel over 2 ranks (what the export fragment assumes)
    "mlp_parallel": _MLP,
    # a small PaddleFormers Llama and a dp=2 tp=2 Strategy (what the LoRA fragment assumes)
    "pf_llama": _PF_LLAMA,
}


@dataclasses.dataclass
class Snippet:
    path: str
    line: int
    lang: str
    text: str
    marker: str = ""        # run / launch / skip / "" (unmarked)
    options: str = ""

    def where(self) -> str:
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"

    def option(self, key: str, default=None):
        m = re.search(rf"\b{key}=(\S+)", self.options)
        return m.group(1) if m else default


def doc_files(root: str = ROOT) -> list:
    return [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))


def extract(path: str) -> list:
    """Every fenced block of one markdown file, with the marker on the line before it."""
    lines = open(path, encoding="utf-8").read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            j += 1
        marker = MARKER.search(lines[i - 1]) if i else None
        body = [ln[len(m.group(1)):] if ln.startswith(m.group(1)) else ln for ln in lines[i + 1:j]]
        out.append(Snippet(path, i + 1, m.group(2), "\n".join(body),
                           marker.group(1) if marker else "", marker.group(2) if marker else ""))
        i = j + 1
    return out


def all_snippets(root: str = ROOT) -> list:
    return [s for f in doc_files(root) for s in extract(f)]


def program(snip: Snippet) -> str:
    """The file a marked ``run`` block becomes: setup, then the block, in a simulated world if asked."""
    setup = SETUPS[snip.option("setup")] if snip.option("setup") else ""
    body = setup + "\n" + snip.text + "\n"
    world = snip.option("world_size")
    if not world:
        return body
    indented = "\n".join("    " + ln for ln in body.split("\n"))
    return f"import autoparallel as _ap\nwith _ap.simulate(world_size={int(world)}):\n{indented}\n"


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    paths = [ROOT, os.path.join(ROOT, "examples")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_block(snip: Snippet, timeout: float = 120) -> tuple:
    """(ok, output) of one ``run`` block in a fresh interpreter, from a scratch directory."""
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "snippet.py")
        with open(script, "w") as f:
            f.write(program(snip))
        proc = subprocess.run([sys.executable, script], cwd=tmp, env=_env(), capture_output=True,
                              text=True, timeout=timeout)
    return proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def run_launch(snip: Snippet, timeout: float = 600) -> tuple:
    """(ok, output) of one ``launch N`` program under ``paddle.distributed.launch``."""
    n = int(snip.options.split()[0])
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "snippet.py")
        with open(script, "w") as f:
            f.write(snip.text + "\n")
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(n),
               "--log_dir", os.path.join(tmp, "log"), script]
        proc = subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=timeout)
        logs = "".join(open(p).read() for p in sorted(glob.glob(os.path.join(tmp, "log", "workerlog.*"))))
    return proc.returncode == 0, (proc.stdout + proc.stderr + logs)[-4000:]




def public_names(root: str = ROOT) -> dict:
    """{name: first place} for every ``ap.<name>`` the docs mention."""
    names = {}
    for path in doc_files(root):
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            for name in AP_NAME.findall(line):
                names.setdefault(name, f"{os.path.relpath(path, root)}:{n}")
    return names


def missing_names(root: str = ROOT) -> list:
    import autoparallel
    return [(name, where) for name, where in sorted(public_names(root).items())
            if (name in ABSENT) == hasattr(autoparallel, name)]


def missing_imports(root: str = ROOT) -> list:
    """``from autoparallel.x import y`` (spmd_rules, reshard alike) forms in the docs whose name does not import."""
    import importlib
    bad = []
    for path in doc_files(root):
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            for module, names in FROM_IMPORT.findall(line):
                try:
                    mod = importlib.import_module(module)
                    absent = [x for x in re.split(r"[,\s]+", names.strip()) if x and not hasattr(mod, x)]
                except ImportError as e:
                    absent = [str(e)]
                bad += [(f"{module}.{x}", f"{os.path.relpath(path, root)}:{n}") for x in absent]
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--list", action="store_true", help="print the blocks and their markers, run nothing")
    p.add_argument("--launch", action="store_true", help="also run the 'launch N' programs (slow)")
    p.add_argument("--no-commands", action="store_true", help="skip the command-line flag checks")
    args = p.parse_args(argv)
    snips = all_snippets()
    failures = 0
    for s in snips:
        if s.lang != "python" and not args.list:
            continue
        if args.list or s.marker in ("", "skip") or (s.marker == "launch" and not args.launch):
            if s.lang == "python" or args.list:
                marker = s.marker or ("UNMARKED" if s.lang == "python" else "")
                print(f"{s.where():40s} {s.lang or '-':7s} {marker} {s.options}")
            if s.lang == "python" and not s.marker and not args.list:
                failures += 1
            continue
        ok, out = run_block(s) if s.marker == "run" else run_launch(s)
        print(f"{s.where():40s} {s.marker} {s.options}: {'ok' if ok else 'FAILED'}")
        if not ok:
            failures += 1
            print(out)
    if not args.list and not args.no_commands:
        for where, cmd in command_lines(doc_files() + script_files(), extract):
            err = check_command(cmd)
            print(f"{where:40s} {'ok' if err is None else 'FAILED: ' + err}  {cmd[:90]}")
            failures += err is not None
    for name, where in ([] if args.list else missing_names()):
        print(f"{where:40s} ap.{name}: " + ("documented as absent but present" if name in ABSENT
                                            else "not a public name of autoparallel"))
        failures += 1
    for name, where in ([] if args.list else missing_imports()):
        print(f"{where:40s} from-import of {name}: no such name")
        failures += 1
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
