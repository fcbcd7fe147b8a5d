"""Runs one OpenAI request through the engine: streamed as SSE or collected into one response.

`Submission` hands the request to the `EngineClient`; `ChatFormat` and `CompletionFormat`
turn engine events into OpenAI objects; `Serving` drives the two and records metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sse_starlette import EventSourceResponse

from engine.api import (
    ContextLengthError,
    EngineUnavailableError,
    GenerationEvent,
    GenerationRequest,
    TokenLogprob,
    Usage,
)
from server import protocol as p
from server.errors import APIError, to_api_error
from server.metrics import ABORTED, ERROR, OK, ServerMetrics
from server.reasoning import OutputReader, Reasoning, ReasoningPlan
from server.scheduling import Scheduler, Ticket
from server.tool_parsers import ToolCall
from server.tools import ToolPlan

log = logging.getLogger(__name__)

CLIENT_CLOSED_STATUS = 499  # nobody reads it: the client has gone
CLEANUP_TIMEOUT_S = 5
SHUTDOWN_GRACE_S = 3  # after the drain: for aborted streams to end with an error event and [DONE]
DRAIN_TIMEOUT_S = 20.0  # on shutdown, what running requests get to finish (--drain-timeout)
DRAIN_POLL_S = 0.1


class Submission:
    """A request handed to the engine: validated and queued, its events not read yet."""

    def __init__(self, client, request: GenerationRequest) -> None:
        self.client, self.request, self.request_id = client, request, request.request_id
        self._events = client.generate(request)
        self._first = asyncio.ensure_future(_next(self._events))

    @classmethod
    async def start(cls, client, request: GenerationRequest) -> Submission:
        """Raises the engine's refusals (400, 503) before any byte of the response is sent."""
        submission = cls(client, request)
        await asyncio.sleep(0)  # generate() validates and enqueues before its first suspension
        if submission._first.done() and submission._first.exception() is not None:
            raise submission._first.exception()
        return submission

    async def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        event = await self._first
        while event is not None:
            yield event
            event = await _next(self._events)

    def abort(self) -> None:
        """Stops the request: a running one within a decode step, a queued one never starts."""
        self.client.abort(self.request_id)
        self._first.cancel()

    async def close(self) -> None:
        self.abort()
        with anyio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):  # also when the caller is cancelled
            await asyncio.wait({self._first})
            try:
                await self._events.aclose()
            except RuntimeError:  # still running in a task being cancelled: it aborts itself
                pass


async def _next(events: AsyncIterator[GenerationEvent]) -> GenerationEvent | None:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


