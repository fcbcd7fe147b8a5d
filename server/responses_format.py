"""`ResponsesFormat`: engine events as the Responses API's output items and stream events.

The model's text is read by the same `OutputReader` as chat (reasoning, answer text, tool calls); an
`OutputBuilder` turns its pieces into output items (reasoning, message, function_call), with the
events that build them as a stream. A whole response goes through the same builder, so streamed and
whole responses agree. The stream ends with `response.completed` (or `response.incomplete`) carrying
the whole response and its usage; no `[DONE]`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from pydantic import BaseModel
from sse_starlette import ServerSentEvent

from engine.api import GenerationEvent
from server import responses_protocol as rp
from server.errors import APIError
from server.reasoning import OutputReader, Reasoning, ReasoningPlan
from server.responses_tools import ResponseTools
from server.serving import NamedEvents, Outcome, output_reader, usage_info
from server.tool_parsers import ToolCall
from server.tools import ToolPlan


class OutputBuilder:
    """Output items built from an `OutputReader`'s pieces, and the stream events that build them."""

    def __init__(self, sequence: Callable[[], int], tools: ResponseTools) -> None:
        self.items: list[rp.OutputItem] = []
        self._sequence = sequence
        self._tools = tools  # what a parsed call becomes
        self._open: rp.MessageItem | rp.ReasoningItem | None = None  # the item text is streaming into

    def add(self, pieces: list) -> list[rp.StreamEvent]:
        events: list[rp.StreamEvent] = []
        for piece in pieces:
            if isinstance(piece, Reasoning):
                events += self._text(piece.text, rp.ReasoningItem)
            elif isinstance(piece, ToolCall):
                events += self._call(piece)
            else:
                events += self._text(piece, rp.MessageItem)
        return events

    def close(self, cut: bool = False) -> list[rp.StreamEvent]:
        """The last item ended (`cut`: by the token limit); an output with no item gets an empty message."""
        events = [] if self.items else self._start(rp.MessageItem())
        return events + self._close("incomplete" if cut else "completed")

    def _text(self, text: str, kind: type[rp.MessageItem] | type[rp.ReasoningItem]) -> list[rp.StreamEvent]:
        if not text:
            return []
        events = [] if isinstance(self._open, kind) else self._close() + self._start(kind())
        item = self._open
        part = item.content[0]
        part.text += text
        delta = rp.TextDeltaEvent if kind is rp.MessageItem else rp.ReasoningDeltaEvent
        return events + [delta(type=_delta_type(item), sequence_number=self._sequence(), item_id=item.id,
                               output_index=self._last, content_index=0, delta=text)]

    def _start(self, item: rp.MessageItem | rp.ReasoningItem) -> list[rp.StreamEvent]:
        self.items.append(item)
        self._open = item
        part = rp.OutputText() if isinstance(item, rp.MessageItem) else rp.ReasoningText()
        added = self._item_event("response.output_item.added", item)
        item.content.append(part)
        return [added, self._part_event("response.content_part.added", item, part)]

    def _close(self, status: str = "completed") -> list[rp.StreamEvent]:
        item, self._open = self._open, None
        if item is None:
            return []
        part = item.content[0]
        done = rp.TextDoneEvent if isinstance(item, rp.MessageItem) else rp.ReasoningDoneEvent
        events = [done(type=_delta_type(item).replace(".delta", ".done"), sequence_number=self._sequence(),
                       item_id=item.id, output_index=self._last, content_index=0, text=part.text),
                  self._part_event("response.content_part.done", item, part)]
        if isinstance(item, rp.MessageItem):
            item.status = status
        return events + [self._item_event("response.output_item.done", item)]

    def _call(self, call: ToolCall) -> list[rp.StreamEvent]:
        """A whole call: its item added as it starts (no input yet), its input at once, the item done."""
        events = self._close()
        item = self._tools.output_item(call)
        custom = isinstance(item, rp.CustomToolCallItem)
        self.items.append(item)
        started = item.model_copy(update={"input": ""} if custom else {"arguments": "", "status": "in_progress"})
        events.append(rp.ItemEvent(type="response.output_item.added", sequence_number=self._sequence(),
                                   output_index=self._last, item=started))
        if custom:
            events += [rp.CustomInputDeltaEvent(type="response.custom_tool_call_input.delta",
                                                sequence_number=self._sequence(), item_id=item.id,
                                                output_index=self._last, delta=item.input),
                       rp.CustomInputDoneEvent(type="response.custom_tool_call_input.done",
                                               sequence_number=self._sequence(), item_id=item.id,
                                               output_index=self._last, input=item.input)]
        else:
            events += [rp.ArgumentsDeltaEvent(type="response.function_call_arguments.delta",
                                              sequence_number=self._sequence(), item_id=item.id,
                                              output_index=self._last, delta=item.arguments),
                       rp.ArgumentsDoneEvent(type="response.function_call_arguments.done",
                                             sequence_number=self._sequence(), item_id=item.id,
                                             output_index=self._last, name=item.name, arguments=item.arguments)]
        return events + [self._item_event("response.output_item.done", item)]

    @property
    def _last(self) -> int:
        """The output index of the item being built: always the last one."""
        return len(self.items) - 1

    def _item_event(self, kind: str, item: rp.OutputItem) -> rp.ItemEvent:
        # a copy: the item grows after this event is made, the event shows it as it was
        return rp.ItemEvent(type=kind, sequence_number=self._sequence(), output_index=self._last,
                            item=item.model_copy(deep=True))

    def _part_event(self, kind: str, item: rp.MessageItem | rp.ReasoningItem,
                    part: rp.OutputText | rp.ReasoningText) -> rp.ContentPartEvent:
        return rp.ContentPartEvent(type=kind, sequence_number=self._sequence(), item_id=item.id,
                                   output_index=self._last, content_index=0,
                                   part=part.model_copy(deep=True))


