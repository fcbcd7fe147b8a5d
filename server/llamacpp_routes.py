"""llama.cpp's `POST /infill`, for the editor plugins made for llama.cpp's server (llama.vim, llama.vscode):
its request goes through the fill-in-the-middle pipeline `/v1/completions` with `suffix` uses, and the answer
takes the shape of llama.cpp's `/completion` (streamed: `data:` events, the last with `stop: true` and the
totals; no `[DONE]`, as llama.cpp sends none on this route)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sse_starlette import EventSourceResponse

from engine.api import GenerationEvent, GenerationRequest, Usage
from server import llamacpp_protocol as lp
from server import protocol as p
from server.json_body import StrictJSONRoute
from server.pipeline import accept, fill_in_the_middle, model_name, ready_engine, serving
from server.serving import DataEvents, Outcome, TimedOutcome, event_data

log = logging.getLogger(__name__)
router = APIRouter(route_class=StrictJSONRoute)  # duplicate keys and deep nesting: 400

MS_PER_NS = 1e-6


@router.post("/infill")
async def infill(body: lp.InfillRequest, raw: Request) -> Response:
    accept(body)
    engine = ready_engine(raw, body.model)
    params = body.to_sampling_params(engine.sampling_defaults)
    prompt, params = await fill_in_the_middle(engine, body.prefix, body.input_suffix, params, body.files())
    fmt = InfillFormat(model_name(engine, body.model), engine.max_model_len, body.response_fields)
    if body.predicted == 0:  # llama.vim's cache warm-up: nothing to generate, the prompt was checked
        return nothing_predicted(fmt, len(prompt), bool(body.stream))
    request = GenerationRequest(p.random_id("infill"), prompt, params)
    return await serving(raw).run(raw, fmt, request, bool(body.stream))


def nothing_predicted(fmt: InfillFormat, prompt_tokens: int, stream: bool) -> Response:
    """The answer to `n_predict: 0`, at once: no token generated, the prompt counted."""
    outcome = TimedOutcome(finish_reason="length", usage=Usage(prompt_tokens, 0))
    if not stream:
        return JSONResponse(fmt.response([outcome]).model_dump(exclude_unset=True))

    async def last_event() -> AsyncIterator[str]:
        yield event_data(fmt.final(outcome, ""))

    return EventSourceResponse(last_event(), sep="\n")


@dataclass
class InfillFormat(DataEvents):
    """The `Format` (server/serving.py) of `/infill`: one choice, llama.cpp's `/completion` fields."""

    prompt_param: ClassVar[str] = "input_prefix"
    done_marker: ClassVar[str | None] = None
    model: str
    max_model_len: int
    response_fields: list[str] | None = None

    def choice(self, index: int) -> InfillFormat:
        return self

    def outcome(self) -> Outcome:
        return TimedOutcome()

    def opening(self) -> list[BaseModel]:
        return []

    def delta(self, event: GenerationEvent, offset: int) -> list[BaseModel]:
        return [lp.InfillChunk(content=event.text, tokens=list(event.token_ids))] if event.text else []

    def finish(self, outcome: Outcome) -> list[BaseModel]:
        return [self.final(outcome, "")]

    def usage(self, outcomes: list[Outcome]) -> BaseModel:
        return self.final(outcomes[0], "")  # not asked for: the last event carries the totals

    def response(self, outcomes: list[Outcome]) -> BaseModel:
        (outcome,) = outcomes
        answer = self.final(outcome, outcome.text)
        if self.response_fields is None:
            return answer
        return lp.select_fields(answer.model_dump(exclude_unset=True), self.response_fields)

    def final(self, outcome: TimedOutcome, content: str) -> lp.InfillResponse:
        """The answer's totals with `content` (a stream's last event: empty)."""
        usage = outcome.usage or Usage(0, 0)
        return lp.InfillResponse(
            content=content, model=self.model, tokens_predicted=usage.completion_tokens,
            tokens_evaluated=usage.prompt_tokens, tokens_cached=usage.cached_tokens,
            stop_type=stop_type(outcome), stopping_word=outcome.stop_sequence or "",
            truncated=outcome.finish_reason == "length" and usage.prompt_tokens + usage.completion_tokens
            >= self.max_model_len,
            timings=timings(outcome, usage))


def stop_type(outcome: Outcome) -> lp.StopType:
    if outcome.finish_reason == "length":
        return "limit"
    return "word" if outcome.stop_sequence else "eos"


def timings(outcome: TimedOutcome, usage: Usage) -> lp.Timings:
    """llama.cpp's timings, from the server's clock (as Ollama's durations): the prompt from the hand-over to
    the engine to the first token, the prediction from the first token to the last."""
    now = time.monotonic_ns()
    first, last = outcome.first_ns or now, outcome.last_ns or now
    prompt_n = usage.prompt_tokens - usage.cached_tokens
    prompt_ms, predicted_ms = (first - outcome.started_ns) * MS_PER_NS, (last - first) * MS_PER_NS
    return lp.Timings(cache_n=usage.cached_tokens, prompt_n=prompt_n, prompt_ms=prompt_ms,
                      prompt_per_token_ms=per_token(prompt_ms, prompt_n),
                      prompt_per_second=per_second(prompt_n, prompt_ms),
                      predicted_n=usage.completion_tokens, predicted_ms=predicted_ms,
                      predicted_per_token_ms=per_token(predicted_ms, usage.completion_tokens),
                      predicted_per_second=per_second(usage.completion_tokens, predicted_ms))


def per_token(ms: float, tokens: int) -> float:
    return ms / tokens if tokens else 0.0


def per_second(tokens: int, ms: float) -> float:
    return 1000 * tokens / ms if ms > 0 else 0.0
