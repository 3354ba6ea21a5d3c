"""Runs on every rank (2 or 4) of a gloo job: the programs of loops6_programs.py (EMA by hand, distillation, a
GAN, a CLIP-style loss over the global batch, siamese towers, two heads, freezing between steps, train/eval
toggles with BatchNorm, a head added after parallelize, EMA weights swapped in and out of a ZeRO model,
self-distillation) under DP / TP / ZeRO, each reporting its losses and
every parameter (global values) for comparison with one process by tests/test_probe_loops6.py; the forms that
are refused report the error's type and text."""
import paddle.distributed as dist

from autoparallel.testing.launch import write_result
from loops6_programs import CASES, REFUSED, run_case


def main():
    dist.init_parallel_env()
    write_result({name: run_case(name) for name in [*CASES, *REFUSED]})


if __name__ == "__main__":
    main()
