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
    Match,
    ToolParser,
    bare_value,
    bare_value_rule,
    function_call,
    malformed,
    parameter_rules,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, END_KEY, VALUE, END_VALUE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45Parser(ToolParser):
    name = "glm45"
    markers = (OPEN,)
    needs_special_tokens = True

    def match(self, text: str, final: bool) -> Match | None:
        close = text.find(CLOSE)
        if close < 0:
            return malformed(text) if final else None
        end = close + len(CLOSE)
        body = text[len(OPEN): close]
        first = body.find("<arg_key>")
        name = (body if first < 0 else body[:first]).strip()
        pairs = _PAIR.findall(body)
        if not FUNCTION_NAME.fullmatch(name) or _PAIR.sub("", body).strip() != name:  # nothing else in the call
            return malformed(text, end)
        types = self.parameter_types(name)
        arguments = {key.strip(): bare_value(value, types.get(key.strip())) for key, value in pairs}
        call = function_call(name, arguments)
        return Match(end, (call,)) if call else malformed(text, end)

    def call_grammar(self, tools: list[dict], name: str | None) -> str | None:
        return (f"start: {self.literal(OPEN)} call {self.literal(CLOSE)}\n" +
                self.call_rules(tools, name, self._call_rule))

    def _call_rule(self, function: dict) -> str:
        pairs = parameter_rules(function, self._pair_rule)
        return " ".join([json.dumps(function["name"] + "\n", ensure_ascii=False), *pairs])

    def _pair_rule(self, key: str, spec: dict) -> str:
        return (f"{self.literal(KEY)} {json.dumps(key, ensure_ascii=False)} {self.literal(END_KEY)} "
                f'"\\n" {self.literal(VALUE)} {bare_value_rule(spec)} {self.literal(END_VALUE)} "\\n"')

