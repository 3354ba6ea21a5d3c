"""``rule_removed(op)``: the op has no SPMD rule inside the block (the tests of the missing-rule error need an op
that paddle has and the registry lacks; every op a test could pick may get a rule later, so the test removes one)."""
import contextlib


@contextlib.contextmanager
def rule_removed(op: str):
    from spmd_rules import registry

    saved = registry._RULES.pop(op)
    try:
        yield
    finally:
        registry._RULES[op] = saved
