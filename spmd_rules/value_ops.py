"""Ops reading values to count or test them (``isin``, ``histogram``, ``histogram_bin_edges``,
``unique_consecutive``), ``reduce_as`` (a sum down to another tensor's shape), ``shard_index`` (elementwise on
ids) and ``multiplex`` (row i from input ``index[i]``: the rows split alike everywhere).

* ``isin(x, test_x)``: elementwise in ``x`` (any sharding kept), ``test_x`` whole (every element of x is tested
  against all of it). Not linear.
* ``histogram(input, bins, min, max, weight, density)``: with an explicit range (``min < max``) and no
  ``density``, the counts of the shards add up to the counts of the whole tensor, so ``input`` (and ``weight``,
  split alike) keep their sharding and the output is Partial(sum) over the split dims; linear in ``weight``
  (a Partial weight is kept). paddle's default range ``min == max == 0`` is the data's own min / max, and
  ``density`` divides by the global total: both need the whole tensor.
* ``histogram_bin_edges``: the edges, from the range or the whole data: input whole, output replicated.
* ``unique_consecutive``: a value-dependent output size: input whole, outputs replicated (routing.replicate_all).
* ``reduce_as(x, target)``: x's dims right-aligned with target's; a dim target keeps (same size) is split alike in
  x, target and the output; a dim summed away (a leading dim of x, or size 1 in target) is contracted: split in
  x, it makes the output Partial(sum). Linear in x.
"""
from __future__ import annotations

from autoparallel.core.spec import DistSpec

from spmd_rules.einsum import labels_result
from spmd_rules.registry import register_spmd_rule
from spmd_rules.routing import replicate_all
from spmd_rules.utils import check_spec


@register_spmd_rule("isin")
def isin(x, test_x, assume_unique=False, invert=False, name=None):
    check_spec("isin", "x", x)
    check_spec("isin", "test_x", test_x)
    lab = tuple(range(x.ndim))
    return labels_result("isin", [x, test_x], [lab, (None,) * test_x.ndim], [lab], [(x.shape, "bool")],
                         linear=None)


def _range_given(op: str, min, max) -> bool:
    for name, v in (("min", min), ("max", max)):
        if isinstance(v, DistSpec) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{op}: {name} must be a python number, got {type(v).__name__} {v!r}")
    if min > max:
        raise ValueError(f"{op}: max must be >= min, got min={min}, max={max}")
    return min < max


def _bins(op: str, bins) -> int:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"{op}: bins must be a positive python int, got {bins!r}")
    return bins


@register_spmd_rule("histogram")
def histogram(input, bins=100, min=0.0, max=0.0, weight=None, density=False, name=None):
    op = "histogram"
    check_spec(op, "input", input)
    check_spec(op, "weight", weight, optional=True)
    bins = _bins(op, bins)
    if weight is not None and tuple(weight.shape) != tuple(input.shape):
        raise ValueError(f"{op}: weight must have input's shape {list(input.shape)}, got {list(weight.shape)}")
    dtype = "float32" if weight is not None or density else "int64"        # paddle 3.3's kernel: float32 always
    split = _range_given(op, min, max) and not density       # shard counts add up to the whole tensor's
    lab = tuple(range(input.ndim)) if split else (None,) * input.ndim
    specs, labels = [input], [lab]
    if weight is not None:
        specs.append(weight)
        labels.append(lab)
    return labels_result(op, specs, labels, [(None,)], [((bins,), dtype)], linear={1} if split else None,
                         local_op="histogram_shard" if split else None)


@register_spmd_rule("histogram_bin_edges")
def histogram_bin_edges(input, bins=100, min=0.0, max=0.0, name=None):
    op = "histogram_bin_edges"
    check_spec(op, "input", input)
    bins = _bins(op, bins)
    _range_given(op, min, max)
    return labels_result(op, [input], [(None,) * input.ndim], [(None,)], [((bins + 1,), "float32")], linear=None)


@register_spmd_rule("unique_consecutive")
def unique_consecutive(x, return_inverse=False, return_counts=False, axis=None, dtype="int64", name=None):
    check_spec("unique_consecutive", "x", x)
    return replicate_all("unique_consecutive", [x], 1 + bool(return_inverse) + bool(return_counts))


@register_spmd_rule("reduce_as")
def reduce_as(x, target, name=None):
    op = "reduce_as"
    check_spec(op, "x", x)
    check_spec(op, "target", target)
    lead = x.ndim - target.ndim
    if lead < 0 or any(t not in (1, x.shape[lead + j]) for j, t in enumerate(target.shape)):
        raise ValueError(f"{op}: target's shape {list(target.shape)} must be x's shape {list(x.shape)} with leading "
                         f"dims removed and some dims set to 1")
    xl = tuple(d for d in range(x.ndim))
    kept = tuple(lead + j if t == x.shape[lead + j] else None for j, t in enumerate(target.shape))
    return labels_result(op, [x, target], [xl, kept], [kept], [(target.shape, x.dtype)], linear={0})


@register_spmd_rule("shard_index")
def shard_index(input, index_num, nshards, shard_id, ignore_value=-1):
    """Elementwise on integer ids (each id mapped to this shard's range or ``ignore_value``): the sharding kept but
    on the last dim, which paddle's kernel requires of size 1 (whole: an empty shard of it is refused)."""
    check_spec("shard_index", "input", input)
    if not 0 <= shard_id < nshards:
        raise ValueError(f"shard_index: shard_id must be in [0, {nshards}), got {shard_id}")
    if input.ndim < 1 or input.shape[-1] != 1:
        raise ValueError(f"shard_index: input's last dim must be 1, got shape {list(input.shape)}")
    lab = tuple(range(input.ndim - 1)) + (None,)
    return labels_result("shard_index", [input], [lab], [lab], [(input.shape, input.dtype)], linear=None)


@register_spmd_rule("multiplex")
def multiplex(inputs, index, name=None):
    """Row i of the output is row i of ``inputs[index[i]]``: the rows split alike in every input, ``index`` and the
    output; the other dims keep their sharding in the inputs and the output."""
    if isinstance(inputs, DistSpec) or not isinstance(inputs, (list, tuple)) or len(inputs) < 2:
        raise TypeError(f"multiplex: inputs must be a list of at least 2 DistSpecs, got {inputs!r}")
    for i, s in enumerate(inputs):
        check_spec("multiplex", f"inputs[{i}]", s)
        if tuple(s.shape) != tuple(inputs[0].shape):
            raise ValueError(f"multiplex: every input must have shape {list(inputs[0].shape)}, input {i} has "
                             f"{list(s.shape)}")
    check_spec("multiplex", "index", index)
    lab = tuple(range(inputs[0].ndim))
    il = (0,) + (None,) * (index.ndim - 1)
    return labels_result("multiplex", list(inputs) + [index], [lab] * len(inputs) + [il], [lab],
                         [(inputs[0].shape, inputs[0].dtype)], linear=None, local_op="multiplex_rows")
