"""Which JSON Schema keywords structured output enforces, checked before anything compiles.

xgrammar skips keywords it does not implement (`not`, `if`, `uniqueItems`, ...) without a word, so a schema
using one would be followed only in part. Pure Python (no xgrammar, no torch): the API process runs it to
answer 400 naming the keyword, and the engine runs it again for the offline API.
"""

from __future__ import annotations

from typing import Any

# Keywords the grammar enforces.
ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "patternProperties", "unevaluatedProperties",
    "minProperties", "maxProperties", "items", "prefixItems", "minItems", "maxItems", "enum", "const", "anyOf",
    "oneOf", "allOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern", "format", "minimum",
    "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})
# Keywords that describe and constrain nothing.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "strict", "nullable", "name",
})
_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")  # [subschema]
_ONE = ("items", "additionalProperties", "unevaluatedProperties")  # a subschema (or a bool)


def check_schema(schema: Any, path: str = "schema") -> None:
    """Raise ValueError naming the first keyword (and where it is) that the grammar would not enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{path} must be a JSON schema (an object or a boolean), got {type(schema).__name__}")
    for key, value in schema.items():
        where = f"{path}.{key}"
        if key not in ENFORCED and key not in ANNOTATIONS:
            raise ValueError(f"unsupported JSON schema feature '{key}' (at {where}): structured output cannot "
                             "enforce it; remove it or express it with the supported keywords")
        if key in _MAPS:
            if not isinstance(value, dict):
                raise ValueError(f"{where} must be an object")
            for name, sub in value.items():
                check_schema(sub, f"{where}.{name}")
        elif key in _LISTS:
            if not isinstance(value, list):
                raise ValueError(f"{where} must be an array")
            if key == "allOf" and len(value) > 1:
                raise ValueError(f"unsupported JSON schema feature 'allOf' with more than one schema (at {where})")
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}.{i}")
        elif key in _ONE and isinstance(value, (dict, bool)):
            check_schema(value, where)
        elif key == "items" and isinstance(value, list):  # draft-7's tuple form
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}.{i}")


def lengths_as_patterns(schema: Any) -> Any:
    """The schema with each string's minLength/maxLength (where it has no pattern or format) rewritten as the
    pattern `^.{min,max}$`. xgrammar 0.2.8 turns a length bound into a character class that lets raw control
    characters through, which no JSON parser accepts; its pattern strings keep them out (and escapes, and line
    breaks, with them: such strings hold printable characters only)."""
    if isinstance(schema, list):
        return [lengths_as_patterns(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: lengths_as_patterns(v) for k, v in schema.items()}
    if out.get("type") == "string" and ("minLength" in out or "maxLength" in out) \
            and "pattern" not in out and "format" not in out \
            and all(isinstance(out.get(k, 0), int) for k in ("minLength", "maxLength")):
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^.{{{lo},{hi}}}$"
    return out


# The string formats llguidance enforces; it refuses a schema with any other, which JSON Schema makes an
# annotation by default (and xgrammar ignores): those are dropped for it.
LLGUIDANCE_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6",
                                "uri", "uuid"})
_APPLICATORS = ("allOf", "anyOf", "oneOf", "$ref")


def for_llguidance(schema: Any) -> Any:
    """The schema as llguidance takes it: formats it does not know dropped, and `unevaluatedProperties`
    (which it does not implement) as the `additionalProperties` it equals in a schema that combines no others
    (with allOf, anyOf, oneOf or $ref it stays, and llguidance refuses it)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("format"), str) and out["format"] not in LLGUIDANCE_FORMATS:
        del out["format"]
    if "unevaluatedProperties" in out and "additionalProperties" not in out \
            and not any(k in out for k in _APPLICATORS):
        out["additionalProperties"] = out.pop("unevaluatedProperties")
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: for_llguidance(sub) for name, sub in out[key].items()}
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [for_llguidance(sub) for sub in out[key]]
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = for_llguidance(out[key])
    if isinstance(out.get("items"), list):
        out["items"] = [for_llguidance(sub) for sub in out["items"]]
    return out
