"""What ``auto_mode="full"`` chooses for the vision-language families (tiny configs of
autoparallel.testing.paddleformers_models) and how much of each model the default plans split.

    PYTHONPATH=$PWD python tools/plan_stacks.py [--world 4] [--seq 12]

Per family: parameters split by the default plan at tp=2 (vision tower / rest, names and structure), and the
priced choice for global batch 4 and 2 on the built-in CPU profile and on one node of A100-80GB.
"""
import argparse
import math

from tqdm import tqdm


def split_counts(model, plan):
    vis = [0, 0]
    rest = [0, 0]
    layers = dict(model.named_sublayers())
    for name, layer in layers.items():
        own = sum(math.prod(p.shape) for p in layer._parameters.values() if p is not None)
        box = vis if "visual" in name else rest
        box[1] += own
        if name in plan:
            box[0] += own
    return vis, rest


def main():
    import autoparallel as ap
    from autoparallel.parallel.tp_plans import default_plan
    from autoparallel.planner.auto import choose
    from autoparallel.testing import paddleformers_models as pf

    ap_args = argparse.ArgumentParser()
    ap_args.add_argument("--world", type=int, default=4)
    ap_args.add_argument("--seq", type=int, default=12)
    args = ap_args.parse_args()
    pf.install_vl_stubs()
    rows = []
    for name in tqdm(list(pf.VL_MODELS), desc="families"):
        model = pf.vl_build(name)
        vis, rest = split_counts(model, default_plan(model, 2))
        picks = []
        for cluster, backend in ((None, "gloo"), (f"1x{args.world}:A100-80GB", "nccl")):
            for batch in (4, 2):
                s = ap.Strategy()
                s.auto_mode, s.global_batch_size = "full", batch
                chosen, _ = choose(model, s, args.world, args.seq, cluster, backend)
                picks.append(f"{chosen.data_parallel.degree}x{chosen.tensor_parallel.degree}")
        rows.append(f"| {name} | {vis[0]:,} / {vis[1]:,} | {rest[0]:,} / {rest[1]:,} | " + " | ".join(picks) + " |")
    print("| family | vision elements split (tp=2) | rest split | cpu b4 | cpu b2 | A100 b4 | A100 b2 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
