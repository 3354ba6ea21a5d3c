"""spmd_rules: how each op lays out its inputs and outputs over a mesh. Pure: no paddle import.

Registry
--------
``register_spmd_rule("name")`` (or a list of names) registers a forward rule; usable as a decorator,
which returns the function unchanged. Registering a name that already has a rule REPLACES it (users
may override built-in rules). ``reverse=fn`` adds the reverse form used by graph completion.
``get_spmd_rule(name)`` returns the registered rule (a callable ``SpmdRule``) and raises
``NoSpmdRuleError`` (both a ``NotImplementedError`` and a ``KeyError``) naming ``register_spmd_rule``
when there is none; ``has_spmd_rule``, ``registered_ops``, ``unregister_spmd_rule``.

Block-sharded inputs (``S(d,blocks=(..))``, fused projections) reach only rules decorated
``@block_aware`` (blocks.py); every other rule sees such an input as R on that mesh dim, so it is
gathered before the op, whatever the rule assumes about contiguous shards.

Calling a rule
--------------
A rule mirrors the paddle functional signature (see ``op_table.py``) with a ``DistSpec`` in place of
every tensor argument and python values for the rest::

    get_spmd_rule("matmul")(x, y, transpose_x=False, transpose_y=False)
    get_spmd_rule("linear")(x, w, b)
    get_spmd_rule("concat")([a, b], axis=1)
    get_spmd_rule("reshape")(x, shape=[2, -1, 4])
    get_spmd_rule("arange")(0, 10, mesh=mesh, placements=[Shard(0)])     # creation: mesh= and placements=

It returns an ``SpmdResult`` (result.py):

* ``inputs``: the REQUIRED DistSpec of every DistSpec argument, in ``flatten_specs(args, kwargs)``
  order (positional args, then kwargs as passed; lists/tuples entered). The runtime reshards each
  input to it. (A rule body lists them in its own signature order; the registry reorders.)
* ``outputs``: complete output DistSpecs (global shape, dtype, placements), one per output of the
  paddle op in its order, ``None`` where the op returns None. Rules double as shape functions.
* ``local_op``: None -> run the paddle op itself on the local shards. Otherwise the name of a local
  implementation (table below), called with the same arguments plus ``local_attrs``.
* ``local_attrs``: None or a pure ``(coords) -> dict`` of keyword overrides for the local call on the
  rank at those mesh coordinates (uneven shards make them rank-dependent).
  ``get_spmd_rule(op).local_call(result, args, kwargs, coords)`` applies them by parameter name,
  replacing positionally passed arguments too.
* ``str(result)``: ``"(S(0), R) -> S(0)"`` on 1-d meshes, ``"([S(0), R], [R, S(1)]) -> [S(0), S(1)]"``
  on n-d meshes, ``"... via vocab_parallel_embedding"`` when there is a local op.

The registry validates what a rule returns: wrong arity or a non-DistSpec output is a ``TypeError``,
invalid placements or a changed shape/dtype/mesh a ``ValueError``, each naming the op. A required
input may also be given as a placements list (``["S(0)", "R"]``). Errors raised by rules name the op.
Results are cached per (hashable) call.

Writing rules: one mesh dim at a time
-------------------------------------
A user rule for a custom fused op usually composes the building blocks below::

    @register_spmd_rule("fused_swiglu")                 # swiglu(x, gate): elementwise, nonlinear
    def fused_swiglu(x, gate):
        return elementwise_result("fused_swiglu", [x, gate])


``expand(op, inputs, out_meta, rule_1d, nested=...)`` runs ``rule_1d(placements, MeshDim) ->
(required, outputs)`` on every mesh dim independently and builds the DistSpecs (expand.py). Nested
sharding (two mesh dims on one tensor dim): label-based rules keep it; other rules never see a tensor
dim sharded twice (the inner mesh dim is presented as R; if still needed it falls back to all-R).
Einsum notation (einsum.py: ``label_rule``, ``labels_result``, ``einsum_result``) builds
matmul, linear, bmm, einsum, elementwise, reductions, softmax, norms, attention, ...: per mesh dim the
LARGEST operand's sharded axis wins (ties: the first operand), a contracted sharded axis gives
``Partial(sum)``; of several linear Partials a multilinear op keeps the largest and requires R of the
others.

Partial semantics
-----------------
Linear Partials (sum, avg) pass through linear ops: add/subtract of equal Partials, multiply (one
operand), divide (numerator), neg, scale without bias, float casts, reshape/transpose/split/concat/
getitem/expand/tril, sum/mean, matmul-like ops (one operand), embedding's weight, attention's value.
``add(P, R)`` and every nonlinear op require R (the runtime all-reduces first). P(max)/P(min) never
pass through: they are produced by max/min reductions (the runtime's all_reduce(max/min) backward sends
the gradient to the rank holding the extreme value).

Backward convention (the runtime implements it; tools/check_rules.py verifies it)
-------------------------------------------------------------------------------
Each rank runs paddle autograd on its local computation. An input required S on a mesh dim gets the
slice of the full gradient; required P gets the full gradient; required R on a mesh dim where the op is
split (``result.split_mesh_dims()``: some required input or output placement there is not R) gets a
local gradient whose SUM over that dim's group is the full gradient (identity forward, all_reduce
backward); elsewhere the local gradient is the full gradient. An output gradient enters a rank as: S ->
its slice, R and P(sum) -> whole, P(max/min) -> where that rank holds the reduced value.

Local ops the runtime provides (same arguments as the paddle op, plus ``local_attrs``)
--------------------------------------------------------------------------------------
* ``vocab_parallel_embedding`` (local): masked lookup of rows [vocab_start, vocab_end); output P(sum).
* ``global_mean`` (local): ``sum(x, axis, keepdim) / global_count``; output P(sum).
* ``squeeze_to`` (local): ``reshape(x, shape)`` to the rank's output shape (squeeze of a sharded tensor).
* ``reshape_to`` (local): ``reshape(x, shape)`` to the rank's output shape (flatten of a sharded tensor).
* ``einsum_diagonals`` (local): an einsum repeating a label inside one operand, as ``paddle.diagonal`` of
  those (whole) dims, then the einsum of the rewritten equation (``einsum.diagonal_steps``).
* ``fill_diagonal`` (local): paddle's in-place ``fill_diagonal_`` on a copy of the whole tensor.
* ``as_strided`` (local): ``paddle.as_strided`` on a copy (the storage of a view would be read otherwise).
* ``fill_diagonal_tensor_shard`` (local): ``fill_diagonal_tensor`` / ``diagonal_scatter`` of a shard; an empty
  shard returned as it is (paddle's kernel segfaults on some empty inputs).
* ``unfold_windows``, ``vander`` (local): paddle's op on a shard; an empty shard gets zeros of its output shape
  joined to it (paddle's vander leaves an empty input's gradient undefined).
* ``multiplex_rows`` (local): ``paddle.multiplex`` of the rank's rows; no row: an empty block joined to the inputs.
* ``histogram_shard`` (local): one shard's histogram over an explicit range (a Partial(sum) term); an empty
  shard gives zero counts.
* ``vocab_parallel_cross_entropy`` (collectives): class axis sharded over ``class_mesh_dims`` (this rank
  holds [class_start, class_end)); all-reduce max logit, sum of exps and target logit; for 'mean' over a
  batch sharded on ``batch_mesh_dims`` divide by the all-reduced valid count.
* ``global_mean_cross_entropy`` (collective): local sum of losses / all-reduced (weighted) valid count
  over ``batch_mesh_dims``.
* ``sync_batch_norm`` (collectives): training batch_norm with statistics all-reduced over
  ``stat_mesh_dims``.
* ``sharded_masked_scatter`` (collective): x and its mask split over dim 0 on ``row_mesh_dim``, values R;
  each rank's offset into the values from an all-reduced vector of per-rank True counts.
* ``sharded_dropout``, ``sharded_attention_dropout``, ``sharded_random`` (shared RNG): draw for the
  ``global_shape`` from the mesh-synchronised generator, keep ``local_slices``.

See ``op_table.py`` for which paddle callables each rule covers.
"""
from spmd_rules.registry import (NoSpmdRuleError, SpmdRule, flatten_specs, get_spmd_rule, has_spmd_rule,
                                 register_spmd_rule, registered_ops, replace_specs, unregister_spmd_rule)
from spmd_rules.result import SpmdResult
from spmd_rules.expand import MeshDim, expand, expand_reverse
from spmd_rules.einsum import einsum_result, label_reverse, label_rule, labels_result, parse_equation
from spmd_rules.elementwise import elementwise_result
from spmd_rules import (matmul, elementwise, reduction, softmax, norm, conv, embedding, loss, attention,  # noqa: F401
                        shape, layout, join, indexing, creation, random, optimizer, routing, more_ops,
                        padding)
from spmd_rules import elementwise_more, math_more, nn_more, pooling, conv_transpose, image_ops  # noqa: F401,E402
from spmd_rules import multimodal, search, fused  # noqa: F401,E402
from spmd_rules import diag_ops, value_ops, linalg_ops, complex_ops, fft_ops  # noqa: F401,E402

__all__ = ["register_spmd_rule", "get_spmd_rule", "has_spmd_rule", "registered_ops", "unregister_spmd_rule",
           "SpmdResult", "SpmdRule", "NoSpmdRuleError", "flatten_specs", "replace_specs", "MeshDim", "expand",
           "expand_reverse", "label_rule", "label_reverse", "labels_result", "einsum_result", "parse_equation",
           "elementwise_result"]
