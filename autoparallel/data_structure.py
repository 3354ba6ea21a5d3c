"""The structure of a batch, agreed across ranks before any of its collectives (``data_agree.check_more``).

``shard_dataloader`` walks a batch field by field, and each tensor costs collectives (the agreement check, then the
layout). Ranks whose batches differ in structure -- a dict key missing on one rank, another number of fields, a list
of another length, a tensor on one rank and None or a number on another, another ndim or dtype -- would part ways
in that walk: some raise (KeyError) or skip a tensor while the others wait in its collective. So each rank first
describes its batch as a short vector of numbers (``codes``: the batch's kind, field count, a CRC of the field names,
a CRC of the whole structure, then kind, ndim or length, dtype and a CRC of the nesting for each of the first
``FIELDS`` fields), which ``check_more`` all-reduces (max and -min) in the vector it already reduces per batch; a
difference raises on every rank, naming the field and what differs (``explain``). Subtrees holding no tensor, and
fields kept plain by ``dense_tensor_idx``, pass through untouched: they count as one plain value, whatever they are.
CRCs are 24-bit, exact in float32.
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping

FIELDS = 8                      # fields described one by one (the rest through the CRC of the whole structure)
HEAD = 4                        # batch kind, field count, CRC of the names, CRC of the whole structure
WIDTH = 4                       # per field: kind, ndim (tensor) or length (list, dict), dtype, CRC of the nesting
SIZE = HEAD + FIELDS * WIDTH
BATCH_KINDS = ("nothing", "a tensor", "a dict", "a list/tuple", "something else")
KINDS = ("nothing", "a tensor", "a DistTensor", "a list", "a dict", "a plain value (no tensor)", "missing")
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "complex64", "complex128")
_MISSING = object()


def _crc(text: str) -> float:
    return float(zlib.crc32(text.encode()) & 0xFFFFFF)


def _leaf(x):
    """(kind, ndim, dtype name) of a tensor leaf as ``_place`` lays it out, else None."""
    import numpy as np
    import paddle

    from autoparallel.dist_tensor import DistTensor

    if isinstance(x, DistTensor):
        return 2, x.ndim, str(x.dtype).replace("paddle.", "")
    if isinstance(x, paddle.Tensor):
        return 1, x.ndim, str(x.dtype).replace("paddle.", "")
    if isinstance(x, np.ndarray) and x.ndim and x.dtype.kind in "biufc":
        return 1, x.ndim, x.dtype.name
    return None


def _text(x) -> str:
    """Canonical text of a subtree's structure; "P" for one that holds no tensor."""
    leaf = _leaf(x)
    if leaf is not None:
        return f"{'TD'[leaf[0] - 1]}{leaf[2]}/{leaf[1]}"
    if isinstance(x, Mapping):
        inner = [f"{k!r}:{_text(v)}" for k, v in x.items()]
        return "P" if all(s.endswith(":P") for s in inner) else "{" + ",".join(inner) + "}"
    if isinstance(x, (list, tuple)):
        inner = [_text(v) for v in x]
        return "P" if all(s == "P" for s in inner) else "[" + ",".join(inner) + "]"
    return "P"


def _field(x, listed: bool, dense: list):
    """(codes, text) of one field; ``listed``: its mesh entry is a list of meshes (its length matters)."""
    if x is _MISSING:
        return [6.0, 0.0, 0.0, 0.0], "missing"
    if dense and not isinstance(x, (list, tuple)):
        return [5.0, 0.0, 0.0, 0.0], "P"            # kept a plain tensor: no collective
    if isinstance(x, (list, tuple)) and dense:
        x = ["P" if j in dense else v for j, v in enumerate(x)]
    text = _text(x)
    leaf = _leaf(x)
    if leaf is not None:
        dt = DTYPES.index(leaf[2]) + 1 if leaf[2] in DTYPES else len(DTYPES) + 1
        return [float(leaf[0]), float(leaf[1]), float(dt), _crc(text)], text
    if isinstance(x, (list, tuple)) and (listed or text != "P"):
        return [3.0, float(len(x)), 0.0, _crc(text + "#" * listed)], text if text != "P" else f"[{len(x)} plain]"
    if isinstance(x, Mapping) and text != "P":
        return [4.0, float(len(x)), 0.0, _crc(text)], text
    return [5.0, 0.0, 0.0, 0.0], "P"


