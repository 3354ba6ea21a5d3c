"""Check every spmd rule against a full-tensor ground truth, forward and input gradients.

    python -m spmd_rules.validation --all                 # every rule, default sampling
    python -m spmd_rules.validation --op matmul --exhaustive
    python -m spmd_rules.validation --list

For each op and each sample call (``add_case`` below; ``CASES``), every placement combination of the tensor inputs
(R, S(d) for every dim, P(sum) for float tensors) is tried on 1-d meshes of 2 and 3 ranks, and on a 2x2
mesh (a deterministic sample; with --exhaustive every combination, up to --max-combos per sample call,
beyond which a deterministic sample of that size is taken and reported). The rule gives the required input
specs; each rank's local inputs are built from the full tensors per those specs (S: the rank's slice,
R: whole, P(sum): random terms summing to the full tensor, P(max/min): terms whose max/min is it), the
paddle op (or the reference of a purely local ``local_op``) runs per rank with ``local_attrs(coords)``,
and the outputs are assembled per the output specs (S: slices, R: all ranks equal, P: reduced) and
compared with the op on the full tensors; local output shapes must equal ``spec.local_shape``.

Backward: a random full output gradient is seeded into each rank's local output (S: its slice, R and
P(sum): whole, P(max/min): where the rank holds the reduced value) and each rank's local input gradients
are checked by the convention: required S -> the slice of the full gradient; required P -> the full
gradient; required R on a mesh dim where the op is split -> the sum over that dim's group is the full
gradient; otherwise the full gradient. Results with a ``local_op`` that needs collectives or shared
randomness are counted as "needs runtime" (not passed; only their output shapes and dtypes are checked).
Ops of the op table without a rule and wrong rules are reported; the exit status is non-zero on any
failure. Other code may call ``main(argv)`` in-process and add cases with ``add_case`` (tests do).

Modules: ``case`` (sample calls and their registry), ``samples`` (the built-in rules' sample calls),
``local_arrays`` (per-rank inputs, assembled outputs), ``checker`` (one call on one layout),
``reference_ops`` (purely local ``local_op``s), ``driver`` (the loop over ops and the command line).
"""
from .case import CASES, IMPLS, Case, T, add_case, f, ints, resolve
from .checker import Checker, Outcome
from .driver import MAX_EXHAUSTIVE, MESH_2D, MESHES_1D, SAMPLES_2D, check_op, expected_ops, main, run
from .local_arrays import assemble, local_input
from .samples import _build_cases

__all__ = ["CASES", "IMPLS", "Case", "T", "add_case", "f", "ints", "resolve", "Checker", "Outcome", "MAX_EXHAUSTIVE",
           "MESH_2D", "MESHES_1D", "SAMPLES_2D", "check_op", "expected_ops", "main", "run", "assemble", "local_input",
           "_build_cases"]
