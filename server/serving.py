"""Runs one OpenAI request through the engine: streamed (as SSE, or as NDJSON for Ollama's API) or
collected into one response.

`Submission` hands one generation to the `EngineClient`; `Choices` are the n generations of a
request (`n`), for each prompt of a batch, run one after another; `ChatFormat` and `CompletionFormat`
turn engine events into OpenAI objects; `Serving` drives them and records metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import ClassVar, Protocol

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent

from engine.api import (
    ContextLengthError,
    EchoedPrompt,
    EngineUnavailableError,
    GenerationEvent,
    GenerationRequest,
    InvalidRequestError,
    TokenLogprob,
    Usage,
)
from server import protocol as p
from server.errors import APIError, to_api_error
from server.metrics import ABORTED, ERROR, OK, ServerMetrics
from server.reasoning import OutputReader, Reasoning, ReasoningPlan, ReasoningTokens
from server.scheduling import Scheduler, Ticket
from server.tool_parsers import ToolCall
from server.tools import ToolPlan

log = logging.getLogger(__name__)

CLIENT_CLOSED_STATUS = 499  # nobody reads it: the client has gone
CLEANUP_TIMEOUT_S = 5
SHUTDOWN_GRACE_S = 3  # after the drain: for aborted streams to end with an error event and [DONE]
DRAIN_TIMEOUT_S = 20.0  # on shutdown, what running requests get to finish (--drain-timeout)
DRAIN_POLL_S = 0.1
FINISHED = ("stop", "length")
NDJSON_MEDIA_TYPE = "application/x-ndjson"
SEED_MODULUS = 2**64  # torch reads a seed modulo 2**64 (a negative one too)


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
        try:
            await asyncio.sleep(0)  # generate() validates and enqueues before its first suspension
        except asyncio.CancelledError:  # the client left as a later choice was handed over: it never runs
            submission.abort()
            raise
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


def choice_requests(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """One engine request per choice. Choice 0 is the request as sent (so n=1 is unchanged); choice i
    samples with seed + i (modulo 2**64), so each choice repeats and no two share their draws; without
    a seed every choice draws its own."""
    def choice(i: int) -> GenerationRequest:
        seed = request.params.seed
        params = replace(request.params, seed=None if seed is None else (seed + i) % SEED_MODULUS)
        return replace(request, request_id=f"{request.request_id}-{i}", params=params)

    return [request] + [choice(i) for i in range(1, n)]


def batch_requests(prompts: list[GenerationRequest], n: int) -> list[GenerationRequest]:
    """The choices of a batch: prompt j's choice i at index j*n + i (OpenAI's and vLLM's order), each
    prompt's as `choice_requests` makes them. Prompt 0 keeps its id (a lone prompt is unchanged); prompt
    j's ids take `-p{j}`, so that no two choices share one."""
    def prompt_request(j: int, request: GenerationRequest) -> GenerationRequest:
        return request if j == 0 else replace(request, request_id=f"{request.request_id}-p{j}")

    return [choice for j, request in enumerate(prompts)
            for choice in choice_requests(prompt_request(j, request), n)]


@dataclass
class Choices:
    """The n choices of one request (of each prompt of a batch), generated one after another (the
    engine runs one request at a time). `current` is the one handed to the engine last: what a
    disconnect, the drain or a preemption stops, and what is closed at the end."""

    requests: list[GenerationRequest]
    current: Submission

    def abort(self) -> None:
        """The engine ends the running choice with "abort"; a finished one is left as it is."""
        self.current.client.abort(self.current.request_id)