def describe(batch, keys, listed, dense_of) -> dict:
    """This rank's structure of ``batch``: ``codes`` (``SIZE`` numbers), ``names`` and ``texts`` of its fields.
    ``keys``: the ``input_keys`` (None: every key); ``listed(i)``: field ``i``'s mesh entry is a list of meshes;
    ``dense_of(i)``: its ``dense_tensor_idx`` positions."""
    if _leaf(batch) is not None:
        top, names, fields = 1, ["the batch"], [batch]
    elif isinstance(batch, Mapping):
        names = list(batch) if keys is None else list(keys)
        top, fields = 2, [batch[k] if k in batch else _MISSING for k in names]
    elif isinstance(batch, (list, tuple)):
        top, names, fields = 3, [str(i) for i in range(len(batch))], list(batch)
    else:
        top, names, fields = 4, [], []
    per = [_field(x, listed(i), dense_of(i)) for i, x in enumerate(fields)]
    texts = [t for _, t in per]
    whole = _crc(f"{top}|{names!r}|{texts!r}")
    codes = [float(top), float(len(fields)), _crc(repr(names)), whole]
    for i in range(FIELDS):
        codes += per[i][0] if i < len(per) else [0.0] * WIDTH
    return {"codes": codes, "names": names, "texts": texts, "top": top}


def explain(mine: dict, hi, lo, rank: int) -> str:
    """What differs, from the all-reduced max ``hi`` and min ``lo`` of every rank's ``codes``, and this rank's own
    structure ``mine``."""
    top = int(mine["top"])
    if hi[0] != lo[0]:
        return (f"the loader yields {BATCH_KINDS[int(lo[0])]} on some ranks and {BATCH_KINDS[int(hi[0])]} on others "
                f"(this rank {rank}: {BATCH_KINDS[top]})")
    if hi[1] != lo[1]:
        return (f"the batch has {int(lo[1])} fields on some ranks and {int(hi[1])} on others (this rank {rank}: "
                f"{mine['names']})")
    if hi[2] != lo[2]:
        return f"the dict batch's keys differ (this rank {rank}: {mine['names']})"
    for i in range(min(FIELDS, len(mine["names"]))):
        a, b = lo[HEAD + i * WIDTH:HEAD + (i + 1) * WIDTH], hi[HEAD + i * WIDTH:HEAD + (i + 1) * WIDTH]
        if list(a) == list(b):
            continue
        field, own = mine["names"][i], mine["texts"][i]
        what = "nests its tensors differently (kinds, ndims, dtypes or list lengths)"
        if a[0] != b[0]:
            what = f"is {KINDS[int(a[0])]} on some ranks and {KINDS[int(b[0])]} on others"
        elif a[1] != b[1]:
            what = (f"has ndim {int(a[1])} on some ranks and {int(b[1])} on others" if a[0] in (1, 2) else
                    f"has {int(a[1])} entries on some ranks and {int(b[1])} on others")
        elif a[2] != b[2]:
            what = f"has dtype {_dtype(a[2])} on some ranks and {_dtype(b[2])} on others"
        return f"batch field {field if top != 2 else repr(field)} {what} (this rank {rank}: {_human(own)})"
    return f"a field after the first {FIELDS} differs in kind, ndim or dtype (this rank {rank}: {mine['texts']})"


def _human(text: str) -> str:
    """This rank's own field text in words when it is one leaf ("Tint64/2": an int64 tensor of ndim 2)."""
    if text in ("P", "missing"):
        return {"P": "a plain value (no tensor)", "missing": "missing"}[text]
    if text[:1] in "TD" and "/" in text and text[-1].isdigit() and "[" not in text and "{" not in text:
        dtype, ndim = text[1:].split("/")
        return f"a {dtype} {'tensor' if text[0] == 'T' else 'DistTensor'} of ndim {ndim}"
    return text


def _dtype(code) -> str:
    return DTYPES[int(code) - 1] if 1 <= int(code) <= len(DTYPES) else "another"
