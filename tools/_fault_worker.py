"""One rank of a fault-matrix run: the training example (examples/train_common.py, watchdog on by default)
with one fault injected into one rank. ``AP_FAULT=<phase>:<signal>:<victim rank>:<n>`` (phase forward |
backward | save | load, signal kill | stop): the victim sends itself SIGKILL or SIGSTOP in its n-th forward,
backward, checkpoint save (its own part, before it writes) or checkpoint read (n from 1). Every rank appends events to
``$AP_FAULT_OUT/rank<r>.jsonl`` (started with its pid, fault with the time, done with the hash of its final
parameters). Usage: python -m paddle.distributed.launch ... tools/_fault_worker.py <train_gpt.py flags>"""
import hashlib
import os
import signal
import sys
import time


from autoparallel.testing import events  # noqa: E402
from examples import train_common  # noqa: E402

RANK = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
OUT = os.environ["AP_FAULT_OUT"]


def note(kind: str, **fields) -> None:
    events.note(OUT, RANK, kind, **fields)


def parse_fault(text: str):
    if not text:
        return None
    phase, sig, victim, nth = text.split(":")
    if phase not in ("forward", "backward", "save", "load") or sig not in ("kill", "stop"):
        raise ValueError(f"AP_FAULT must be <forward|backward|save|load>:<kill|stop>:<rank>:<n>, got {text!r}")
    return phase, sig, int(victim), int(nth)


FAULT = parse_fault(os.environ.get("AP_FAULT", ""))
_count = {"forward": 0, "backward": 0, "save": 0, "load": 0}


def reached(phase: str) -> None:
    """Count ``phase`` on this rank; the victim signals itself at the chosen occurrence."""
    _count[phase] += 1
    if FAULT is None or FAULT[0] != phase or FAULT[2] != RANK or _count[phase] != FAULT[3]:
        return
    from autoparallel import watchdog

    wd = watchdog.current()
    if wd is not None:                   # a heartbeat naming this phase first, as a fault mid-phase would see
        beats = wd.beats
        while wd.beats < beats + 2:
            time.sleep(0.01)
    note("fault", phase=phase, signal=FAULT[1])
    os.kill(os.getpid(), signal.SIGKILL if FAULT[1] == "kill" else signal.SIGSTOP)


def _wrap(module, name: str, phase: str) -> None:
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
        reached(phase)
        return original(*args, **kwargs)

    setattr(module, name, wrapped)


def _hooked_build(build):
    def build_with_hooks(config):
        model = build(config)

        def pre(layer, inputs):
            reached("forward")

        def post(layer, inputs, output):
            local = getattr(output, "local", output)
            if not local.stop_gradient:
                local.register_hook(lambda grad: reached("backward"))

        model.register_forward_pre_hook(pre)
        model.register_forward_post_hook(post)
        return model

    return build_with_hooks


def main(argv) -> None:
    import autoparallel.checkpoint.load as load_module
    import autoparallel.checkpoint.save as save_module

    train_common.build = _hooked_build(train_common.build)
    _wrap(save_module, "_save_multi", "save")           # every rank's part of a save, writer or not
    _wrap(load_module, "_fill", "load")
    note("started")
    parser = train_common.make_parser("gpt-tiny")
    args = parser.parse_args(argv)
    train_common.check_args(parser, args, train_common.init_distributed(args.watchdog))
    log, model, _ = train_common.train(args)
    digest = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(p.numpy().tobytes())
    note("done", params=digest.hexdigest(), losses=[s["loss"] for s in log["steps"]])


if __name__ == "__main__":
    main(sys.argv[1:])
