"""Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (tokenizer v3, Mixtral-8x22B) or
`[TOOL_CALLS]name[ARGS]{...}` repeated, optionally with `[CALL_ID]id` before `[ARGS]` (v11 and later)."""

from __future__ import annotations

import random
import re
import string

from server.tool_parsers.base import (
    Match,
    ToolParser,
    call_schema,
    decode_prefix,
    function_call,
    json_calls,
    json_rule,
    malformed,
)

MARKER = "[TOOL_CALLS]"
_NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")


class MistralParser(ToolParser):
    name = "mistral"
    markers = (MARKER,)
    needs_special_tokens = True

    def match(self, text: str, final: bool) -> Match | None:
        rest = text[len(MARKER):]
        if rest.lstrip()[:1] in ("[", "{"):
            return json_calls(text, len(MARKER), final)
        named = _NAMED.match(rest)
        if named is None:
            return malformed(text) if final else None
        return self._named(text, len(MARKER) + named.end(), named.group(1), final)

    def _named(self, text: str, args_at: int, name: str, final: bool) -> Match | None:
        decoded = decode_prefix(text[args_at:])
        if decoded is None:
            return malformed(text) if final else None
        value, end = decoded
        call = function_call(name, value)
        return Match(args_at + end, (call,)) if call else malformed(text, args_at + end)

    def call_grammar(self, tools: list[dict], name: str | None) -> str | None:
        """The v3 list (as Mixtral-8x22B's template writes calls) with one call in it."""
        return f'start: {self.literal(MARKER)} " [" call "]"\ncall: {json_rule(call_schema(tools, name))}\n'

    def new_call_id(self) -> str:
        # Mistral's templates refuse any other id in the history: nine letters or digits
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))
