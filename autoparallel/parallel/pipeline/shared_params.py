"""Parameters that stages on several pipeline ranks hold (a tied embedding and LM head): which they are, used by
the wiring (tie groups) and by gradient clipping (count each once); and the all-reduce of their gradients after a
step (``reduced_after_step``)."""
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
