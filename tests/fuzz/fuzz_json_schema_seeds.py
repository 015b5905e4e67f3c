#!/usr/bin/env python3
"""Writes seed inputs for fuzz_json_schema: schemas with every supported keyword (objects, arrays,
enums, const, $defs and $ref, anyOf/oneOf, patterns, formats, lengths) and refused ones."""
import json
import os
import sys

out = sys.argv[1]
S = {"type": "string", "maxLength": 5}
seeds = [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": S, "c": {"type": "boolean"}},
     "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": ["number", "null"]}}, "additionalProperties": {"type": "integer"}},
    {"type": "array", "items": {"enum": ["a", 1, None, {"k": [1]}]}, "minItems": 1, "maxItems": 3},
    {"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"},
                                                        "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
                     "required": ["v"]}}, "$ref": "#/$defs/n"},
    {"oneOf": [{"const": "x"}, {"type": "string", "pattern": "^[A-Z]{2}-\\d{1,3}(x|yz)?$"}]},
    {"type": "string", "format": "date-time"},
    {"type": "string", "pattern": "a[^0-9\"\\\\]+.b*"},
    {"type": "string", "pattern": "^[^]+[^a]$"},
    {"definitions": {"a": {"$ref": "#/definitions/a"}}, "$ref": "#/definitions/a"},
    {"type": "integer", "minimum": 1},
    {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]},
    True,
]
for i, s in enumerate(seeds):
    with open(os.path.join(out, f"seed-{i}.json"), "w") as f:
        f.write(json.dumps(s))
