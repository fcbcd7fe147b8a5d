"""Kimi-K2 / Kimi-Linear: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
<|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>`.

The id the model writes (`functions.NAME:N`) is the call's id: Kimi's template renders it back in the
history, with the tool result that answers it."""

from __future__ import annotations

import dataclasses
import json
import re

from server.tool_parsers.base import (
    BlockParser,
    FunctionCall,
    arguments_rule,
    function_call,
)

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(ARGUMENT_BEGIN) + r"(.*?)" + re.escape(CALL_END),
                   re.DOTALL)
_ID = re.compile(r"(?:functions\.)?([A-Za-z0-9_.\-]+?)(?::\d+)?")


class KimiK2Parser(BlockParser):
    name = "kimi_k2"
    markers = (SECTION_BEGIN,)
    closing = SECTION_END
    needs_special_tokens = True

    def read_block(self, body: str) -> tuple[FunctionCall, ...] | None:
        calls = [_call(call_id.strip(), arguments) for call_id, arguments in _CALL.findall(body)]
        if not calls or None in calls or _CALL.sub("", body).strip():
            return None
        return tuple(calls)

    def call_grammar(self, tools: list[dict], name: str | None) -> str | None:
        head = " ".join(self.literal(t) for t in (SECTION_BEGIN, CALL_BEGIN))
        tail = " ".join(self.literal(t) for t in (CALL_END, SECTION_END))
        return f"start: {head} call {tail}\n" + self.call_rules(tools, name, self._call_rule)

    def _call_rule(self, function: dict) -> str:
        call_id = json.dumps(f"functions.{function['name']}:0", ensure_ascii=False)
        return f"{call_id} {self.literal(ARGUMENT_BEGIN)} {arguments_rule(function)}"


def _call(call_id: str, arguments: str) -> FunctionCall | None:
    """A call from the id the model wrote (`functions.NAME:N`, or a bare name) and its JSON arguments."""
    written = _ID.fullmatch(call_id)
    call = function_call(written.group(1), arguments) if written else None
    return dataclasses.replace(call, id=call_id) if call else None
