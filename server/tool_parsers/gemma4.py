"""Gemma 4: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:42,flag:true,obj:{k:v},list:[v,...]}<tool_call|>`,
one call per block, blocks written one after another.

Keys are bare; strings are delimited by the `<|"|>` token (a plain JSON string `"text"` is read too); numbers,
`true`, `false` and `null` are as in JSON; objects and arrays nest in the same syntax. A bare number (or
boolean) for a parameter the tool declares as a string stays its text (see `bare_value`). Anything else,
bare words included, makes the block malformed: it stays text."""

from __future__ import annotations

import json
import re
from typing import Any

from server.tool_parsers.base import (
    FUNCTION_NAME,
    BlockParser,
    FunctionCall,
    bare_value,
    bare_value_rule,
    function_call,
    functions,
    json_rule,
    ordered_pairs,
    parameters_schema,
)

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_HEAD = re.compile(r"\s*call:([^{\s]*)\s*(?=\{)")
_KEY = re.compile(r"[A-Za-z_$][A-Za-z0-9_.$\-]*")
# a scalar ends where its container goes on
_SCALAR = re.compile(r"(-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null)(?=\s*[,}\]]|\s*$)")
_BLANK = re.compile(r"\s*")


class Gemma4Parser(BlockParser):
    name = "gemma4"
    markers = (OPEN,)
    closing = CLOSE
    needs_special_tokens = True

    def read_block(self, body: str) -> tuple[FunctionCall, ...] | None:
        head = _HEAD.match(body)
        if not head or not FUNCTION_NAME.fullmatch(head.group(1)):
            return None
        name = head.group(1)
        try:
            arguments, at = read_value(body, head.end(), self.parameter_types(name))
        except ValueError:
            return None
        if body[at:].strip():  # nothing after the arguments
            return None
        call = function_call(name, arguments)
        return (call,) if call else None

    def call_grammar(self, tools: list[dict], name: str | None) -> str | None:
        rules = _Rules(self.literal(QUOTE))
        calls = [f'{json.dumps("call:" + f["name"])} {rules.arguments(parameters_schema(f), f"c{i}")}'
                 for i, f in enumerate(functions(tools, name))]
        return (f"start: {self.literal(OPEN)} call {self.literal(CLOSE)}\n"
                f"call: {' | '.join(f'({c})' for c in calls)}\n" + "\n".join(rules.lines) + "\n")


def read_value(text: str, at: int, declared: dict[str, Any] | None = None) -> tuple[Any, int]:
    """The value written at `text[at:]` (after blanks) and where it ends; ValueError where it is not one.
    `declared`: the declared types of an object's keys (only the call's arguments have them)."""
    at = _BLANK.match(text, at).end()
    if text.startswith(QUOTE, at):
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0:
            raise ValueError("unclosed string")
        return text[at + len(QUOTE): end], end + len(QUOTE)
    if text.startswith('"', at):
        return json.JSONDecoder().raw_decode(text, at)  # JSONDecodeError is a ValueError
    if text.startswith("{", at):
        return _read_object(text, at + 1, declared or {})
    if text.startswith("[", at):
        return _read_array(text, at + 1)
    scalar = _SCALAR.match(text, at)
    if not scalar:
        raise ValueError(f"no value at {at}")
    return json.loads(scalar.group(1)), scalar.end()


def _read_object(text: str, at: int, declared: dict[str, Any]) -> tuple[dict, int]:
    out: dict[str, Any] = {}
    at = _BLANK.match(text, at).end()
    if text.startswith("}", at):
        return out, at + 1
    while True:
        key, at = _read_key(text, at)
        at = _BLANK.match(text, at).end()
        if not text.startswith(":", at):
            raise ValueError("no ':' after a key")
        start = _BLANK.match(text, at + 1).end()
        value, at = read_value(text, start)
        if declared.get(key) == "string" and not isinstance(value, (str, dict, list)):
            value = bare_value(text[start:at], "string")  # `city:1984` for a string: its text
        out[key] = value
        at = _BLANK.match(text, at).end()
        if text.startswith("}", at):
            return out, at + 1
        if not text.startswith(",", at):
            raise ValueError("no ',' or '}' after a value")
        at = _BLANK.match(text, at + 1).end()


def _read_array(text: str, at: int) -> tuple[list, int]:
    out: list[Any] = []
    at = _BLANK.match(text, at).end()
    if text.startswith("]", at):
        return out, at + 1
    while True:
        value, at = read_value(text, at)
        out.append(value)
        at = _BLANK.match(text, at).end()
        if text.startswith("]", at):
            return out, at + 1
        if not text.startswith(",", at):
            raise ValueError("no ',' or ']' after an item")
        at += 1


