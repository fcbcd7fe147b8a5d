"""Tool calls written as a Python list of calls, `[NAME(key=value, ...), NAME(...)]` (Llama 4's and LFM2's native
form): read without running anything; values are Python or JSON literals (`True` and `true` alike)."""

from __future__ import annotations

import ast
from typing import Any

from server.tool_parsers.base import FunctionCall, function_call

_JSON_WORDS = {"true": True, "false": False, "null": None}
_CLOSING = {"[": "]", "(": ")", "{": "}"}


def closing_bracket(text: str) -> int | None:
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


def python_calls(source: str) -> tuple[FunctionCall, ...]:
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
