"""Granite 3 (3.0 to 3.3, dense and MoE): `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`, the calls as
one JSON list after a special token (a lone object is read too)."""

from __future__ import annotations

from server.tool_parsers.base import Match, ToolParser, call_schema, json_calls, json_rule

MARKER = "<|tool_call|>"


class GraniteParser(ToolParser):
    name = "granite"
    markers = (MARKER,)
    needs_special_tokens = True

    def match(self, text: str, final: bool) -> Match | None:
        return json_calls(text, len(MARKER), final)

    def call_grammar(self, tools: list[dict], name: str | None) -> str | None:
        """A list of one call, as Granite's template writes calls in the history."""
        return f'start: {self.literal(MARKER)} "[" call "]"\ncall: {json_rule(call_schema(tools, name))}\n'
