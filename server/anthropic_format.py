"""Engine events as Anthropic Messages objects: a whole `message`, or its stream of named events
(`message_start`, `content_block_start`/`_delta`/`_stop` per block, `message_delta`, `message_stop`).

The output is read as chat's is (`output_reader`): thinking, text and tool calls come back as
`thinking`, `text` and `tool_use` blocks, in the order the model wrote them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace
from typing import ClassVar

from pydantic import BaseModel
from sse_starlette import ServerSentEvent

from engine.api import GenerationEvent, Usage
from server import anthropic_protocol as a
from server.errors import APIError
from server.reasoning import OutputReader, Reasoning, ReasoningPlan
from server.serving import NamedEvents, Outcome, event_data, output_reader
from server.tool_parsers import ToolCall
from server.tools import ToolPlan

EMPTY_BLOCKS = {"text": lambda: a.TextOut(text=""), "thinking": lambda: a.ThinkingOut(thinking="")}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call: ToolCall) -> str:
    return f"toolu_{call.id.removeprefix('call_')}"


def tool_input(call: ToolCall) -> dict:
    return json.loads(call.arguments)  # the parsers pass on only calls whose arguments are a JSON object


def message_usage(usage: Usage | None) -> a.MessageUsage:
    """Anthropic counts the prompt's tokens read from the cache apart from `input_tokens`."""
    if usage is None:
        return a.MessageUsage()
    return a.MessageUsage(input_tokens=usage.prompt_tokens - usage.cached_tokens,
                          output_tokens=usage.completion_tokens, cache_read_input_tokens=usage.cached_tokens)


def stop_reason(outcome: Outcome, reader: OutputReader | None) -> a.StopInfo:
    if outcome.finish_reason == "length":
        return a.StopInfo(stop_reason="max_tokens")
    if outcome.stop_sequence is not None:
        return a.StopInfo(stop_reason="stop_sequence", stop_sequence=outcome.stop_sequence)
    return a.StopInfo(stop_reason="tool_use" if reader is not None and reader.tool_calls else "end_turn")


def content_blocks(pieces: list) -> list[a.ContentOut]:
    """A whole output's pieces as blocks: consecutive text (or thinking) is one block."""
    blocks: list[a.ContentOut] = []
    for piece in pieces:
        last = blocks[-1] if blocks else None
        if isinstance(piece, Reasoning):
            if isinstance(last, a.ThinkingOut):
                last.thinking += piece.text
            else:
                blocks.append(a.ThinkingOut(thinking=piece.text))
        elif isinstance(piece, str):
            if isinstance(last, a.TextOut):
                last.text += piece
            elif piece:
                blocks.append(a.TextOut(text=piece))
        else:
            blocks.append(a.ToolUseOut(id=tool_use_id(piece), name=piece.name, input=tool_input(piece)))
    return blocks


class BlockEvents:
    """A streamed output's pieces as block events: a block opens when the kind of piece changes."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "text" or "thinking"; a tool_use block opens and closes at once

    def of(self, pieces: list) -> list[BaseModel]:
        events: list[BaseModel] = []
        for piece in pieces:
            if isinstance(piece, Reasoning):
                events += self._into("thinking", a.ThinkingDelta(thinking=piece.text))
            elif isinstance(piece, str):
                events += self._into("text", a.TextDelta(text=piece)) if piece else []
            else:
                events += self._tool_use(piece)
        return events

    def close(self) -> list[BaseModel]:
        if self.open is None:
            return []
        self.open = None
        return [a.ContentBlockStop(index=self.index)]

    def _start(self, block: a.ContentOut) -> list[BaseModel]:
        events = self.close()
        self.index += 1
        return events + [a.ContentBlockStart(index=self.index, content_block=block)]

    def _into(self, kind: str, delta: a.TextDelta | a.ThinkingDelta) -> list[BaseModel]:
        events = []
        if self.open != kind:
            events = self._start(EMPTY_BLOCKS[kind]())
            self.open = kind
        return events + [a.ContentBlockDelta(index=self.index, delta=delta)]

    def _tool_use(self, call: ToolCall) -> list[BaseModel]:
        events = self._start(a.ToolUseOut(id=tool_use_id(call), name=call.name, input={}))
        return events + [a.ContentBlockDelta(index=self.index, delta=a.InputJsonDelta(partial_json=call.arguments)),
                         a.ContentBlockStop(index=self.index)]


@dataclass
class MessagesFormat(NamedEvents):
    """The `Format` (server/serving.py) of `/v1/messages`: one choice; a stream ends with `message_stop`."""

    prompt_param: ClassVar[str] = "messages"
    model: str
    prompt_tokens: int  # for `message_start`: what the prefix cache held is known only at the end
    tool_plan: ToolPlan = field(default_factory=ToolPlan)
    reasoning_plan: ReasoningPlan = field(default_factory=ReasoningPlan)
    id: str = field(default_factory=message_id)

    def __post_init__(self) -> None:
        self._reader = output_reader(self.tool_plan, self.reasoning_plan)
        self._blocks = BlockEvents()

    def choice(self, index: int) -> MessagesFormat:
        return replace(self)  # its own reader and blocks

    def outcome(self) -> Outcome:
        return Outcome()

    def _message(self, content: list[a.ContentOut], stop: a.StopInfo, usage: a.MessageUsage) -> a.Message:
        return a.Message(id=self.id, model=self.model, content=content, stop_reason=stop.stop_reason,
                         stop_sequence=stop.stop_sequence, usage=usage)

    def opening(self) -> list[BaseModel]:
        usage = a.MessageUsage(input_tokens=self.prompt_tokens)
        return [a.MessageStart(message=self._message([], a.StopInfo(), usage))]

    def delta(self, event: GenerationEvent, offset: int) -> list[BaseModel]:
        return self._blocks.of(self._reader.feed(event.text) if self._reader else [event.text])

    def finish(self, outcome: Outcome) -> list[BaseModel]:
        rest = self._blocks.of(self._reader.finish()) if self._reader else []
        ending = a.MessageDelta(delta=stop_reason(outcome, self._reader), usage=message_usage(outcome.usage))
        return rest + self._blocks.close() + [ending, a.MessageStop()]

    def usage(self, outcomes: list[Outcome]) -> BaseModel:
        return message_usage(outcomes[0].usage)  # not asked for: `message_delta` carries it

    def response(self, outcomes: list[Outcome]) -> BaseModel:
        (outcome,) = outcomes
        reader = output_reader(self.tool_plan, self.reasoning_plan)
        pieces = reader.feed(outcome.text) + reader.finish() if reader else [outcome.text]
        return self._message(content_blocks(pieces), stop_reason(outcome, reader), message_usage(outcome.usage))

    def error_event(self, error: APIError) -> ServerSentEvent:
        return ServerSentEvent(data=event_data(error.anthropic_body()), event="error")
