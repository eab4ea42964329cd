"""The unsatisfiable-schema check: the contradictions it names, with the JSON pointer of
the subschema, and no refusal of a schema some value matches (the 30 schemas of
tests/data, and the near misses of each case)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from flowengine.sampling_params import StructuredOutputsParams
from flowengine.structured_outputs.schema_check import unsatisfiable_json_schema
from flowengine.structured_outputs.validate import validate_structured_outputs

DATA = json.loads((Path(__file__).parents[1] / "data" / "json_schemas.json").read_text())


@pytest.mark.parametrize(("schema", "reason"), [
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum 5 is greater than maximum 1"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1},
     "exclusiveMinimum 1 is greater than or equal to maximum 1"),
    ({"type": "number", "minimum": 1, "maximum": 1, "exclusiveMaximum": True},  # draft 4
     "minimum 1 is greater than or equal to maximum (exclusive) 1"),
    ({"type": "integer", "minimum": 1.5, "maximum": 1.7},
     "no integer lies between minimum 1.5 and maximum 1.7"),
    ({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4},
     "no integer lies between exclusiveMinimum 3 and exclusiveMaximum 4"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 is greater than maxLength 2"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems 3 is greater than maxItems 1"),
    ({"type": "object", "minProperties": 3, "maxProperties": 1},
     "minProperties 3 is greater than maxProperties 1"),
    ({"type": "object", "required": ["a", "b"], "maxProperties": 1},
     "2 required properties exceed maxProperties 1"),
    ({"type": "object", "required": ["a"], "additionalProperties": False},
     'required property "a" is not in properties and additionalProperties is false'),
    ({"enum": []}, "enum is an empty list"),
    ({"anyOf": []}, "anyOf is an empty list"),
    ({"oneOf": []}, "oneOf is an empty list"),
    ({"type": []}, "type is an empty list"),
    ({"type": "string", "const": 5}, 'const 5 is not of type "string"'),
    ({"type": "integer", "const": True}, 'const true is not of type "integer"'),  # not 1
    ({"type": "integer", "enum": ["a", "b"]}, 'no enum value is of type "integer"'),
    ({"const": 1, "enum": [2]}, "const 1 is not one of enum [2]"),
    ({"const": True, "enum": [1]}, "const true is not one of enum [1]"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]},
     'allOf members require types that do not overlap: "string", "integer"'),
    ({"type": "string", "allOf": [{"type": ["integer", "null"]}]},
     'allOf members require types that do not overlap: ["integer", "null"]'),
    # Several cases together rule out every type; each is named.
    ({"type": ["string", "integer"], "minimum": 5, "maximum": 1, "maxLength": 1,
      "minLength": 2}, "minimum 5 is greater than maximum 1; minLength 2 is greater than "
                      "maxLength 1"),
    # Nested subschemas are named by their JSON pointer (RFC 6901 escapes).
    ({"type": "object", "properties": {"a/b": {"type": "array", "items": {
        "type": "string", "const": 1}}}}, 'at /properties/a~1b/items: const 1 is not of '
                                          'type "string"'),
    ({"anyOf": [{"type": "null"}, {"type": "boolean", "enum": [1]}]},
     'at /anyOf/1: no enum value is of type "boolean"'),
    ({"$defs": {"x": {"type": "integer", "minimum": 2, "maximum": 1}}, "$ref": "#/$defs/x"},
     "at /$defs/x: minimum 2 is greater than maximum 1"),
])
def test_unsatisfiable_schemas_are_named(schema, reason):
    assert unsatisfiable_json_schema(schema) == reason


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": 3, "maximum": 3},
    {"type": "number", "minimum": 1.5, "maximum": 1.7},
    {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 5},
    {"type": ["string", "integer"], "minimum": 5, "maximum": 1},  # strings still match
    {"minimum": 5, "maximum": 1},  # no type: any non-number matches
    {"type": "number", "const": 5},
    {"type": "integer", "const": 5.0},  # 5.0 is an integer in JSON Schema
    {"const": 1, "enum": [1.0, "a"]},
    {"type": "integer", "enum": ["a", 2]},
    {"type": "object", "required": ["a"], "additionalProperties": False,
     "properties": {"a": {"type": "string"}}},
    {"type": "object", "required": ["x-1"], "additionalProperties": False,
     "patternProperties": {"^x-": {}}},
    {"type": "object", "additionalProperties": False},
    {"type": "array", "items": False},
    {"not": {"enum": []}},  # anything matches
    {"allOf": [{"type": "number"}, {"type": "integer"}]},
    {"allOf": [{"type": ["string", "null"]}, {"minLength": 1}]},
    {"type": "objectx"},  # an unknown type is the backend's error, not this check's
    *DATA["schemas"].values(),
])
def test_satisfiable_schemas_pass(schema):
    assert unsatisfiable_json_schema(schema) is None


@pytest.mark.parametrize("backend", ["auto", "xgrammar", "guidance"])
def test_every_backend_refuses_with_the_same_reason(backend):
    params = StructuredOutputsParams(json={"type": "string", "const": 5})
    with pytest.raises(ValueError) as info:
        validate_structured_outputs(params, backend, field="guided_json")
    assert str(info.value) == ('guided_json is unsatisfiable, no JSON value can match it: '
                               'const 5 is not of type "string"')


def test_examples_of_near_misses_validate():
    # The satisfiable near misses above do have a matching value (jsonschema agrees).
    for schema, value in [({"type": "integer", "minimum": 3, "maximum": 3}, 3),
                          ({"type": "integer", "const": 5.0}, 5),
                          ({"type": ["string", "integer"], "minimum": 5, "maximum": 1}, "s"),
                          ({"type": "object", "required": ["x-1"],
                            "additionalProperties": False,
                            "patternProperties": {"^x-": {}}}, {"x-1": 0})]:
        jsonschema.validate(value, schema)
