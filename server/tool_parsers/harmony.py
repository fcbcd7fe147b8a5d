"""GPT-OSS harmony: the output is a run of messages, `<|channel|>CHANNEL<|message|>BODY<|end|>`, each
after the first opened by `<|start|>assistant`. A call is a message to a function,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (the recipient
may also stand before `<|channel|>`). The `final` channel and commentary without a recipient
(preambles) are content; the `analysis` channel is reasoning and is left out.
`<|call|>` and `<|return|>` end generation, so the last message may have no terminator."""

from __future__ import annotations

import json
import re

from server.tool_parsers.base import Match, ToolParser, arguments_rule, function_call, malformed

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
_TERMINATOR = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")
_RECIPIENT = re.compile(r"\bto=functions\.([A-Za-z0-9_.\-]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


class HarmonyParser(ToolParser):
    name = "harmony"
    markers = (START, CHANNEL)
    needs_special_tokens = True

    def match(self, text: str, final: bool) -> Match | None:
        body_at = text.find(MESSAGE)
        if body_at < 0:
            return malformed(text) if final else None
        terminator = _TERMINATOR.search(text, body_at)
        if terminator is None and not final:
            return None
        end = terminator.end() if terminator else len(text)
        header, body = text[:body_at], text[body_at + len(MESSAGE): terminator.start() if terminator else end]
        if START in header[len(START):] or CHANNEL in header[header.find(CHANNEL) + 1:]:
            return malformed(text, end)  # two headers, no message between them
        recipient, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
        if recipient:
            call = function_call(recipient.group(1), body)
            return Match(end, (call,)) if call else malformed(text, end)
        if channel is not None and channel.group(1) == "analysis":
            return Match(end)
        return Match(end, content=body)

    def call_grammar(self, tools: list[dict], name: str | None) -> str | None:
        """One commentary message to a function; generation ends after it (`<|call|>` is a stop token)."""
        return (f'start: {self.literal(CHANNEL)} "commentary to=functions." call\n' +
                self.call_rules(tools, name, self._call_rule))

    def _call_rule(self, function: dict) -> str:
        recipient = json.dumps(f"{function['name']} ", ensure_ascii=False)
        arguments = arguments_rule(function)
        return f'{recipient} {self.literal(CONSTRAIN)} "json" {self.literal(MESSAGE)} {arguments}'
