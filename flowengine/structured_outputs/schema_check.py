"""Refuse JSON schemas that no JSON value can match (an empty language).

A grammar backend given such a schema does not always refuse it: xgrammar 0.2.9 makes
`{"type": "string", "const": 5}` the grammar `5`, `{"anyOf": []}` the empty string,
`{"type": []}` any value, and an object whose `required` property is forbidden by
`additionalProperties: false` the text `{}`, so the request would answer 200 with
output the schema forbids. vLLM refuses a schema only where its backend's converter
raises (xgrammar's "minimum greater than maximum", llguidance's "Unsatisfiable
schema"); this check covers the obvious contradictions the converters pass, and states
the reason the same way whichever backend compiles the schema.
"""

from __future__ import annotations

import json
import math
from typing import Any

# JSON types a subschema allows; "number" here means a number that is not an integer
# ("type": "number" allows both "integer" and "number").
_ALL_TYPES = frozenset({"null", "boolean", "integer", "number", "string", "array", "object"})
# Keys whose values are subschemas (dict) or lists of subschemas, walked for the check.
# `not` and `if` are left out: an impossible schema there is meaningful.
_SUBSCHEMA_KEYS = frozenset({"items", "additionalProperties", "contains", "propertyNames",
                             "then", "else", "unevaluatedItems", "unevaluatedProperties",
                             "prefixItems", "anyOf", "oneOf", "allOf"})
_NAMED_SUBSCHEMA_KEYS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                                   "dependentSchemas"})


def unsatisfiable_json_schema(schema: Any) -> str | None:
    """Why no JSON value matches `schema` (a parsed JSON schema), or None.

    Every subschema is checked (the root, and those under properties,
    patternProperties, additionalProperties, items, prefixItems, contains, anyOf,
    oneOf, allOf, $defs, definitions, then/else), not those under `not` or `if`. A
    subschema is refused wherever it appears, even where the whole could still be met
    by avoiding it (an optional property, one branch of anyOf), as xgrammar refuses an
    empty numeric range anywhere: such a subschema is a mistake in the schema.

    A subschema is unsatisfiable when every JSON type it allows (its `type`, or all
    seven) is ruled out by these cases, and only these:

    - `type` is an empty list; `enum`, `anyOf` or `oneOf` is an empty list;
    - `const` is not of an allowed type; no `enum` value is of an allowed type; `const`
      is not among the `enum` values;
    - `allOf` members whose `type` keywords share no type (with each other and with
      the subschema's own `type`; only the members' `type` keywords are compared);
    - numbers: `minimum`/`exclusiveMinimum` above `maximum`/`exclusiveMaximum` (or
      equal with either exclusive; draft 4's boolean exclusive bounds too); integers
      also when no integer lies in between (minimum 1.5, maximum 1.7);
    - strings: `minLength` > `maxLength`; arrays: `minItems` > `maxItems`;
    - objects: `minProperties` > `maxProperties`; more `required` names than
      `maxProperties`; a `required` name not in `properties` while
      `additionalProperties` is false and there are no `patternProperties`.

    Returns a message such as "at /properties/age: minimum 5 is greater than maximum
    1" (the JSON pointer is left out at the root). Values of the wrong kind (a
    string `minimum`) are left to the backend's own check.
    """
    return _walk(schema, "")


def _walk(node: Any, path: str) -> str | None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            if (reason := _walk(item, f"{path}/{i}")) is not None:
                return reason
        return None
    if not isinstance(node, dict):
        return None
    reasons = _node_reasons(node)
    if reasons is not None:
        where = f"at {path}: " if path else ""
        return where + "; ".join(reasons)
    for key, value in node.items():
        if key in _NAMED_SUBSCHEMA_KEYS and isinstance(value, dict):
            for name, sub in value.items():
                if (reason := _walk(sub, f"{path}/{key}/{_pointer(name)}")) is not None:
                    return reason
        elif key in _SUBSCHEMA_KEYS:
            if (reason := _walk(value, f"{path}/{key}")) is not None:
                return reason
    return None


