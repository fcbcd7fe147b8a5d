"""Hunyuan-A13B: `<tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>`, the calls as one JSON list in a
block (a lone object is read too)."""

from __future__ import annotations

from server.tool_parsers.base import BlockParser, FunctionCall, call_schema, json_calls, json_rule

OPEN, CLOSE = "<tool_calls>", "</tool_calls>"


class HunyuanParser(BlockParser):
    name = "hunyuan"
    markers = (OPEN,)
    closing = CLOSE
    needs_special_tokens = True  # where the tags are added tokens, the decoder would drop them

    def read_block(self, body: str) -> tuple[FunctionCall, ...] | None:
        read = json_calls(body, 0, final=True)
        return read.calls if read.calls and not body[read.end:].strip() else None

    def call_grammar(self, tools: list[dict], name: str | None) -> str | None:
        """A list of one call, as Hunyuan's template writes calls in the history."""
        return (f'start: {self.literal(OPEN)} "[" call "]" {self.literal(CLOSE)}\n'
                f"call: {json_rule(call_schema(tools, name))}\n")
