"""Train a byte-level LLaMA-style decoder on the Python standard library's sources.

    python examples/train_llama.py --steps 20                                 # one process: the reference
    python -m paddle.distributed.launch --nproc_per_node 4 examples/train_llama.py --dp 2 --tp 2 --sp \
        --steps 20 --seed 0 --log-json out.json                               # DP2 x TP2 + SP on 4 ranks
"""
from train_common import main

if __name__ == "__main__":
    main("llama-tiny")
