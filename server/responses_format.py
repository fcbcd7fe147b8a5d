"""`ResponsesFormat`: engine events as the Responses API's output items and stream events.

The model's text is read by the same `OutputReader` as chat (reasoning, answer text, tool calls); an
`OutputBuilder` turns its pieces into output items (reasoning, message, function_call), with the
events that build them as a stream. A whole response goes through the same builder, so streamed and
whole responses agree. The stream ends with `response.completed` (or `response.incomplete`) carrying
the whole response and its usage; no `[DONE]`.

With `include: ["message.output_text.logprobs"]`, an `output_text` carries the logprobs of the tokens of
its text (`AnswerReader`): the tokens of reasoning (by usage's `reasoning_tokens` rule) and of tool calls
are left out (chat completions puts every generated token in `logprobs.content`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from pydantic import BaseModel
from sse_starlette import ServerSentEvent

from engine.api import GenerationEvent, TokenLogprob
from server import protocol as p
from server import responses_protocol as rp
from server.errors import APIError
from server.reasoning import OutputReader, Reasoning, ReasoningPlan
from server.responses_tools import ResponseTools
from server.serving import NamedEvents, Outcome, output_reader, usage_info
from server.tool_parsers import ToolCall
from server.tools import ToolPlan

Read = list[tuple[str | Reasoning | ToolCall, list[TokenLogprob]]]  # each piece, with its answer tokens


class AnswerReader:
    """An `OutputReader` (None: all answer) that also tells which generated tokens are the answer text's.

    A token's text is fed in the step that generated it (tokens held back for a stop string share their
    step's start). A token is the answer's when its text starts after the reasoning (as usage counts
    reasoning tokens, markers included) and comes out as answer text; the tokens that came out as a tool
    call are left out. Tokens whose text is held back wait for the piece it comes out as; those left at
    the end (an end-of-sequence token) belong to the answer text they follow."""

    def __init__(self, reader: OutputReader | None) -> None:
        self._reader = reader
        self._pending: list[tuple[int, TokenLogprob]] = []  # (where its text starts, the token)
        self._fed = 0

    def feed(self, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> Read:
        self._pending += [(self._fed, lp) for lp in logprobs]
        self._fed += len(text)
        return self._sort(self._reader.feed(text) if self._reader else [text] if text else [])

    def finish(self) -> Read:
        read = self._sort(self._reader.finish() if self._reader else [])
        return read + ([("", self._take())] if self._pending else [])

    def _sort(self, pieces: list) -> Read:
        end = self._reader.reasoning.reasoning_end if self._reader and self._reader.reasoning else None
        if end is not None:
            self._pending = [(start, lp) for start, lp in self._pending if start >= end]
        read: Read = []
        for piece in pieces:
            if isinstance(piece, str):
                read.append((piece, self._take()))
            else:  # thinking or a tool call: the tokens read so far were its
                self._pending = []
                read.append((piece, []))
        return read

    def _take(self) -> list[TokenLogprob]:
        taken, self._pending = [lp for _, lp in self._pending], []
        return taken


@dataclass
class StepOutcome(Outcome):
    """An outcome that keeps each step's text and logprobs: a whole response reads them as a stream does."""

    steps: list[tuple[str, tuple[TokenLogprob, ...]]] = field(default_factory=list)

    def add(self, event: GenerationEvent) -> None:
        super().add(event)
        self.steps.append((event.text, event.logprobs))


