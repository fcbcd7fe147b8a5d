"""Llama 4: the JSON call its shipped template asks for, `{"name": NAME, "parameters": {...}}` (several
written one after another or split by `;`), and the Python-style list that Meta documents as the model's
own format, `[NAME(key=value, ...), NAME(...)]`.

The `<|python_start|>` / `<|python_end|>` tokens a call may sit between are special tokens the decoder
drops. In the list form, values are Python or JSON literals (`True` and `true` alike); a positional
argument or any expression makes the list plain text."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from server.tool_parsers.base import (
    FunctionCall,
    Match,
    ToolParser,
    call_schema,
    function_call,
    json_rule,
    malformed,
)

JSON_MARKERS = ('{"name"', '{ "name"', '{"type": "function"')
LIST_MARKER = "["
_LIST_HEAD = re.compile(r"\[\s*[A-Za-z_][\w.\-]*\s*\(")
_LIST_HEAD_SO_FAR = re.compile(r"\[\s*(?:[A-Za-z_][\w.\-]*\s*)?")  # what may still become a list head
_SEPARATOR = re.compile(r"\s*;?\s*")
_JSON_WORDS = {"true": True, "false": False, "null": None}
_CLOSING = {"[": "]", "(": ")", "{": "}"}


class Llama4Parser(ToolParser):
    name = "llama4"
    markers = (*JSON_MARKERS, LIST_MARKER)

    def match(self, text: str, final: bool) -> Match | None:
        if text.startswith(LIST_MARKER):
            return self._python_list(text, final)
        return self._json_calls(text, final)

    def _json_calls(self, text: str, final: bool) -> Match | None:
        calls: list[FunctionCall] = []
        end = at = 0
        while True:
            read = _json_object(text, at)
            if read is None and not final:
                return None  # cut short: more output may complete it
            call = _json_call(read[0]) if read else None
            if call is None:
                break
            calls.append(call)
            end = read[1]
            at = _SEPARATOR.match(text, end).end()
            rest = text[at:]
            if not final and any(marker.startswith(rest) for marker in JSON_MARKERS):
                return None  # another call may follow
            if not rest.startswith(JSON_MARKERS):
                break
        if calls:
            return Match(end, tuple(calls))
        if read is None:
            return malformed(text)  # the output ended inside it
        return malformed(text, read[1] if read else 1)  # not JSON: its brace is text, what follows is read again

    def _python_list(self, text: str, final: bool) -> Match | None:
        if not _LIST_HEAD.match(text):
            so_far = _LIST_HEAD_SO_FAR.match(text)
            if not final and so_far.end() == len(text):
                return None
            return malformed(text, 1)  # not a call list: the bracket is text, what follows is read again
        end = _closing_bracket(text)
        if end is None:
            return None if not final else malformed(text)
        try:
            calls = _listed_calls(text[:end])
        except ValueError:
            return malformed(text, end)
        return Match(end, calls)

    def call_grammar(self, tools: list[dict], name: str | None) -> str | None:
        """One JSON call, as the shipped template writes calls in the history."""
        return f"start: call\ncall: {json_rule(call_schema(tools, name, arguments_key='parameters'))}\n"


def _json_object(text: str, at: int) -> tuple[dict, int] | bool | None:
    """The JSON object at `text[at:]` and where it ends; None if the text ends inside it, False if it is
    not one."""
    try:
        value, end = json.JSONDecoder().raw_decode(text, at)
    except json.JSONDecodeError as error:
        cut = error.pos >= len(text) or error.msg.startswith("Unterminated string")
        return None if cut else False
    return (value, end) if isinstance(value, dict) else False


def _json_call(body: dict) -> FunctionCall | None:
    return function_call(body.get("name"), body.get("parameters", body.get("arguments", {})))


def _closing_bracket(text: str) -> int | None:
    """Where the bracket opening `text` closes (just after it), skipping quoted strings; None if not yet."""
    stack: list[str] = []
    quote = None
    escaped = False
    for i, char in enumerate(text):
        if quote is not None:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char in _CLOSING:
            stack.append(_CLOSING[char])
        elif char in ")]}":
            if not stack or stack.pop() != char:
                return i + 1  # mismatched: the span ends here and does not parse
            if not stack:
                return i + 1
    return None


def _listed_calls(source: str) -> tuple:
    """The calls of `[NAME(key=value, ...), ...]`; ValueError where it is anything else."""
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, RecursionError, MemoryError) as error:
        raise ValueError("not Python") from error
    if not isinstance(tree, ast.List) or not tree.elts:
        raise ValueError("not a list of calls")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            raise ValueError("not a call with keyword arguments")
        call = function_call(_dotted_name(node.func), {k.arg: _literal(k.value) for k in node.keywords})
        if call is None:
            raise ValueError("no name")
        calls.append(call)
    return tuple(calls)


def _dotted_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise ValueError("not a function name")


def _literal(node: ast.expr) -> Any:
    """A Python or JSON literal; ValueError for anything else."""
    if isinstance(node, ast.Name) and node.id in _JSON_WORDS:
        return _JSON_WORDS[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):
            raise ValueError("** in a dict")
        return {_key(key): _literal(value) for key, value in zip(node.keys, node.values, strict=True)}
    value = ast.literal_eval(node)  # constants and signed numbers; raises ValueError otherwise
    if isinstance(value, (set, bytes, complex, tuple)):
        raise ValueError("not a JSON value")
    return value


def _key(node: ast.expr | None) -> str:
    key = _literal(node)
    if not isinstance(key, str):
        raise ValueError("a dict key that is not a string")
    return key
