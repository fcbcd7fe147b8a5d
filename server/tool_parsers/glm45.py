"""GLM-4.5: `<tool_call>NAME\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n...</tool_call>`.

Values are bare text: a parameter the tool declares as a string stays text, any other is read as
JSON where it parses (numbers, booleans, objects) and kept as text where it does not. A forced
call's grammar writes the declared parameters in the schema's order (the optional ones may be left
out); a string's `enum`, `const`, length bounds and `pattern` are kept, its `format` is not."""

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
KEY, END_KEY, VALUE, END_VALUE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45Parser(BlockParser):
    name = "glm45"
    markers = (OPEN,)
    closing = CLOSE
    needs_special_tokens = True

    def read_block(self, body: str) -> tuple[FunctionCall, ...] | None:
        first = body.find("<arg_key>")
        name = (body if first < 0 else body[:first]).strip()
        pairs = _PAIR.findall(body)
        if not FUNCTION_NAME.fullmatch(name) or _PAIR.sub("", body).strip() != name:  # nothing else in the call
            return None
        types = self.parameter_types(name)
        call = function_call(name, {key.strip(): bare_value(value, types.get(key.strip())) for key, value in pairs})
        return (call,) if call else None

    def call_grammar(self, tools: list[dict], name: str | None) -> str | None:
        return (f"start: {self.literal(OPEN)} call {self.literal(CLOSE)}\n" +
                self.call_rules(tools, name, self._call_rule))

    def _call_rule(self, function: dict) -> str:
        pairs = parameter_rules(function, self._pair_rule)
        return " ".join([json.dumps(function["name"] + "\n", ensure_ascii=False), *pairs])

    def _pair_rule(self, key: str, spec: dict) -> str:
        return (f"{self.literal(KEY)} {json.dumps(key, ensure_ascii=False)} {self.literal(END_KEY)} "
                f'"\\n" {self.literal(VALUE)} {bare_value_rule(spec)} {self.literal(END_VALUE)} "\\n"')

