"""Qwen3-Coder, Qwen3.5 MoE, Nemotron 3 Nano: `<tool_call>\n<function=NAME>\n<parameter=k>\nv\n</parameter>\n
</function>\n</tool_call>`, one call per block.

A value is the text between its tags less one leading and one trailing newline (as vLLM reads it),
bare: a declared string stays text, any other is JSON where it parses (see `bare_value`)."""

from __future__ import annotations

import json
import re

from server.tool_parsers.base import (
    FUNCTION_NAME,
    BlockParser,
    FunctionCall,
    bare_value,
    bare_value_rule,
    function_call,
    parameter_rules,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderParser(BlockParser):
    name = "qwen3_coder"
    markers = (OPEN,)
    closing = CLOSE

    def read_block(self, body: str) -> tuple[FunctionCall, ...] | None:
        function = _FUNCTION.fullmatch(body)
        if not function or not FUNCTION_NAME.fullmatch(function.group(1).strip()):
            return None
        name, parameters = function.group(1).strip(), function.group(2)
        if _PARAMETER.sub("", parameters).strip():  # nothing but parameters in the call
            return None
        types = self.parameter_types(name)
        call = function_call(name, {key.strip(): bare_value(tag_value(value), types.get(key.strip()))
                                    for key, value in _PARAMETER.findall(parameters)})
        return (call,) if call else None

    def call_grammar(self, tools: list[dict], name: str | None) -> str | None:
        return (f'start: {self.literal(OPEN)} "\\n" call "\\n" {self.literal(CLOSE)}\n' +
                self.call_rules(tools, name, self._call_rule))

    def _call_rule(self, function: dict) -> str:
        opening = json.dumps("<function=" + function["name"] + ">\n", ensure_ascii=False)
        return " ".join([opening, *parameter_rules(function, _pair_rule), '"</function>"'])


def _pair_rule(key: str, spec: dict) -> str:
    opening = json.dumps("<parameter=" + key + ">\n", ensure_ascii=False)
    return f'{opening} {bare_value_rule(spec)} "\\n</parameter>\\n"'


def tag_value(text: str) -> str:
    """A value between tags, less the one newline after its opening tag and the one before its closing tag."""
    return text.removeprefix("\n").removesuffix("\n")
