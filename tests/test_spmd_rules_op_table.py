"""op_table: every dotted path exists in paddle, and rules accept the paddle callables' parameters."""
import inspect

import pytest

import spmd_rules
from spmd_rules.op_table import ARG_MAP, OP_TABLE, rule_for
from spmd_rules.validation import resolve

paddle = pytest.importorskip("paddle")

IGNORED = {"name", "out", "device", "requires_grad", "pin_memory"}


def test_every_rule_has_a_table_entry_and_back():
    assert set(OP_TABLE) == set(spmd_rules.registered_ops())
    assert set(ARG_MAP) <= {p for paths in OP_TABLE.values() for p in paths}


@pytest.mark.parametrize("dotted", sorted({p for paths in OP_TABLE.values() for p in paths}))
def test_dotted_path_exists(dotted):
    assert callable(resolve(dotted)), dotted


def test_softmax_method_default_axis_is_last():
    x = paddle.randn([3, 4])
    assert paddle.allclose(x.softmax(), paddle.nn.functional.softmax(x, axis=-1)).item()


def test_paths_are_unique():
    seen = {}
    for name, paths in OP_TABLE.items():
        for p in paths:
            assert p not in seen, f"{p} listed for both {seen[p]} and {name}"
            seen[p] = name
    assert rule_for("paddle.Tensor.__radd__") == "add" and rule_for("paddle.nope") is None


def _signature(dotted):
    try:
        return inspect.signature(resolve(dotted))
    except (TypeError, ValueError):
        return None


_PAIRS = sorted((op, p) for op, paths in OP_TABLE.items() for p in paths if ARG_MAP.get(p) != "swap")


def test_only_operators_and_internal_ops_lack_a_python_signature():
    # those are called positionally, so there is no parameter list to compare with the rule
    unsigned = [p for _, p in _PAIRS if _signature(p) is None]
    assert all(p.rsplit(".", 1)[-1].startswith("__") or "._C_ops." in p for p in unsigned), unsigned


@pytest.mark.parametrize("op,dotted", [(op, p) for op, p in _PAIRS if _signature(p) is not None])
def test_rule_accepts_the_paddle_parameters(op, dotted):
    sig = _signature(dotted)
    rename = ARG_MAP.get(dotted, {}).get("rename", {}) if isinstance(ARG_MAP.get(dotted), dict) else {}
    rule_params = inspect.signature(spmd_rules.get_spmd_rule(op).fn).parameters
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if {p.kind for p in rule_params.values()} == set(kinds):     # binds paddle's overloads itself (gather)
        return
    missing = [rename.get(p.name, p.name) for p in sig.parameters.values()
               if p.name not in IGNORED and p.kind not in kinds and rename.get(p.name, p.name) not in rule_params]
    assert not missing, f"rule {op!r} lacks parameters {missing} of {dotted}{sig}"
