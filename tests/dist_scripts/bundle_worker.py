"""Every rank: several test scripts one after another in one launch (one process start, one import of paddle and
autoparallel, one process group), each run as ``__main__`` with its own argv and environment, as if launched alone.

argv: a JSON file [{"name", "script", "args": [...], "env": {...}}]. Before each script this rank writes the
script's index to ``$AP_RESULT_DIR/progress.rank{r}`` (the launcher's per-script deadline watches it); after
each, its result file holds {"done": {name: what the script passed to write_result}, "failed": None,
"seconds": {name: its run time}}. A script
that raises or exits non-zero is reported as {"failed": name, "error": traceback} and ends this rank with exit
code 1 at once: its peers may be waiting in one of its collectives, so the launcher stops the job and starts the
scripts after it again in a new one (shared_launch.py).
"""
import gc
import json
import os
import runpy
import sys
import time
import traceback

import paddle
import paddle.distributed as dist

import autoparallel as ap
from autoparallel.testing.launch import capture_results, write_result


def run(member: dict):
    env, argv = dict(os.environ), sys.argv
    os.environ.update(member.get("env") or {})
    sys.argv = [member["script"], *map(str, member["args"])]
    try:
        with capture_results() as got:
            try:
                runpy.run_path(member["script"], run_name="__main__")
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise RuntimeError(f"{member['script']} exited with code {e.code}") from e
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(env)
        reset()
    if len(got) != 1:
        raise RuntimeError(f"{member['script']} reported {len(got)} results through write_result, expected one")
    return got[0]


def reset():
    """What a script may leave behind in this process that the next one must not inherit."""
    from autoparallel import auto_checkpoint

    auto_checkpoint.reset()
    if not paddle.in_dynamic_mode():
        paddle.disable_static()
    paddle.set_default_dtype("float32")


def settle() -> None:
    """Before each script: collect, then freeze what survives (``gc.freeze``), so what earlier scripts left alive
    (paddle keeps layers and tensors reachable from C++) is no longer walked by every cyclic collection and every
    ``gc.get_objects()`` of the library in the scripts after them."""
    gc.collect()
    gc.freeze()


def progress(index: int) -> None:
    d = os.environ.get("AP_RESULT_DIR")
    if d:
        path = os.path.join(d, f"progress.rank{dist.get_rank()}")
        with open(path + ".tmp", "w") as f:
            f.write(str(index))
        os.replace(path + ".tmp", path)


def main():
    with open(sys.argv[1]) as f:
        members = json.load(f)
    # the article's entry point, first call in the process: the scripts' own calls then find the world made
    world = ap.init_parallel_env()
    if (world.rank, world.world_size) != (dist.get_rank(), dist.get_world_size()) or world.is_simulated:
        raise RuntimeError(f"ap.init_parallel_env() gave {world!r}, expected the real world of this launched rank")
    # the whole world's group first: paddle 3.3.1's gloo may fail to create it after smaller groups exist
    ap.ProcessMesh(list(range(dist.get_world_size())), ["data"])
    done, seconds, cpu = {}, {}, {}
    for i, member in enumerate(members):
        settle()
        progress(i)
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            done[member["name"]] = run(member)
            seconds[member["name"]] = time.perf_counter() - start
            cpu[member["name"]] = time.process_time() - cpu_start
        except BaseException:                               # noqa: BLE001  (reported to the test, then exit)
            error = traceback.format_exc()
            print(error, file=sys.stderr, flush=True)
            write_result({"done": done, "failed": member["name"], "error": error})
            os._exit(1)
        write_result({"done": done, "failed": None, "seconds": seconds, "cpu": cpu})
    progress(len(members))


if __name__ == "__main__":
    main()
