"""Parameters that stages on several pipeline ranks hold (a tied embedding and LM head): which they are, used by
the wiring (tie groups) and by gradient clipping (count each once); and the all-reduce of their gradients after a
step (``reduced_after_step``, ``sum_tied``)."""
import contextlib


def shared_parameters(stages, pp: int) -> list:
    """[(pipeline ranks, {stage: parameter name})] for parameters held by stages on several ranks."""
    holders = {}
    for st in stages:
        for name, p in st.named_parameters():
            entry = holders.setdefault(id(p), (set(), {}))
            entry[0].add(st.index % pp)
            entry[1].setdefault(st.index, name)
    return [(tuple(sorted(rs)), names) for rs, names in holders.values() if len(rs) > 1]


@contextlib.contextmanager
def reduced_after_step(pipe):
    """Around one ``train_batch`` step: the tied parameters' gradients held so far are set aside, the step's own
    are summed between the ranks sharing them (``pipe._reduce_tied()``) when the step ends, then the set-aside
    ones are added back. Reducing the accumulated gradient instead summed every earlier batch's share again at
    each ``train_batch`` of an accumulation window (two batches per optimizer step counted the first one twice)."""
    import paddle

    get, put = paddle.Tensor.grad.__get__, paddle.Tensor.grad.__set__
    saved = []
    with paddle.no_grad():
        for p, _ in pipe.tied:
            g = get(p)
            saved.append(g.clone() if g is not None else None)
            put(p, None)
    try:
        yield
        pipe._reduce_tied()
    finally:
        with paddle.no_grad():
            for (p, _), old in zip(pipe.tied, saved):
                g = get(p)
                if old is not None:
                    put(p, old if g is None else g + old)


def sum_tied(tied) -> None:
    """Sum each tied parameter's gradient between the pipeline ranks sharing it (``tied``: [(parameter, group of
    the ranks of one data / model coordinate)]). With data parallelism inside the stages the two copies can hold
    their gradient in different states: partial sums over the stage's data ranks, reduced at the optimizer step
    (the parameter's ``_ap_partial_dims``: an embedding lookup on a data-split batch), or already complete there
    (a use whose contribution dispatch reduced in backward: a tied LM head). Each rank first completes its own over
    its partial dims, the sum between the ranks is then the whole gradient on every coordinate, and the partial
    dims get it back as partial sums (kept at their coordinate 0, zero elsewhere) for the step's reduction."""
    import paddle
    import paddle.distributed as dist

    from autoparallel.comm import collectives as C
    from autoparallel.comm.world import current_world

    rank = current_world().rank
    for p, group in tied:
        if p.grad is None:
            p.grad = paddle.zeros(p.shape, dtype=p.dtype)
        g = p.grad
        dims = sorted(getattr(p, "_ap_partial_dims", None) or ())
        with paddle.no_grad():
            for m in dims:
                g.set_value(C.mesh_groups_apply({rank: g}, p.mesh, m, lambda v, ranks: C.all_reduce(v, ranks))[rank])
            dist.all_reduce(g, group=group)
            if any(p.mesh.coords_of(rank)[m] for m in dims):
                g.set_value(paddle.zeros_like(g))
