"""MiniMax-M2 / M2.1: `<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="k">v</parameter>\n
</invoke>\n...</minimax:tool_call>`, every invoke of a block a call.

Values are bare, as Qwen3-Coder's: a declared string stays text, any other is JSON where it parses."""

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
from server.tool_parsers.qwen3_coder import tag_value

OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
_INVOKE = re.compile(r'<invoke name=("?)([^">\n]*)\1\s*>(.*?)</invoke>', re.DOTALL)
_PARAMETER = re.compile(r'<parameter name=("?)([^">\n]*)\1\s*>(.*?)</parameter>', re.DOTALL)


class MiniMaxM2Parser(BlockParser):
    name = "minimax_m2"
    markers = (OPEN,)
    closing = CLOSE
    needs_special_tokens = True

    def read_block(self, body: str) -> tuple[FunctionCall, ...] | None:
        calls = [self._call(name.strip(), invoke) for _, name, invoke in _INVOKE.findall(body)]
        if not calls or None in calls or _INVOKE.sub("", body).strip():
            return None
        return tuple(calls)

    def _call(self, name: str, body: str) -> FunctionCall | None:
        if not FUNCTION_NAME.fullmatch(name) or _PARAMETER.sub("", body).strip():
            return None
        types = self.parameter_types(name)
        return function_call(name, {key.strip(): bare_value(tag_value(value), types.get(key.strip()))
                                    for _, key, value in _PARAMETER.findall(body)})

    def call_grammar(self, tools: list[dict], name: str | None) -> str | None:
        return (f'start: {self.literal(OPEN)} "\\n" call {self.literal(CLOSE)}\n' +
                self.call_rules(tools, name, self._call_rule))

    def _call_rule(self, function: dict) -> str:
        opening = json.dumps('<invoke name="' + function["name"] + '">\n', ensure_ascii=False)
        return " ".join([opening, *parameter_rules(function, _pair_rule), '"</invoke>\\n"'])


def _pair_rule(key: str, spec: dict) -> str:
    opening = json.dumps('<parameter name="' + key + '">', ensure_ascii=False)
    return f'{opening} {bare_value_rule(spec)} "</parameter>\\n"'