def _read_key(text: str, at: int) -> tuple[str, int]:
    if text.startswith((QUOTE, '"'), at):
        key, end = read_value(text, at)
        if isinstance(key, str):
            return key, end
    bare = _KEY.match(text, at)
    if not bare:
        raise ValueError(f"no key at {at}")
    return bare.group(), bare.end()


class _Rules:
    """Lark rules for values in Gemma 4's syntax under a JSON schema, each its own named rule (`%json`
    stands alone in a rule)."""

    def __init__(self, quote: str) -> None:
        self.quote = quote
        self.lines: list[str] = []
        self._generic: str | None = None
        self._root: dict = {}  # the schema of the arguments written now: its `$ref`s point into it
        self._expanding: set[str] = set()  # the `$ref`s being written out (one met again is recursion)

    def arguments(self, schema: dict, name: str) -> str:
        """A rule body for a call's arguments under `schema`."""
        self._root = schema
        return self.object(schema, name)

    def add(self, name: str, body: str) -> str:
        self.lines.append(f"{name}: {body}")
        return name

    def value(self, spec: Any, name: str) -> str:
        spec = spec if isinstance(spec, dict) else {}
        target = self._referred(spec)
        if target is not None:  # a definition (pydantic's nested models): written out where it is used
            self._expanding.add(spec["$ref"])
            try:
                return self.value(target, name)
            finally:
                self._expanding.discard(spec["$ref"])
        choices = [spec["const"]] if "const" in spec else spec.get("enum")
        if choices:
            return self.add(name, " | ".join(self._constant(c) for c in choices))
        kind = spec.get("type")
        if kind == "string":  # no markup inside: the string ends at the `<|"|>` token
            return self.add(name, f"{self.quote} {bare_value_rule(spec)} {self.quote}")
        if kind in ("integer", "number"):  # written as in JSON: bounds and multipleOf kept
            return self.add(name, json_rule(spec))
        if kind == "boolean":
            return self.add(name, '"true" | "false"')
        if kind == "null":
            return self.add(name, '"null"')
        if kind == "object":
            return self.add(name, self.object(spec, name))
        if kind == "array" and isinstance(spec.get("items"), dict):  # item counts are not kept
            item = self.value(spec["items"], f"{name}_i")
            return self.add(name, f'"[" ({item} ("," {item})*)? "]"')
        # type lists, anyOf/oneOf, a recursive $ref, open objects: too much for hand-written rules, any value
        return self.generic()

    def object(self, schema: dict, name: str) -> str:
        """A rule body for an object: the declared properties in the schema's order, the optional ones
        may be left out (no others); an object that declares none takes any keys."""
        properties = schema.get("properties")
        if not isinstance(properties, dict):
            return self.generic_object()
        required = set(schema.get("required") or ())
        keys = list(properties)
        pairs = [f'{json.dumps(key + ":", ensure_ascii=False)} {self.value(properties[key], f"{name}_{k}")}'
                 for k, key in enumerate(keys)]
        inner = ordered_pairs(pairs, [key in required for key in keys])
        if inner is None:
            return '"{}"'
        return f'"{{" ({inner}){"" if required & set(keys) else "?"} "}}"'

    def _referred(self, spec: dict) -> dict | None:
        """The definition `spec` refers to (`"$ref": "#/$defs/NAME"`), unless it is already being written out."""
        ref = spec.get("$ref")
        if not isinstance(ref, str) or ref in self._expanding:
            return None
        for keyword in ("$defs", "definitions"):
            prefix = f"#/{keyword}/"
            if ref.startswith(prefix) and isinstance(self._root.get(keyword), dict):
                target = self._root[keyword].get(ref.removeprefix(prefix))
                return target if isinstance(target, dict) else None
        return None

    def generic(self) -> str:
        if self._generic is None:
            self._generic = "g_value"
            q = self.quote
            self.lines += [
                "g_value: g_string | g_number | \"true\" | \"false\" | \"null\" | g_object | g_array",
                f"g_string: {q} /[^<]*/ {q}",
                "g_number: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/",
                'g_object: "{" (g_pair ("," g_pair)*)? "}"',
                "g_pair: /[A-Za-z_][A-Za-z0-9_]*/ \":\" g_value",
                'g_array: "[" (g_value ("," g_value)*)? "]"',
            ]
        return self._generic

    def generic_object(self) -> str:
        self.generic()
        return "g_object"

    def _constant(self, value: Any) -> str:
        if isinstance(value, str):
            return f"{self.quote} {json.dumps(value, ensure_ascii=False)} {self.quote}"
        return json.dumps(json.dumps(value))  # a number, true, false or null, as JSON writes it
