"""Hermes style, used by Qwen2/2.5/3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`; a JSON list of
such calls in one block (Granite 3.1, which may leave the block unclosed at the end) is read too."""

from __future__ import annotations

import json

from server.tool_parsers.base import Match, ToolParser, call_schema, function_call, loads, malformed

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    markers = (OPEN,)

    def match(self, text: str, final: bool) -> Match | None:
        close = text.find(CLOSE)
        if close < 0 and not final:
            return None
        end = len(text) if close < 0 else close + len(CLOSE)  # an unclosed call at the end: parse what is there
        body = loads(text[len(OPEN): close if close >= 0 else len(text)].strip())
        items = body if isinstance(body, list) else [body]  # a list: Granite 3.1's form
        calls = [function_call(i.get("name"), i.get("arguments", i.get("parameters", {}))) if isinstance(i, dict)
                 else None for i in items]
        if not calls or None in calls:
            return malformed(text, end)
        return Match(end, tuple(calls))

    def call_grammar(self, tools: list[dict], name: str | None) -> str | None:
        return (f'start: {self.literal(OPEN)} "\\n" call "\\n" {self.literal(CLOSE)}\n'
                f"call: %json {json.dumps(call_schema(tools, name))}\n")