def _pointer(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")  # RFC 6901 escapes


def _types_of_keyword(value: Any) -> set[str] | None:
    """The types a `type` keyword allows (None if it is not a string or a list of the
    seven type names: an unknown name is the backend's error to report)."""
    names = [value] if isinstance(value, str) else value if isinstance(value, list) else None
    if names is None or not all(isinstance(n, str) and n in _ALL_TYPES for n in names):
        return None
    out: set[str] = set()
    for name in names:
        out |= {"integer", "number"} if name == "number" else {name}
    return out


def _types_of_value(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def _same_json(a: Any, b: Any) -> bool:
    # JSON equality: 1 == 1.0, but true != 1 (Python's == says True == 1).
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _is_num(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _node_reasons(node: dict[str, Any]) -> list[str] | None:
    """The reasons that rule out every type `node` allows, or None if one is left."""
    allowed = set(_ALL_TYPES)
    reasons: list[str] = []

    def rule_out(types: set[str], reason: str) -> None:
        if allowed & types:
            allowed.difference_update(types)
            reasons.append(reason)

    declared = _types_of_keyword(node.get("type"))
    if declared is not None:
        if not declared:
            return ["type is an empty list"]
        allowed &= declared
    for key in ("enum", "anyOf", "oneOf"):
        if node.get(key) == []:
            return [f"{key} is an empty list"]
    if "const" in node:
        const = node["const"]
        rule_out(allowed - _types_of_value(const), f"const {_show(const)} is not of type "
                                                   f"{_show(node['type'])}" if declared else
                 f"const {_show(const)} is of type {sorted(_types_of_value(const))[0]}")
        enum = node.get("enum")
        if isinstance(enum, list) and not any(_same_json(const, v) for v in enum):
            return [f"const {_show(const)} is not one of enum {_show(enum)}"]
    if isinstance(node.get("enum"), list):
        enum_types = set().union(*(_types_of_value(v) for v in node["enum"]))
        rule_out(allowed - enum_types, f"no enum value is of type {_show(node['type'])}"
                 if declared else f"enum values are of types {', '.join(sorted(enum_types))}")
    if isinstance(node.get("allOf"), list):
        typed = [m["type"] for m in node["allOf"] if isinstance(m, dict)
                 and _types_of_keyword(m.get("type")) is not None]
        common = set(_ALL_TYPES).intersection(*(_types_of_keyword(t) or set() for t in typed))
        rule_out(allowed - common, "allOf members require types that do not overlap: "
                                   + ", ".join(_show(t) for t in typed))
    _check_numbers(node, rule_out)
    _check_counts(node, rule_out)
    return reasons if not allowed else None


def _check_numbers(node: dict[str, Any], rule_out: Any) -> None:
    lo, lo_excl = node.get("minimum"), node.get("exclusiveMinimum")
    hi, hi_excl = node.get("maximum"), node.get("exclusiveMaximum")
    # Draft 4: exclusiveMinimum/Maximum are booleans that make minimum/maximum strict.
    lo_strict = lo_excl is True
    hi_strict = hi_excl is True
    if _is_num(lo_excl) and (not _is_num(lo) or lo_excl >= lo):
        lo, lo_strict = lo_excl, True
    if _is_num(hi_excl) and (not _is_num(hi) or hi_excl <= hi):
        hi, hi_strict = hi_excl, True
    if not (_is_num(lo) and _is_num(hi)):
        return
    lo_name = ("exclusiveMinimum" if _is_num(lo_excl) and lo == lo_excl
               else "minimum (exclusive)" if lo_strict else "minimum")
    hi_name = ("exclusiveMaximum" if _is_num(hi_excl) and hi == hi_excl
               else "maximum (exclusive)" if hi_strict else "maximum")
    if lo > hi or (lo == hi and (lo_strict or hi_strict)):
        rule_out({"integer", "number"}, f"{lo_name} {_show(lo)} is greater than "
                                        f"{'or equal to ' if lo <= hi else ''}"
                                        f"{hi_name} {_show(hi)}")
        return
    first = math.floor(lo) + 1 if lo_strict and float(lo).is_integer() else math.ceil(lo)
    last = math.ceil(hi) - 1 if hi_strict and float(hi).is_integer() else math.floor(hi)
    if first > last:
        rule_out({"integer"}, f"no integer lies between {lo_name} {_show(lo)} and "
                              f"{hi_name} {_show(hi)}")


def _check_counts(node: dict[str, Any], rule_out: Any) -> None:
    for low, high, json_type in (("minLength", "maxLength", "string"),
                                 ("minItems", "maxItems", "array"),
                                 ("minProperties", "maxProperties", "object")):
        lo, hi = node.get(low), node.get(high)
        if _is_num(lo) and _is_num(hi) and lo > hi:
            rule_out({json_type}, f"{low} {_show(lo)} is greater than {high} {_show(hi)}")
    required = node.get("required")
    if not isinstance(required, list):
        return
    names = {name for name in required if isinstance(name, str)}
    max_props = node.get("maxProperties")
    if _is_num(max_props) and len(names) > max_props:
        rule_out({"object"}, f"{len(names)} required properties exceed maxProperties "
                             f"{_show(max_props)}")
    properties = node.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    if node.get("additionalProperties") is False and not node.get("patternProperties"):
        missing = sorted(names - properties.keys())
        if missing:
            rule_out({"object"}, f"required property {_show(missing[0])} is not in "
                                 "properties and additionalProperties is false")


def _show(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
