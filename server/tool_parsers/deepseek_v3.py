"""DeepSeek-V3 / R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```
<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; V3.1 writes each call as `NAME<｜tool▁sep｜>{...}`.

The published V3 and R1 templates render calls and tool results in the history but not the tool
list; DeepSeek's model card for V3.1 gives the tool list as a section of the system prompt
(`## Tools`, then each tool's name, description and parameters, then the call format). A template
that does not render `tools` gets that section, with the call format its own history uses."""

from __future__ import annotations

import json
import re

from server.tool_parsers.base import (
    FunctionCall,
    Match,
    ToolParser,
    arguments_rule,
    declared_parameters,
    function_call,
    malformed,
)

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

    @property
    def fenced(self) -> bool:
        """V3 / R1 (the type, the name, fenced JSON) unless the template writes calls as V3.1 does."""
        return "```json" in self.template or SEP not in self.template

    def call_grammar(self, tools: list[dict], name: str | None) -> str | None:
        head = " ".join(self.literal(t) for t in (CALLS_BEGIN, CALL_BEGIN))
        tail = " ".join(self.literal(t) for t in (CALL_END, CALLS_END))
        return f"start: {head} call {tail}\n" + self.call_rules(tools, name, self._call_rule)

    def _call_rule(self, function: dict) -> str:
        arguments = arguments_rule(function)
        if self.fenced:
            opening = json.dumps(f"{function['name']}\n```json\n", ensure_ascii=False)
            return f'"function" {self.literal(SEP)} {opening} {arguments} "\\n```"'
        return f"{json.dumps(function['name'], ensure_ascii=False)} {self.literal(SEP)} {arguments}"

    def prompt_tools(self, tools: list[dict]) -> str | None:
        described = "".join(f"\n### {f['name']}\nDescription: {f.get('description', '')}\n\n"
                            f"Parameters: {json.dumps(declared_parameters(f), ensure_ascii=False)}\n"
                            for f in (tool["function"] for tool in tools))
        call = "function" + SEP + "tool_call_name\n```json\ntool_call_arguments\n```" if self.fenced else \
            "tool_call_name" + SEP + "tool_call_arguments"
        return ("## Tools\nYou have access to the following tools:\n" + described +
                "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
                f"{CALLS_BEGIN}{CALL_BEGIN}{call}{CALL_END}{{{{additional_tool_calls}}}}{CALLS_END}\n\n"
                "Where:\n\n- `tool_call_name` must be an exact match to one of the available tools\n"
                "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
                "- For multiple tool calls, chain them directly without separators or spaces\n")


def _call(body: str) -> FunctionCall | None:
    kind, sep, rest = body.partition(SEP)
    if not sep:
        return None
    fenced = _FENCED.fullmatch(rest)
    if fenced:  # V3: the type before the separator, then the name and fenced JSON
        return function_call(fenced.group(1), fenced.group(2)) if kind.strip() == "function" else None
    return function_call(kind, rest)  # V3.1: the name before the separator
