"""Train a byte-level GPT on the Python standard library's sources.

    python examples/train_gpt.py --steps 20                                   # one process: the reference
    python -m paddle.distributed.launch --nproc_per_node 4 examples/train_gpt.py --dp 2 --tp 2 \
        --steps 20 --seed 0 --log-json out.json                               # DP2 x TP2 on 4 ranks
"""
from train_common import main

if __name__ == "__main__":
    main("gpt-tiny")