@dataclass
class Outcome:
    """What a finished request produced, collected from its events."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None

    def add(self, event: GenerationEvent) -> None:
        self.text += event.text
        self.logprobs.extend(event.logprobs)
        if event.finish_reason is not None:
            self.finish_reason, self.usage = event.finish_reason, event.usage


def usage_info(usage: Usage | None) -> p.UsageInfo:
    if usage is None:
        return p.UsageInfo()
    return p.UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                       total_tokens=usage.total_tokens)


@dataclass
class ChatFormat:
    prompt_param = "messages"  # the request field that holds the prompt (not a dataclass field)
    model: str
    fingerprint: str
    want_logprobs: bool
    id: str = field(default_factory=lambda: p.random_id("chatcmpl"))
    created: int = field(default_factory=p.now)
    tool_plan: ToolPlan = field(default_factory=ToolPlan)
    reasoning_plan: ReasoningPlan = field(default_factory=ReasoningPlan)

    def __post_init__(self) -> None:
        self._reader = self._new_reader()  # reads reasoning and tool calls out of the streamed text

    def _new_reader(self) -> OutputReader | None:
        reasoning, calls = self.reasoning_plan.stream(), self.tool_plan.stream()
        return OutputReader(reasoning, calls) if reasoning is not None or calls is not None else None

    def _chunk(self, delta: p.DeltaMessage, logprobs=None, finish_reason=None) -> p.ChatCompletionStreamResponse:
        choice = p.ChatCompletionStreamChoice(index=0, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        return p.ChatCompletionStreamResponse(id=self.id, created=self.created, model=self.model,
                                              system_fingerprint=self.fingerprint, choices=[choice])

    def opening(self) -> list[BaseModel]:
        return [self._chunk(p.DeltaMessage(role="assistant", content=""))]

    def delta(self, event: GenerationEvent, offset: int) -> list[BaseModel]:
        logprobs = p.ChatChoiceLogprobs.of(list(event.logprobs)) if self.want_logprobs else None
        if self._reader is None:
            return [self._chunk(p.DeltaMessage(content=event.text), logprobs)]
        return self._piece_chunks(self._reader.feed(event.text), logprobs)

    def finish(self, finish_reason: str) -> list[BaseModel]:
        rest = self._piece_chunks(self._reader.finish(), None) if self._reader else []
        return rest + [self._chunk(p.DeltaMessage(), finish_reason=_finish_reason(finish_reason, self._reader))]

    def _piece_chunks(self, pieces: list, logprobs) -> list[BaseModel]:
        chunks: list[BaseModel] = []
        for piece in pieces:
            if isinstance(piece, str):
                chunks.append(self._chunk(p.DeltaMessage(content=piece), logprobs))
                logprobs = None
            elif isinstance(piece, Reasoning):
                chunks.append(self._chunk(p.DeltaMessage(reasoning_content=piece.text, reasoning=piece.text), logprobs))
                logprobs = None
            else:
                chunks += [self._chunk(p.DeltaMessage(tool_calls=[delta])) for delta in _call_deltas(piece)]
        if logprobs is not None:  # the tokens of text held back: their logprobs go out now
            chunks.append(self._chunk(p.DeltaMessage(), logprobs))
        return chunks

    def usage(self, usage: Usage | None) -> BaseModel:
        return p.ChatCompletionStreamResponse(id=self.id, created=self.created, model=self.model,
                                              system_fingerprint=self.fingerprint, choices=[],
                                              usage=usage_info(usage))

    def response(self, outcome: Outcome) -> BaseModel:
        logprobs = p.ChatChoiceLogprobs.of(outcome.logprobs) if self.want_logprobs else None
        reader = self._new_reader()
        choice = p.ChatCompletionChoice(index=0, message=_message(outcome.text, reader), logprobs=logprobs,
                                        finish_reason=_finish_reason(outcome.finish_reason, reader))
        return p.ChatCompletionResponse(id=self.id, created=self.created, model=self.model,
                                        system_fingerprint=self.fingerprint, choices=[choice],
                                        usage=usage_info(outcome.usage))


def _call_deltas(call: ToolCall) -> list[p.DeltaToolCall]:
    """A call as OpenAI streams one: id, type and name first, then the arguments."""
    return [
        p.DeltaToolCall(index=call.index, id=call.id, type="function",
                        function=p.DeltaFunctionCall(name=call.name, arguments="")),
        p.DeltaToolCall(index=call.index, function=p.DeltaFunctionCall(arguments=call.arguments)),
    ]


def _message(text: str, reader: OutputReader | None) -> p.AssistantMessage:
    if reader is None:
        return p.AssistantMessage(content=text)
    pieces = reader.feed(text) + reader.finish()
    content = "".join(piece for piece in pieces if isinstance(piece, str))
    thought = "".join(piece.text for piece in pieces if isinstance(piece, Reasoning))
    fields: dict = {"content": content}
    if thought:
        fields.update(reasoning_content=thought, reasoning=thought)
    if reader.tool_calls:
        fields.update(content=content or None, tool_calls=[
            p.ToolCallOut(id=c.id, function=p.FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in reader.tool_calls])
    return p.AssistantMessage(**fields)


def _finish_reason(engine_reason: str | None, reader: OutputReader | None) -> str | None:
    return "tool_calls" if engine_reason == "stop" and reader is not None and reader.tool_calls else engine_reason


@dataclass
class CompletionFormat:
    prompt_param = "prompt"
    model: str
    fingerprint: str
    want_logprobs: bool
    id: str = field(default_factory=lambda: p.random_id("cmpl"))
    created: int = field(default_factory=p.now)

    def _chunk(self, text: str, logprobs=None, finish_reason=None) -> p.CompletionStreamResponse:
        choice = p.CompletionChoice(index=0, text=text, logprobs=logprobs, finish_reason=finish_reason)
        return p.CompletionStreamResponse(id=self.id, created=self.created, model=self.model,
                                          system_fingerprint=self.fingerprint, choices=[choice])

    def opening(self) -> list[BaseModel]:
        return []

    def delta(self, event: GenerationEvent, offset: int) -> list[BaseModel]:
        logprobs = p.CompletionLogprobs.of(list(event.logprobs), offset) if self.want_logprobs else None
        return [self._chunk(event.text, logprobs)]

    def finish(self, finish_reason: str) -> list[BaseModel]:
        return [self._chunk("", finish_reason=finish_reason)]

    def usage(self, usage: Usage | None) -> BaseModel:
        return p.CompletionStreamResponse(id=self.id, created=self.created, model=self.model,
                                          system_fingerprint=self.fingerprint, choices=[],
                                          usage=usage_info(usage))

    def response(self, outcome: Outcome) -> BaseModel:
        logprobs = p.CompletionLogprobs.of(outcome.logprobs, 0) if self.want_logprobs else None
        choice = p.CompletionChoice(index=0, text=outcome.text, logprobs=logprobs,
                                    finish_reason=outcome.finish_reason)
        return p.CompletionResponse(id=self.id, created=self.created, model=self.model,
                                    system_fingerprint=self.fingerprint, choices=[choice],
                                    usage=usage_info(outcome.usage))


Format = ChatFormat | CompletionFormat


def _json(model: BaseModel) -> str:
    return model.model_dump_json(exclude_unset=True)


def _check_finished(outcome: Outcome, shutting_down: bool = False) -> None:
    if outcome.finish_reason in ("stop", "length"):
        return
    if shutting_down:  # "abort" or no final event
        raise APIError(503, "the server is shutting down", "server_error", code="server_shutdown")
    raise EngineUnavailableError("the request was aborted before it finished")


class Serving:
    """Drives requests through the engine client; shared by the chat and completion routes.
    The scheduler picks which request the engine runs next (streams first, see `scheduling`).

    On shutdown (`begin_drain`, or sse-starlette seeing the server stop) running requests get
    `drain_s` to finish; then they are aborted and answered 503 (a stream: an error event, [DONE]).
    """

    def __init__(self, client, metrics: ServerMetrics, drain_s: float = DRAIN_TIMEOUT_S) -> None:
        self.client, self.metrics, self.drain_s = client, metrics, drain_s
        self.drain_deadline: float | None = None
        self.scheduler = Scheduler(client.max_queue)

    def begin_drain(self) -> None:
        """Safe from a signal handler: it only sets a time."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.drain_s

    @property
    def shutting_down(self) -> bool:
        return self.drain_deadline is not None and time.monotonic() >= self.drain_deadline

    async def _abort_after_drain(self, submission: Submission, shutdown: anyio.Event | None = None) -> None:
        while not self.shutting_down:
            if shutdown is not None and shutdown.is_set():
                self.begin_drain()
            await asyncio.sleep(DRAIN_POLL_S)
        submission.client.abort(submission.request_id)  # the engine ends it within a decode step

    async def run(self, raw: Request, fmt: Format, request: GenerationRequest, stream: bool,
                  include_usage: bool = False) -> Response:
        timer = self.metrics.track()  # errors raised from here are counted by the error handlers
        with _prompt_errors(fmt):  # a bad request is answered at once, not after its turn
            self.client.engine.validate(request)
        ticket = await self.scheduler.acquire(streams=stream)
        try:
            submission = await self._submit(request, fmt)
        except BaseException:
            self.scheduler.release(ticket)
            raise
        if not stream:
            return await self._complete(raw, submission, fmt, timer, ticket)
        shutdown = anyio.Event()  # set by sse-starlette when the server stops: the drain begins
        events = self._stream(submission, fmt, include_usage, timer, shutdown, ticket)
        return EventSourceResponse(events, sep="\n", shutdown_event=shutdown,
                                   shutdown_grace_period=self.drain_s + SHUTDOWN_GRACE_S)

    async def _submit(self, request: GenerationRequest, fmt: Format) -> Submission:
        with _prompt_errors(fmt):
            return await Submission.start(self.client, request)

    async def _stream(self, submission: Submission, fmt: Format, include_usage: bool, timer,
                      shutdown: anyio.Event, ticket: Ticket) -> AsyncIterator[str]:
        status = ABORTED  # unless it ends below: the client went away
        stopper = asyncio.ensure_future(self._abort_after_drain(submission, shutdown))
        try:
            async for chunk in self._chunks(submission, fmt, include_usage, timer):
                yield _json(chunk)
            status = OK
        except Exception as e:  # after the 200 went out: an error event, then [DONE]
            status = ERROR
            error = to_api_error(e)
            crash = error.code == "internal_error"
            log.log(logging.ERROR if crash else logging.WARNING, "stream %s failed: %s",
                    submission.request_id, error.message, exc_info=crash)
            yield error.body().model_dump_json()
        finally:
            stopper.cancel()
            timer.done(status)
            await submission.close()
            self.scheduler.release(ticket)
        yield "[DONE]"

    async def _chunks(self, submission: Submission, fmt: Format, include_usage: bool,
                      timer) -> AsyncIterator[BaseModel]:
        for chunk in fmt.opening():
            yield chunk
        outcome, offset = Outcome(), 0
        async for event in submission:
            timer.observe(event)
            if event.text or event.logprobs:
                for chunk in fmt.delta(event, offset):
                    yield chunk
            offset += len(event.text)
            outcome.add(event)
        _check_finished(outcome, self.shutting_down)
        for chunk in fmt.finish(outcome.finish_reason):
            yield chunk
        if include_usage:
            yield fmt.usage(outcome.usage)

    async def _complete(self, raw: Request, submission: Submission, fmt: Format, timer, ticket: Ticket) -> Response:
        collect = asyncio.ensure_future(self._collect_in_turn(submission, fmt, timer, ticket))
        gone = asyncio.ensure_future(_wait_for_disconnect(raw))
        stopper = asyncio.ensure_future(self._abort_after_drain(submission))  # ends `collect` with "abort"
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            stopper.cancel()
            if not collect.done():  # the client left (or the server is stopping): stop the request
                collect.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.wait({collect})  # its `finally` aborts the request
                timer.done(ABORTED)
            self.scheduler.release(ticket)
        if collect.cancelled():
            return Response(status_code=CLIENT_CLOSED_STATUS)
        outcome = collect.result()
        _check_finished(outcome, self.shutting_down)
        timer.done(OK)
        return JSONResponse(fmt.response(outcome).model_dump(exclude_unset=True))

    async def _collect_in_turn(self, submission: Submission, fmt: Format, timer, ticket: Ticket) -> Outcome:
        """The outcome; a request preempted for a stream waits for its turn again and starts over."""
        request_id = submission.request_id
        while True:
            ticket.preempt = lambda: self.client.abort(request_id)  # the engine ends it with "abort"
            outcome = await self._collect(submission, timer)
            if not ticket.preempted or outcome.finish_reason in ("stop", "length"):
                return outcome
            log.info("request %s gave way to a streamed request; it starts again", submission.request_id)
            await self.scheduler.requeue(ticket)
            submission = await self._submit(submission.request, fmt)

    async def _collect(self, submission: Submission, timer) -> Outcome:
        outcome = Outcome()
        try:
            async for event in submission:
                timer.observe(event)
                outcome.add(event)
        finally:
            await submission.close()
        return outcome


@contextlib.contextmanager
def _prompt_errors(fmt: Format) -> Iterator[None]:
    """A prompt too long for the context, reported against the request's prompt field."""
    try:
        yield
    except ContextLengthError as e:
        raise e.for_prompt(fmt.prompt_param) from None


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