class OutputBuilder:
    """Output items built from an `OutputReader`'s pieces, and the stream events that build them."""

    def __init__(self, sequence: Callable[[], int], tools: ResponseTools) -> None:
        self.items: list[rp.OutputItem] = []
        self._sequence = sequence
        self._tools = tools  # what a parsed call becomes
        self._open: rp.MessageItem | rp.ReasoningItem | None = None  # the item text is streaming into

    def add(self, read: Read) -> list[rp.StreamEvent]:
        events: list[rp.StreamEvent] = []
        for piece, logprobs in read:
            if isinstance(piece, Reasoning):
                events += self._text(piece.text, rp.ReasoningItem)
            elif isinstance(piece, ToolCall):
                events += self._call(piece)
            else:
                events += self._text(piece, rp.MessageItem, [p.ChatLogprobToken.of(lp) for lp in logprobs])
        return events

    def close(self, cut: bool = False) -> list[rp.StreamEvent]:
        """The last item ended (`cut`: by the token limit); an output with no item gets an empty message."""
        events = [] if self.items else self._start(rp.MessageItem())
        return events + self._close("incomplete" if cut else "completed")

    def _text(self, text: str, kind: type[rp.MessageItem] | type[rp.ReasoningItem],
              logprobs: list[p.ChatLogprobToken] | None = None) -> list[rp.StreamEvent]:
        # tokens with no text of their own (end of sequence) join the answer text they follow, if any
        if not text and not (logprobs and isinstance(self._open, kind)):
            return []
        events = [] if isinstance(self._open, kind) else self._close() + self._start(kind())
        item = self._open
        part = item.content[0]
        part.text += text
        if kind is rp.ReasoningItem:
            return events + [rp.ReasoningDeltaEvent(type=_delta_type(item), sequence_number=self._sequence(),
                                                    item_id=item.id, output_index=self._last, content_index=0,
                                                    delta=text)]
        part.logprobs += logprobs or []
        return events + [rp.TextDeltaEvent(type=_delta_type(item), sequence_number=self._sequence(),
                                           item_id=item.id, output_index=self._last, content_index=0, delta=text,
                                           logprobs=logprobs or [])]

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
        done_type = _delta_type(item).replace(".delta", ".done")
        if isinstance(item, rp.MessageItem):
            done = rp.TextDoneEvent(type=done_type, sequence_number=self._sequence(), item_id=item.id,
                                    output_index=self._last, content_index=0, text=part.text,
                                    logprobs=list(part.logprobs))
        else:
            done = rp.ReasoningDoneEvent(type=done_type, sequence_number=self._sequence(), item_id=item.id,
                                         output_index=self._last, content_index=0, text=part.text)
        events = [done, self._part_event("response.content_part.done", item, part)]
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
    want_logprobs: bool = False  # `include: ["message.output_text.logprobs"]`

    def __post_init__(self) -> None:
        self._sequence = itertools.count()
        self._reader = self._new_reader()
        self._builder = OutputBuilder(self._next, self.tools)

    @property
    def id(self) -> str:
        return self.shell.id

    def _next(self) -> int:
        return next(self._sequence)

    def _new_reader(self) -> AnswerReader:
        return AnswerReader(output_reader(self.tool_plan, self.reasoning_plan))

    def _logprobs(self, logprobs: tuple[TokenLogprob, ...]) -> tuple[TokenLogprob, ...]:
        return logprobs if self.want_logprobs else ()  # also computed for `top_logprobs` alone: not shown

    def choice(self, index: int) -> ResponsesFormat:
        return self  # always one generation

    def outcome(self) -> StepOutcome:
        return StepOutcome(reasoning=self.reasoning_plan.token_counter())

    def opening(self) -> list[BaseModel]:
        return [rp.ResponseEvent(type=kind, sequence_number=self._next(), response=self.shell.model_copy(deep=True))
                for kind in ("response.created", "response.in_progress")]

    def delta(self, event: GenerationEvent, offset: int) -> list[BaseModel]:
        return self._builder.add(self._reader.feed(event.text, self._logprobs(event.logprobs)))

    def finish(self, outcome: Outcome) -> list[BaseModel]:
        cut = outcome.finish_reason == "length"
        events = self._builder.add(self._reader.finish()) + self._builder.close(cut)
        response = self._done(self._builder.items, outcome)
        kind = "response.incomplete" if cut else "response.completed"
        return events + [rp.ResponseEvent(type=kind, sequence_number=self._next(), response=response)]

    def usage(self, outcomes: list[Outcome]) -> BaseModel:
        return self._finished(self._builder.items, outcomes[0])  # unused: the final event carries the usage

    def response(self, outcomes: list[Outcome]) -> BaseModel:
        (outcome,) = outcomes
        builder, reader = OutputBuilder(lambda: 0, self.tools), self._new_reader()
        for text, logprobs in outcome.steps:
            builder.add(reader.feed(text, self._logprobs(logprobs)))
        builder.add(reader.finish())
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
