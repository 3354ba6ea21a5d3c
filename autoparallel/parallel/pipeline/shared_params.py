"""Parameters that stages on several pipeline ranks hold (a tied embedding and LM head): one pure function,
used by the wiring (tie groups) and by gradient clipping (count each once)."""


def shared_parameters(stages, pp: int) -> list:
    """[(pipeline ranks, {stage: parameter name})] for parameters held by stages on several ranks."""
    holders = {}
    for st in stages:
        for name, p in st.named_parameters():
            entry = holders.setdefault(id(p), (set(), {}))
            entry[0].add(st.index % pp)
            entry[1].setdefault(st.index, name)
    return [(tuple(sorted(rs)), names) for rs, names in holders.values() if len(rs) > 1]
