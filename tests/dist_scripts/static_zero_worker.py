"""Every rank: the training example eager vs --static, for GPT and LLaMA, under ZeRO-2 and ZeRO-3 (DP4) and
DP2xTP2 without and with recompute (full, selective). Per run: the losses, the final parameters (gathered,
rank 0), the bytes autograd saves for backward in one forward, and for ZeRO-3 which parameters hold data at the
end of every layer's forward; for --static, the number of recomputed ops in the plan."""

import numpy as np
import paddle.distributed as dist


import train_common  # noqa: E402
from autoparallel.dist_tensor import is_dist  # noqa: E402
from autoparallel.graph import trace  # noqa: E402
from autoparallel.parallel.recompute import SavedBytes  # noqa: E402
from autoparallel.testing.launch import write_result  # noqa: E402

CONFIGS = {                      # name -> (flags, steps)
    "zero2": (["--dp", "4", "--sharding-stage", "2"], 3),
    "zero3": (["--dp", "4", "--sharding-stage", "3"], 3),
    "dp2tp2": (["--dp", "2", "--tp", "2"], 3),
    "recompute_full": (["--dp", "2", "--tp", "2", "--recompute", "full"], 3),
    "recompute_selective": (["--dp", "2", "--tp", "2", "--recompute", "selective"], 3),
}


def _holds(p) -> bool:
    return all(t._is_initialized() for t in p.locals.values()) if is_dist(p) else p._is_initialized()


class UseProbe:
    """Forward post-hooks on every layer, registered before ZeRO's (so they run before its release): the
    parameters holding data when a layer's forward ends must be exactly the layer's own."""

    def __init__(self):
        self.model, self.checked, self.violations = None, 0, []

    def attach(self, model):
        self.model = model
        for name, layer in model.named_sublayers(include_self=True):
            layer.register_forward_post_hook(self._hook(name or "<model>"))
        return model

    def _hook(self, name):
        def post(layer, _inputs, _outputs):
            if trace.active() is not None:          # the capture of --static: spec-only, nothing to check
                return
            own = {id(p) for p in layer.parameters(include_sublayers=False)}
            whole = {id(p) for p in self.model.parameters() if _holds(p)}
            self.checked += 1
            if whole != own:
                self.violations.append(f"{name}: {len(whole)} whole, {len(own)} own")
        return post


def run(model, config, static):
    flags, steps = CONFIGS[config]
    argv = flags + ["--steps", str(steps), "--seed", "0", "--model", model] + (["--static"] if static else [])
    args = train_common.make_parser(model).parse_args(argv)
    probe = UseProbe() if config == "zero3" else None
    build = train_common.build
    if probe is not None:
        train_common.build = lambda cfg: probe.attach(build(cfg))
    try:
        if static:                  # the example logs the bytes of one forward in eager mode only
            with SavedBytes() as saved:
                log, net, opt = train_common.train(args)
            saved_bytes = saved.bytes // steps
        else:
            log, net, opt = train_common.train(args)
            saved_bytes = log["memory_per_rank"][dist.get_rank()]["saved_activations"]
    finally:
        train_common.build = build
    out = {"loss": [s["loss"] for s in log["steps"]], "saved_bytes": saved_bytes}
    zopt = net.optimizer if static else opt
    if probe is not None:
        out["probe"] = {"checked": probe.checked, "violations": probe.violations[:5],
                        "freed_after_step": all(zopt.is_freed(p) for p in zopt.params)}
        zopt.gather(zopt.params)
    if static:
        out["recomputed_ops"], out["ops"] = len(net.plan.recomputed()), net.plan.graph.number_of_nodes()
    network = getattr(net, "network", net)
    params = {n: (p.full() if is_dist(p) else p).numpy() for n, p in network.named_parameters()}
    if dist.get_rank() == 0:
        out["params"] = {n: np.asarray(v, dtype=np.float64).ravel().tolist() for n, v in params.items()}
    return out


def main():
    dist.init_parallel_env()
    out = {}
    for model in ("gpt-tiny", "llama-tiny"):
        for config in CONFIGS:
            out[f"{model}/{config}"] = {"eager": run(model, config, False), "static": run(model, config, True)}
    write_result(out)


if __name__ == "__main__":
    main()
