"""Llama 4: the JSON call its shipped template asks for, `{"name": NAME, "parameters": {...}}` (several
written one after another or split by `;`), and the Python-style list that Meta documents as the model's
own format, `[NAME(key=value, ...), NAME(...)]` (read by `pythonic`: a positional argument or any expression
makes the list plain text).

The `<|python_start|>` / `<|python_end|>` tokens a call may sit between are special tokens the decoder
drops."""

from __future__ import annotations

import json
import re

from server.tool_parsers.base import (
    FunctionCall,
    Match,
    ToolParser,
    call_schema,
    function_call,
    json_rule,
    malformed,
)
from server.tool_parsers.pythonic import closing_bracket, python_calls

JSON_MARKERS = ('{"name"', '{ "name"', '{"type": "function"')
LIST_MARKER = "["
_LIST_HEAD = re.compile(r"\[\s*[A-Za-z_][\w.\-]*\s*\(")
_LIST_HEAD_SO_FAR = re.compile(r"\[\s*(?:[A-Za-z_][\w.\-]*\s*)?")  # what may still become a list head
_SEPARATOR = re.compile(r"\s*;?\s*")


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
        end = closing_bracket(text)
        if end is None:
            return None if not final else malformed(text)
        try:
            calls = python_calls(text[:end])
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
