"""GPT-OSS harmony: the output is a run of messages, `<|channel|>CHANNEL<|message|>BODY<|end|>`, each
after the first opened by `<|start|>assistant`. A call is a message to a function,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (the recipient
may also stand before `<|channel|>`). The `final` channel and commentary without a recipient
(preambles) are content; the `analysis` channel is reasoning and is left out.
`<|call|>` and `<|return|>` end generation, so the last message may have no terminator."""

from __future__ import annotations

import re

from server.tool_parsers.base import Match, ToolParser, function_call, malformed

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
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
