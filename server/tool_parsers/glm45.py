"""GLM-4.5: `<tool_call>NAME\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n...</tool_call>`.

Values are bare text: a parameter the tool declares as a string stays text, any other is read as
JSON where it parses (numbers, booleans, objects) and kept as text where it does not."""

from __future__ import annotations

import re
from typing import Any

from server.tool_parsers.base import Match, ToolParser, function_call, loads, malformed

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


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
        if not _NAME.fullmatch(name) or _PAIR.sub("", body).strip() != name:  # nothing else in the call
            return malformed(text, end)
        types = self._parameter_types(name)
        arguments = {key.strip(): _value(value, types.get(key.strip())) for key, value in pairs}
        call = function_call(name, arguments)
        return Match(end, (call,)) if call else malformed(text, end)

    def _parameter_types(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            function = tool.get("function", {})
            if function.get("name") == name:
                properties = (function.get("parameters") or {}).get("properties") or {}
                return {key: spec.get("type") for key, spec in properties.items() if isinstance(spec, dict)}
        return {}


def _value(text: str, declared: Any) -> Any:
    if declared == "string":
        return text
    parsed = loads(text.strip())
    return text if parsed is None and text.strip() != "null" else parsed
