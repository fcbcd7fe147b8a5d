"""DeepSeek-V3 / R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```
<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; V3.1 writes each call as `NAME<｜tool▁sep｜>{...}`."""

from __future__ import annotations

import re

from server.tool_parsers.base import FunctionCall, Match, ToolParser, function_call, malformed

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
_FENCED = re.compile(r"\s*(\S+)\s*\n```(?:json)?\s*\n(.*?)\n?```\s*", re.DOTALL)


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    markers = (CALLS_BEGIN,)

    def match(self, text: str, final: bool) -> Match | None:
        close = text.find(CALLS_END)
        if close < 0 and not final:
            return None
        end = len(text) if close < 0 else close + len(CALLS_END)
        section = text[len(CALLS_BEGIN): close if close >= 0 else len(text)]
        bodies = _CALL.findall(section)
        calls = [_call(body) for body in bodies]
        leftover = _CALL.sub("", section).strip()
        if not calls or None in calls or leftover:
            return malformed(text, end)
        return Match(end, tuple(calls))


def _call(body: str) -> FunctionCall | None:
    kind, sep, rest = body.partition(SEP)
    if not sep:
        return None
    fenced = _FENCED.fullmatch(rest)
    if fenced:  # V3: the type before the separator, then the name and fenced JSON
        return function_call(fenced.group(1), fenced.group(2)) if kind.strip() == "function" else None
    return function_call(kind, rest)  # V3.1: the name before the separator