@dataclass
class Outcome:
    """What a finished generation (one choice) produced, collected from its events."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    reasoning: ReasoningTokens | None = None  # where a reasoning parser reads the output
    stop_sequence: str | None = None  # the stop string that ended it (finish_reason "stop")
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # where the request asked (echo)
    embeddings: tuple[tuple[float, ...], ...] = ()  # an embedding request's vectors [N, H]

    def add(self, event: GenerationEvent) -> None:
        self.text += event.text
        self.logprobs.extend(event.logprobs)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.embeddings:
            self.embeddings = event.embeddings
        if self.reasoning is not None:
            self.reasoning.add(event.text, len(event.token_ids))
        if event.finish_reason is not None:
            self.finish_reason, self.usage = event.finish_reason, event.usage
            self.stop_sequence = event.stop_sequence


@dataclass
class TimedOutcome(Outcome):
    """An outcome that also notes when the engine started on it, and its first and last events."""

    started_ns: int = field(default_factory=time.monotonic_ns)
    first_ns: int | None = None
    last_ns: int | None = None

    def add(self, event: GenerationEvent) -> None:
        super().add(event)
        now = time.monotonic_ns()
        self.first_ns = now if self.first_ns is None else self.first_ns
        self.last_ns = now


def usage_info(outcomes: list[Outcome], choices_per_prompt: int | None = None) -> p.UsageInfo:
    """Each prompt once (its choices read the same one; OpenAI counts it so) and every choice's completion.
    `choices_per_prompt`: a batch's n (prompt j's choices start at j*n); None: all choices share one prompt."""
    usages = [outcome.usage for outcome in outcomes if outcome.usage is not None]
    prompt_usages = usages[:1] if choices_per_prompt is None else [
        outcome.usage for outcome in outcomes[::choices_per_prompt] if outcome.usage is not None]
    prompt = sum(usage.prompt_tokens for usage in prompt_usages)
    completion = sum(usage.completion_tokens for usage in usages)
    cached = sum(usage.cached_tokens for usage in prompt_usages)
    details = {"prompt_tokens_details": p.PromptTokensDetails(cached_tokens=cached)}
    if outcomes and outcomes[0].reasoning is not None:
        reasoning = sum(outcome.reasoning.count() for outcome in outcomes)
        details["completion_tokens_details"] = p.CompletionTokensDetails(reasoning_tokens=reasoning)
    return p.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       **details)


class DataEvents:
    """How chat and completion streams frame their chunks (OpenAI's): each a `data:` line, an error
    as one more, then `data: [DONE]`. Formats of other APIs frame theirs otherwise."""

    framing: ClassVar[str] = "sse"
    done_marker: ClassVar[str | None] = "[DONE]"  # the last event's data; None: the stream just ends

    def event(self, chunk: BaseModel) -> str | ServerSentEvent:
        return event_data(chunk)

    def error_event(self, error: APIError) -> str | ServerSentEvent:
        return event_data(error.body())


def output_reader(tool_plan: ToolPlan, reasoning_plan: ReasoningPlan) -> OutputReader | None:
    """A fresh reader of one chat output's reasoning and tool calls; None where the text is all answer."""
    reasoning, calls = reasoning_plan.stream(), tool_plan.stream()
    return OutputReader(reasoning, calls) if reasoning is not None or calls is not None else None


class NamedEvents:
    """How the Responses and Anthropic streams frame theirs: each event named by its chunk's `type`
    (`event: response.output_text.delta`), and no [DONE]: the last event says it is the last."""

    framing: ClassVar[str] = "sse"
    done_marker: ClassVar[str | None] = None

    def event(self, chunk: BaseModel) -> ServerSentEvent:
        return ServerSentEvent(data=event_data(chunk), event=chunk.type)


class JSONLines:
    """How Ollama's streams frame theirs: not SSE but NDJSON (`application/x-ndjson`), one object a
    line, an error as `{"error": "..."}`, and no end marker: the last object says `"done": true`."""

    framing: ClassVar[str] = "ndjson"
    done_marker: ClassVar[str | None] = None

    def event(self, chunk: BaseModel) -> str:
        return event_data(chunk) + "\n"

    def error_event(self, error: APIError) -> str:
        return event_data(error.ollama_body()) + "\n"


@dataclass
class ChatFormat(DataEvents):
    prompt_param = "messages"  # the request field that holds the prompt (not a dataclass field)
    model: str
    fingerprint: str
    want_logprobs: bool
    id: str = field(default_factory=lambda: p.random_id("chatcmpl"))
    created: int = field(default_factory=p.now)
    tool_plan: ToolPlan = field(default_factory=ToolPlan)
    reasoning_plan: ReasoningPlan = field(default_factory=ReasoningPlan)
    index: int = 0  # the choice this formats

    def __post_init__(self) -> None:
        self._reader = self._new_reader()  # reads reasoning and tool calls out of the streamed text

    def choice(self, index: int) -> ChatFormat:
        """The format of choice `index`: the same response, its own reader."""
        return replace(self, index=index)

    def outcome(self) -> Outcome:
        return Outcome(reasoning=self.reasoning_plan.token_counter())

    def _new_reader(self) -> OutputReader | None:
        return output_reader(self.tool_plan, self.reasoning_plan)

    def _chunk(self, delta: p.DeltaMessage, logprobs=None, finish_reason=None) -> p.ChatCompletionStreamResponse:
        choice = p.ChatCompletionStreamChoice(index=self.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        return p.ChatCompletionStreamResponse(id=self.id, created=self.created, model=self.model,
                                              system_fingerprint=self.fingerprint, choices=[choice])

    def opening(self) -> list[BaseModel]:
        return [self._chunk(p.DeltaMessage(role="assistant", content=""))]

    def delta(self, event: GenerationEvent, offset: int) -> list[BaseModel]:
        logprobs = p.ChatChoiceLogprobs.of(list(event.logprobs)) if self.want_logprobs else None
        if self._reader is None:
            return [self._chunk(p.DeltaMessage(content=event.text), logprobs)]
        return self._piece_chunks(self._reader.feed(event.text), logprobs)

    def finish(self, outcome: Outcome) -> list[BaseModel]:
        rest = self._piece_chunks(self._reader.finish(), None) if self._reader else []
        return rest + [self._chunk(p.DeltaMessage(), finish_reason=_finish_reason(outcome.finish_reason,
                                                                                  self._reader))]

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

    def usage(self, outcomes: list[Outcome]) -> BaseModel:
        return p.ChatCompletionStreamResponse(id=self.id, created=self.created, model=self.model,
                                              system_fingerprint=self.fingerprint, choices=[],
                                              usage=usage_info(outcomes))

    def response(self, outcomes: list[Outcome]) -> BaseModel:
        choices = [self.choice(index)._whole(outcome) for index, outcome in enumerate(outcomes)]
        return p.ChatCompletionResponse(id=self.id, created=self.created, model=self.model,
                                        system_fingerprint=self.fingerprint, choices=choices,
                                        usage=usage_info(outcomes))

    def _whole(self, outcome: Outcome) -> p.ChatCompletionChoice:
        logprobs = p.ChatChoiceLogprobs.of(outcome.logprobs) if self.want_logprobs else None
        reader = self._new_reader()
        return p.ChatCompletionChoice(index=self.index, message=_message(outcome.text, reader), logprobs=logprobs,
                                      finish_reason=_finish_reason(outcome.finish_reason, reader))


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
class CompletionFormat(DataEvents):
    prompt_param = "prompt"
    model: str
    fingerprint: str
    want_logprobs: bool
    id: str = field(default_factory=lambda: p.random_id("cmpl"))
    created: int = field(default_factory=p.now)
    index: int = 0  # the choice this formats
    choices_per_prompt: int = 1  # `n`: choice `index` is of the batch's prompt index // n
    echoes: tuple[EchoedPrompt, ...] = ()  # each prompt's, in the batch's order (`echo`); empty: no echo

    def choice(self, index: int) -> CompletionFormat:
        return replace(self, index=index)

    @property
    def echo(self) -> EchoedPrompt | None:
        """The prompt this choice's text starts with (`echo`): its own prompt's."""
        return self.echoes[self.index // self.choices_per_prompt] if self.echoes else None

    def outcome(self) -> Outcome:
        return Outcome()

    def _chunk(self, text: str, logprobs=None, finish_reason=None) -> p.CompletionStreamResponse:
        choice = p.CompletionChoice(index=self.index, text=text, logprobs=logprobs, finish_reason=finish_reason)
        return p.CompletionStreamResponse(id=self.id, created=self.created, model=self.model,
                                          system_fingerprint=self.fingerprint, choices=[choice])

    @property
    def _echoed_length(self) -> int:
        """Where the completion's text starts in the choice's text."""
        return len(self.echo.text) if self.echo is not None else 0

    def _echoed_logprobs(self, scored: tuple[TokenLogprob | None, ...]) -> p.CompletionLogprobs:
        return p.CompletionLogprobs.of_prompt(scored, self.echo.tokens, self.echo.offsets)

    def opening(self) -> list[BaseModel]:
        if self.echo is not None and not self.want_logprobs:  # with logprobs: once the prompt's are computed
            return [self._chunk(self.echo.text)]
        return []

    def delta(self, event: GenerationEvent, offset: int) -> list[BaseModel]:
        chunks: list[BaseModel] = []
        if self.echo is not None and self.want_logprobs and event.prompt_logprobs is not None:
            chunks.append(self._chunk(self.echo.text, self._echoed_logprobs(event.prompt_logprobs)))
        if event.text or event.logprobs:
            logprobs = (p.CompletionLogprobs.of(list(event.logprobs), self._echoed_length + offset)
                        if self.want_logprobs else None)
            chunks.append(self._chunk(event.text, logprobs))
        return chunks

    def finish(self, outcome: Outcome) -> list[BaseModel]:
        return [self._chunk("", finish_reason=outcome.finish_reason)]

    def usage(self, outcomes: list[Outcome]) -> BaseModel:
        return p.CompletionStreamResponse(id=self.id, created=self.created, model=self.model,
                                          system_fingerprint=self.fingerprint, choices=[],
                                          usage=usage_info(outcomes, self.choices_per_prompt))

    def response(self, outcomes: list[Outcome]) -> BaseModel:
        choices = [self.choice(index)._whole(outcome) for index, outcome in enumerate(outcomes)]
        return p.CompletionResponse(id=self.id, created=self.created, model=self.model,
                                    system_fingerprint=self.fingerprint, choices=choices,
                                    usage=usage_info(outcomes, self.choices_per_prompt))

    def _whole(self, outcome: Outcome) -> p.CompletionChoice:
        text, logprobs = outcome.text, None
        if self.want_logprobs:
            logprobs = p.CompletionLogprobs.of(outcome.logprobs, self._echoed_length)
        if self.echo is not None:
            text = self.echo.text + text
            if logprobs is not None:
                logprobs = self._echoed_logprobs(outcome.prompt_logprobs).followed_by(logprobs)
        return p.CompletionChoice(index=self.index, text=text, logprobs=logprobs,
                                  finish_reason=outcome.finish_reason)


class Format(Protocol):
    """What `Serving` needs of an API's wire format (`ChatFormat` and `CompletionFormat` are two)."""

    prompt_param: ClassVar[str]  # the request field that holds the prompt, for errors about it
    framing: ClassVar[str]  # "sse" (text/event-stream) or "ndjson" (application/x-ndjson)
    done_marker: ClassVar[str | None]

    def choice(self, index: int) -> Format: ...
    def outcome(self) -> Outcome: ...
    def opening(self) -> list[BaseModel]: ...
    def delta(self, event: GenerationEvent, offset: int) -> list[BaseModel]: ...
    def finish(self, outcome: Outcome) -> list[BaseModel]: ...
    def usage(self, outcomes: list[Outcome]) -> BaseModel: ...
    def response(self, outcomes: list[Outcome]) -> BaseModel: ...
    def event(self, chunk: BaseModel) -> str | ServerSentEvent: ...
    def error_event(self, error: APIError) -> str | ServerSentEvent: ...


# Characters that JSON leaves raw but Python's str.splitlines (and so httpx's `iter_lines`) reads as line
# breaks: a client that splits a stream that way would cut a `data:` line in two. Escaped, the JSON is the same.
SPLITLINES_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event_data(model: BaseModel) -> str:
    """A stream event's data: one line, whatever the text."""
    return model.model_dump_json(exclude_unset=True).translate(SPLITLINES_BREAKS)


def _check_finished(outcome: Outcome, shutting_down: bool = False) -> None:
    if outcome.finish_reason in FINISHED:
        return
    if shutting_down:  # "abort" or no final event
        raise APIError(503, "the server is shutting down", "server_error", code="server_shutdown")
    raise EngineUnavailableError("the request was aborted before it finished")


class Serving:
    """Drives requests through the engine client; shared by the chat and completion routes.
    The scheduler picks which request the engine runs next (streams first, see `scheduling`).

    A request with n choices holds one ticket for all of them: it owns the engine from its first
    choice to its last, as one long request would. A ticket per choice would let others in between
    choices, but at batch size 1 that only reorders the same work, and a client waiting for all n
    choices gains nothing from it; a stream still preempts a non-streamed request between or
    during its choices (the running choice starts over, the finished ones are kept). A batch of
    prompts is run the same way: its n choices of each prompt, in turn, under one ticket.

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

    async def _abort_after_drain(self, choices: Choices, shutdown: anyio.Event | None = None) -> None:
        while not self.shutting_down:
            if shutdown is not None and shutdown.is_set():
                self.begin_drain()
            await asyncio.sleep(DRAIN_POLL_S)
        while True:  # the running choice, and any started after it: the engine ends each within a decode step
            choices.abort()
            await asyncio.sleep(DRAIN_POLL_S)

    async def run(self, raw: Request, fmt: Format, request: GenerationRequest | list[GenerationRequest],
                  stream: bool, include_usage: bool = False, n: int = 1) -> Response:
        """`request`: one prompt's, or a batch's (one per prompt); `n`: the number of choices of each
        prompt, each a generation of its request (see `choice_requests` and `batch_requests`)."""
        timer = self.metrics.track()  # errors raised from here are counted by the error handlers
        prompts = request if isinstance(request, list) else [request]
        self.validate(fmt, prompts)
        ticket = await self.scheduler.acquire(streams=stream)
        requests = batch_requests(prompts, n)
        try:
            choices = Choices(requests, await self._submit(requests[0], fmt))
        except BaseException:
            self.scheduler.release(ticket)
            raise
        if not stream:
            return await self._complete(raw, choices, fmt, timer, ticket)
        shutdown = anyio.Event()  # set by sse-starlette when the server stops: the drain begins
        events = self._stream(choices, fmt, include_usage, timer, shutdown, ticket)
        if fmt.framing == "ndjson":  # Starlette cancels `events` when the client goes: the request is aborted
            return StreamingResponse(events, media_type=NDJSON_MEDIA_TYPE)
        return EventSourceResponse(events, sep="\n", shutdown_event=shutdown,
                                   shutdown_grace_period=self.drain_s + SHUTDOWN_GRACE_S)

    def validate(self, fmt: Format, prompts: list[GenerationRequest]) -> None:
        """A bad request is answered at once, not after its turn; in a batch, a refused prompt is named by its
        index."""
        for index, prompt in enumerate(prompts):
            with _prompt_errors(fmt, index if len(prompts) > 1 else None):
                self.client.engine.validate(prompt)

    async def _submit(self, request: GenerationRequest, fmt: Format) -> Submission:
        with _prompt_errors(fmt):
            return await Submission.start(self.client, request)

    async def _start_choice(self, choices: Choices, index: int, fmt: Format, ticket: Ticket) -> Submission:
        """Choice `index` handed to the engine (the first was at the request's start)."""
        if index > 0:
            if ticket.preempted:  # a stream came while the previous choice ended: it goes first
                await self._give_way(choices, ticket)
            choices.current = await self._submit(choices.requests[index], fmt)
        return choices.current

    async def _give_way(self, choices: Choices, ticket: Ticket) -> None:
        log.info("request %s gave way to a streamed request; its running choice starts again after it",
                 choices.requests[0].request_id)
        await self.scheduler.requeue(ticket)

    async def _stream(self, choices: Choices, fmt: Format, include_usage: bool, timer,
                      shutdown: anyio.Event, ticket: Ticket) -> AsyncIterator[str]:
        status = ABORTED  # unless it ends below: the client went away
        stopper = asyncio.ensure_future(self._abort_after_drain(choices, shutdown))
        try:
            async for chunk in self._chunks(choices, fmt, include_usage, timer, ticket):
                yield fmt.event(chunk)
            status = OK
        except Exception as e:  # after the 200 went out: an error event, then [DONE]
            status = ERROR
            error = to_api_error(e)
            crash = error.code == "internal_error"
            log.log(logging.ERROR if crash else logging.WARNING, "stream %s failed: %s",
                    choices.current.request_id, error.message, exc_info=crash)
            yield fmt.error_event(error)
        finally:
            stopper.cancel()
            timer.done(status)
            await choices.current.close()
            self.scheduler.release(ticket)
        if fmt.done_marker is not None:
            yield fmt.done_marker

    async def _chunks(self, choices: Choices, fmt: Format, include_usage: bool, timer,
                      ticket: Ticket) -> AsyncIterator[BaseModel]:
        outcomes = []
        for index in range(len(choices.requests)):
            submission = await self._start_choice(choices, index, fmt, ticket)
            choice = fmt.choice(index)
            for chunk in choice.opening():
                yield chunk
            outcome, offset = choice.outcome(), 0
            async for event in submission:
                timer.observe(event)
                if event.text or event.logprobs or event.prompt_logprobs is not None:
                    for chunk in choice.delta(event, offset):
                        yield chunk
                offset += len(event.text)
                outcome.add(event)
            _check_finished(outcome, self.shutting_down)
            for chunk in choice.finish(outcome):
                yield chunk
            outcomes.append(outcome)
        if include_usage:
            yield fmt.usage(outcomes)

    async def _complete(self, raw: Request, choices: Choices, fmt: Format, timer, ticket: Ticket) -> Response:
        collect = asyncio.ensure_future(self._collect_all(choices, fmt, timer, ticket))
        gone = asyncio.ensure_future(wait_for_disconnect(raw))
        stopper = asyncio.ensure_future(self._abort_after_drain(choices))  # ends `collect` with "abort"
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
        outcomes = collect.result()
        for outcome in outcomes:
            _check_finished(outcome, self.shutting_down)
        timer.done(OK)
        return JSONResponse(fmt.response(outcomes).model_dump(exclude_unset=True))

    async def run_in_turn(self, requests: list[GenerationRequest], fmt: Format, ticket: Ticket,
                          wanted: Callable[[], bool]) -> list[Outcome] | None:
        """Requests that hold `ticket` (granted), run one after another for callers that watch their clients
        themselves (`server.embeddings.EmbeddingGroups`): a stream preempts them as any non-streamed request, the
        drain ends them (503), and none starts once nobody `wanted` them (None then)."""
        choices = Choices(requests, await self._submit(requests[0], fmt))
        stopper = asyncio.ensure_future(self._abort_after_drain(choices))
        timer = self.metrics.track()  # only observes events: each HTTP request behind them is counted by its caller
        try:
            outcomes = []
            for index in range(len(requests)):
                if index > 0 and not wanted():
                    return None
                await self._start_choice(choices, index, fmt, ticket)
                outcomes.append(await self._collect_in_turn(choices, fmt.choice(index), timer, ticket))
                _check_finished(outcomes[-1], self.shutting_down)
            return outcomes
        finally:
            stopper.cancel()
            await choices.current.close()

    async def _collect_all(self, choices: Choices, fmt: Format, timer, ticket: Ticket) -> list[Outcome]:
        """Each choice's outcome, up to the first that did not finish (aborted: answered 503)."""
        outcomes = []
        for index in range(len(choices.requests)):
            await self._start_choice(choices, index, fmt, ticket)
            outcomes.append(await self._collect_in_turn(choices, fmt.choice(index), timer, ticket))
            if outcomes[-1].finish_reason not in FINISHED:
                break
        return outcomes

    async def _collect_in_turn(self, choices: Choices, fmt: Format, timer, ticket: Ticket) -> Outcome:
        """The running choice's outcome; one preempted for a stream waits for its turn again and starts over."""
        while True:
            ticket.preempt = choices.abort  # the engine ends it with "abort"
            outcome = await self._collect(choices.current, fmt.outcome(), timer)
            if not ticket.preempted or outcome.finish_reason in FINISHED:
                return outcome
            await self._give_way(choices, ticket)
            choices.current = await self._submit(choices.current.request, fmt)

    async def _collect(self, submission: Submission, outcome: Outcome, timer) -> Outcome:
        try:
            async for event in submission:
                timer.observe(event)
                outcome.add(event)
        finally:
            await submission.close()
        return outcome


@contextlib.contextmanager
def _prompt_errors(fmt: Format, batch_index: int | None = None) -> Iterator[None]:
    """A prompt too long for the context, reported against the request's prompt field; in a batch, any
    refused prompt is named by its index."""
    try:
        yield
    except InvalidRequestError as e:
        error = e.for_prompt(fmt.prompt_param) if isinstance(e, ContextLengthError) else e
        if batch_index is None:
            raise error from None
        raise InvalidRequestError(f"{fmt.prompt_param}[{batch_index}]: {error}", param=error.param,
                                  code=error.code) from None


async def wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
