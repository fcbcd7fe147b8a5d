"""User JSON schemas made ready for the grammar: read as llama.cpp and Ollama read them, and placed
where the grammar puts them (a tool's parameters inside the schema of a whole call).

The grammar library here follows JSON Schema to the letter, so a model may write what JSON Schema
admits but nobody asked for, and a small model may go on doing so until `max_tokens` cuts the JSON
short. Two things are admitted without being asked for:
- An object schema that lists its `properties` admits any other key unless it says otherwise.
  llama.cpp's converter (which Ollama uses) and xgrammar's strict mode (vLLM's default) admit no
  other key, so the schema is closed here before decoding.
- An integer without bounds may have any number of digits. llama.cpp writes at most 16 (beyond
  2^53, 16 digits, a JSON number is not exact in JavaScript anyway), so the same bounds are set here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
                 "contains", "propertyNames", "not", "if", "then", "else")
# An object with one of these keys is open on purpose, or is merged with another schema whose keys closing it
# would exclude.
KEEP_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref",
             "if", "then", "else", "dependentSchemas", "dependentRequired")
INTEGER_LIMIT = 10**16 - 1  # the largest integer of 16 digits, llama.cpp's longest


def as_llama_cpp_reads(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` that admits what llama.cpp's reading of it admits.

    Each object schema that lists `properties` admits no other keys, unless it asks for others or is
    merged with another schema. Merged means an `allOf` member, an `anyOf` or `oneOf` member beside
    `properties` (the two are intersected), a `$ref` beside `properties`, or a definition referred to
    from one of those. Each integer schema without a bound gets ±`INTEGER_LIMIT`."""
    return _close(schema, _merged_refs(schema), merged=False)


def _close(node: Any, merged_refs: set[str], merged: bool) -> Any:
    if not isinstance(node, dict):
        return node
    out = _map_children(node, lambda sub, key, name: _close(sub, merged_refs, _merged_child(node, key, name, merged_refs)))
    if not merged and _lists_all_its_keys(node):
        out["additionalProperties"] = False
    if _is_integer(node):
        out.update(_digit_bounds(node))
    return out


def _is_integer(node: dict[str, Any]) -> bool:
    types = node.get("type")
    types = types if isinstance(types, list) else [types]
    return "integer" in types and "number" not in types and "enum" not in node and "const" not in node


def _digit_bounds(node: dict[str, Any]) -> dict[str, int]:
    """The bounds an integer schema lacks, where they leave its own range as it is."""
    low = _number(node, "minimum", "exclusiveMinimum")
    high = _number(node, "maximum", "exclusiveMaximum")
    bounds = {}
    if low is None and (high is None or high > -INTEGER_LIMIT):
        bounds["minimum"] = -INTEGER_LIMIT
    if high is None and (low is None or low < INTEGER_LIMIT):
        bounds["maximum"] = INTEGER_LIMIT
    return bounds


def _number(node: dict[str, Any], *keys: str) -> float | None:
    """The first of `keys` that `node` sets to a number (a bound set to anything else counts as set: the
    grammar library judges it)."""
    for key in keys:
        if key in node:
            value = node[key]
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0
    return None


def placed_at(schema: dict[str, Any], pointer: str) -> dict[str, Any]:
    """`schema` to be placed at JSON pointer `pointer` inside another schema: its local `$ref`s ("#...")
    point into it there (a tool's `parameters` inside the schema of a whole call)."""

    def rebase(node: Any, *_: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = _map_children(node, rebase)
        if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
            out["$ref"] = "#" + pointer + node["$ref"][1:]
        return out

    return rebase(schema)


def with_definitions(spec: Any, root: dict[str, Any]) -> Any:
    """`spec`, a subschema of `root` to be used on its own (one parameter's schema), with the root's
    definitions, which its `$ref`s may point to."""
    if not isinstance(spec, dict) or "$ref" not in json.dumps(spec):
        return spec
    return {**spec, **{key: root[key] for key in ("$defs", "definitions") if key in root and key not in spec}}


def _map_children(node: dict[str, Any], fn: Callable[[Any, str, Any], Any]) -> dict[str, Any]:
    """A copy of schema `node` with `fn(child, keyword, name)` in place of each of its subschemas (name: the
    child's key in a map of schemas, its index in a list of them, else None)."""
    out = {}
    for key, value in node.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: fn(sub, key, name) for name, sub in value.items()}
        elif key in SCHEMA_LISTS and isinstance(value, list):
            out[key] = [fn(sub, key, i) for i, sub in enumerate(value)]
        elif key in SCHEMA_VALUES:
            out[key] = [fn(sub, key, i) for i, sub in enumerate(value)] if isinstance(value, list) else fn(value, key, None)
        else:
            out[key] = value
    return out


def _merged_child(node: dict[str, Any], key: str, name: Any, merged_refs: set[str]) -> bool:
    """Whether the subschema `node[key][name]` is merged with another schema."""
    return f"#/{key}/{name}" in merged_refs if key in SCHEMA_MAPS else _merges_members(node, key)


def _merges_members(node: dict[str, Any], key: str) -> bool:
    """Whether the members of `node[key]` (a list of schemas) are merged with another schema."""
    return key == "allOf" or (key in ("anyOf", "oneOf") and "properties" in node)


def _lists_all_its_keys(node: dict[str, Any]) -> bool:
    """Whether `node` is an object schema whose `properties` are all the keys it means (its required
    keys among them)."""
    properties, required = node.get("properties"), node.get("required") or []
    return (isinstance(properties, dict) and not any(key in node for key in KEEP_OPEN)
            and isinstance(required, list) and all(name in properties for name in required))


def _merged_refs(node: Any) -> set[str]:
    """The `$ref`s whose target is merged with another schema (see `as_llama_cpp_reads`)."""
    refs: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if isinstance(item.get("$ref"), str) and "properties" in item:
                refs.add(item["$ref"])
            for key in ("allOf", "anyOf", "oneOf"):
                members = item.get(key) if isinstance(item.get(key), list) and _merges_members(item, key) else []
                refs.update(m["$ref"] for m in members if isinstance(m, dict) and isinstance(m.get("$ref"), str))
            stack.extend(item.values())
    return refs