def _delta_type(item: rp.MessageItem | rp.ReasoningItem) -> str:
    return "response.output_text.delta" if isinstance(item, rp.MessageItem) else "response.reasoning_text.delta"


@dataclass
class ResponsesFormat(NamedEvents):
    """One response (the Responses API has no `n`). `shell`: the response object as created (its id,
    model and the request's settings); `on_done` sees the finished response (to store it)."""

    prompt_param: ClassVar[str] = "input"
    shell: rp.ResponseObject
    tool_plan: ToolPlan = field(default_factory=ToolPlan)
    reasoning_plan: ReasoningPlan = field(default_factory=ReasoningPlan)
    tools: ResponseTools = field(default_factory=ResponseTools)  # the request's, for the calls' items
    on_done: Callable[[rp.ResponseObject], None] | None = None

    def __post_init__(self) -> None:
        self._sequence = itertools.count()
        self._reader = self._new_reader()
        self._builder = OutputBuilder(self._next, self.tools)

    @property
    def id(self) -> str:
        return self.shell.id

    def _next(self) -> int:
        return next(self._sequence)

    def _new_reader(self) -> OutputReader | None:
        return output_reader(self.tool_plan, self.reasoning_plan)

    def choice(self, index: int) -> ResponsesFormat:
        return self  # always one generation

    def outcome(self) -> Outcome:
        return Outcome(reasoning=self.reasoning_plan.token_counter())

    def opening(self) -> list[BaseModel]:
        return [rp.ResponseEvent(type=kind, sequence_number=self._next(), response=self.shell.model_copy(deep=True))
                for kind in ("response.created", "response.in_progress")]

    def delta(self, event: GenerationEvent, offset: int) -> list[BaseModel]:
        return self._builder.add(self._reader.feed(event.text) if self._reader else [event.text])

    def finish(self, outcome: Outcome) -> list[BaseModel]:
        cut = outcome.finish_reason == "length"
        events = self._builder.add(self._reader.finish() if self._reader else []) + self._builder.close(cut)
        response = self._done(self._builder.items, outcome)
        kind = "response.incomplete" if cut else "response.completed"
        return events + [rp.ResponseEvent(type=kind, sequence_number=self._next(), response=response)]

    def usage(self, outcomes: list[Outcome]) -> BaseModel:
        return self._finished(self._builder.items, outcomes[0])  # unused: the final event carries the usage

    def response(self, outcomes: list[Outcome]) -> BaseModel:
        (outcome,) = outcomes
        builder, reader = OutputBuilder(lambda: 0, self.tools), self._new_reader()
        builder.add(reader.feed(outcome.text) + reader.finish() if reader else [outcome.text])
        builder.close(outcome.finish_reason == "length")
        return self._done(builder.items, outcome)

    def error_event(self, error: APIError) -> ServerSentEvent:
        return self.event(rp.ErrorEvent(type="error", sequence_number=self._next(), code=error.code,
                                        message=error.message, param=error.param))

    def _done(self, items: list[rp.OutputItem], outcome: Outcome) -> rp.ResponseObject:
        response = self._finished(items, outcome)
        if self.on_done is not None:
            self.on_done(response)
        return response

    def _finished(self, items: list[rp.OutputItem], outcome: Outcome) -> rp.ResponseObject:
        usage = usage_info([outcome])
        details = usage.completion_tokens_details
        cut = outcome.finish_reason == "length"
        return self.shell.model_copy(update={
            "status": "incomplete" if cut else "completed",
            "output": items,
            "incomplete_details": rp.IncompleteDetails(reason="max_output_tokens") if cut else None,
            "usage": rp.ResponseUsage(
                input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                total_tokens=usage.total_tokens,
                input_tokens_details=rp.InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
                output_tokens_details=rp.OutputTokensDetails(reasoning_tokens=details.reasoning_tokens if details else 0)),
        })
