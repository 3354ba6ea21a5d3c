"""spmd_rules (documentation written below once the families are in)."""
from spmd_rules.registry import (NoSpmdRuleError, SpmdRule, flatten_specs, get_spmd_rule, has_spmd_rule,
                                 register_spmd_rule, registered_ops, replace_specs, unregister_spmd_rule)
from spmd_rules.result import SpmdResult
from spmd_rules.expand import MeshDim, expand, expand_reverse
from spmd_rules.einsum import einsum_result, label_reverse, label_rule, labels_result, parse_equation
from spmd_rules import (matmul, elementwise, reduction, softmax, norm, conv, embedding, loss, attention, shape,  # noqa
                        layout, join, indexing, creation, random, optimizer)
