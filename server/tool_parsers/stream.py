"""Generated text → content and tool calls, as it arrives.

Text that may still become a tool call (from a marker on, or a tail that could begin one) is
held back until the parser decides, so content is never shown and then retracted; a call is
released only whole and valid, so a client never receives one it must throw away. The same
object reads a finished output at once (non-streamed responses), so both agree exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from server.tool_parsers.base import Match, ToolParser

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    index: int  # position among the calls of this response
    id: str
    name: str
    arguments: str


Piece = str | ToolCall  # content text or one call


class ToolCallStream:
    def __init__(self, parser: ToolParser, allowed_names: frozenset[str], max_calls: int | None = None) -> None:
        self.parser, self.allowed_names, self.max_calls = parser, allowed_names, max_calls
        self.calls: list[ToolCall] = []
        self._buffer = ""  # not decided yet
        self._space = ""  # trailing blanks of the content: dropped next to a call
        self._after_call = False

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Piece]:
        out = self._drain(final=True)
        if not self.calls and self._space:
            out.append(self._space)
        self._space = ""
        return out

    def _drain(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            start = first_marker(self._buffer, self.parser.markers)
            if start is None:
                keep = 0 if final else partial_marker(self._buffer, self.parser.markers)
                self._content(self._buffer[: len(self._buffer) - keep], out)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return _joined(out)
            self._content(self._buffer[:start], out)
            self._buffer = self._buffer[start:]
            match = self.parser.match(self._buffer, final)
            if match is None:
                return _joined(out)
            self._accept(match, self._buffer[: match.end], out)
            self._buffer = self._buffer[match.end:]

    def _accept(self, match: Match, span: str, out: list[Piece]) -> None:
        unknown = [c.name for c in match.calls if c.name not in self.allowed_names]
        if unknown:  # OpenAI's contract: only the functions offered
            log.info("tool call to unknown function(s) %s kept as text", ", ".join(unknown))
            self._content(span, out)
            return
        self._content(match.content, out)
        for call in match.calls:
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                log.info("dropped tool call %s: parallel_tool_calls is false", call.name)
                continue
            taken = {c.id for c in self.calls}  # a model's own id (Kimi's) is kept unless it repeats one
            call_id = call.id if call.id and call.id not in taken else self.parser.new_call_id()
            self.calls.append(ToolCall(len(self.calls), call_id, call.name, call.arguments))
            out.append(self.calls[-1])
            self._space, self._after_call = "", True

    def _content(self, text: str, out: list[Piece]) -> None:
        if self._after_call:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._space += text
            return
        out.append(self._space + body)
        self._space, self._after_call = text[len(body):], False


def first_marker(text: str, markers: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    return min(found) if found else None


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a marker."""
    return max((n for m in markers for n in range(1, min(len(m), len(text) + 1)) if text.endswith(m[:n])),
               default=0)


def _joined(pieces: list[Piece]) -> list[Piece]:
    """Adjacent content pieces as one."""
    out: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, str) and out and isinstance(out[-1], str):
            out[-1] += piece
        else:
            out.append(piece)
    return out
