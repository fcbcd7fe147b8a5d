"""llama.cpp's own server API, for the clients made for it: `POST /completion` (and its alias `/completions`;
SillyTavern's and other front ends' llama.cpp backend, scripts), `POST /infill` (the editor plugins llama.vim
and llama.vscode), `GET /props`, `POST /embedding` (and `/embeddings`), and the llama.cpp shapes of `/tokenize`
and `/detokenize` (their routes are vLLM's, in server/routes.py). `/completion` uses the prompt as given,
tokenized as `/v1/completions` does; `/infill` goes through the fill-in-the-middle pipeline `/v1/completions` with
`suffix` uses. Both answer in `/completion`'s shape (streamed: `data:` events, the last with `stop: true` and the
totals; no `[DONE]`, as llama.cpp sends none on these routes)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from engine.api import GenerationEvent, GenerationRequest, SamplingParams, Usage
from server import VERSION
from server import embeddings as emb
from server import llamacpp_protocol as lp
from server import protocol as p
from server.json_body import StrictJSONRoute
from server.pipeline import accept, fill_in_the_middle, model_name, ready_engine, serving
from server.serving import DataEvents, Outcome, TimedOutcome, event_data

log = logging.getLogger(__name__)
router = APIRouter(route_class=StrictJSONRoute)  # duplicate keys and deep nesting: 400

MS_PER_NS = 1e-6


@router.post("/completion")
@router.post("/completions")  # llama.cpp's alias (not OpenAI's: that is /v1/completions)
async def completion(body: lp.CompletionRequest, raw: Request) -> Response:
    accept(body)
    engine = ready_engine(raw, body.model)
    params = body.to_sampling_params(engine.sampling_defaults)
    prompt = await run_in_threadpool(prompt_token_ids, engine, body.prompt)
    fmt = CompletionFormat(model_name(engine, body.model), engine.max_model_len, body.response_fields,
                           want_probs=bool(body.n_probs))
    return await generate(raw, fmt, body, GenerationRequest(p.random_id("cmpl"), prompt, params))


@router.post("/infill")
async def infill(body: lp.InfillRequest, raw: Request) -> Response:
    accept(body)
    engine = ready_engine(raw, body.model)
    params = body.to_sampling_params(engine.sampling_defaults)
    prompt, params = await fill_in_the_middle(engine, body.prefix, body.input_suffix, params, body.files(),
                                              suffix_param="input_suffix")
    fmt = InfillFormat(model_name(engine, body.model), engine.max_model_len, body.response_fields,
                       want_probs=bool(body.n_probs))
    return await generate(raw, fmt, body, GenerationRequest(p.random_id("infill"), prompt, params))


async def generate(raw: Request, fmt: CompletionFormat, body: lp.CompletionRequest,
                   request: GenerationRequest) -> Response:
    if body.predicted == 0:  # llama.vim's cache warm-up: nothing to generate, the prompt was checked
        return nothing_predicted(fmt, len(request.prompt_token_ids), bool(body.stream))
    return await serving(raw).run(raw, fmt, request, bool(body.stream))


def prompt_token_ids(engine, prompt: str | list[int | str]) -> list[int]:
    """A text is tokenized as `/v1/completions` tokenizes it (the tokenizer's special tokens added: its BOS);
    a list's texts without them, but for a first one (llama.cpp adds its BOS where the list starts with text)."""
    if isinstance(prompt, str):
        return engine.encode(prompt)
    ids: list[int] = []
    for i, piece in enumerate(prompt):
        ids.extend(engine.encode(piece, add_special_tokens=i == 0) if isinstance(piece, str) else [piece])
    return ids


@router.post("/embedding")
@router.post("/embeddings")  # llama.cpp's alias (OpenAI's shape is /v1/embeddings)
async def embedding(body: lp.EmbeddingRequest, raw: Request) -> Response:
    accept(body)
    engine = ready_engine(raw, body.model)
    prompts, param = body.prompts(), body.prompt_param
    emb.check_inputs(prompts, param)
    emb.check_token_ids(prompts, engine.vocab_size, param)
    inputs = [await run_in_threadpool(prompt_token_ids, engine, prompt) for prompt in prompts]

    def results(vectors: emb.Vectors, tokens: int) -> lp.EmbeddingResults:
        return lp.EmbeddingResults([lp.EmbeddingResult(index=index, embedding=[emb.normalized(v, body.embd_normalize)])
                                    for index, v in enumerate(vectors)])

    return await emb.run_embeddings(raw, inputs, results, prompt_param=param)


@router.get("/props")
async def props(raw: Request) -> JSONResponse:
    """Read only: llama.cpp's `POST /props` (started with `--props`) has nothing this server could change."""
    engine = ready_engine(raw)
    tokenizer = engine.tokenizer
    settings = lp.SlotSettings(n_ctx=engine.max_model_len, params=default_params(engine))
    template = getattr(tokenizer, "chat_template", None)
    answer = lp.Props(default_generation_settings=settings, model_path=engine.config.model or engine.model_name,
                      model_alias=engine.model_name, chat_template=template if isinstance(template, str) else "",
                      build_info=f"moe-serve {VERSION}", bos_token=tokenizer.bos_token or "",
                      eos_token=tokenizer.eos_token or "")
    return JSONResponse(answer.model_dump())


def default_params(engine) -> lp.SlotParams:
    """What a `/completion` that sends no sampling field gets: the model's defaults (generation_config.json)."""
    defaults = SamplingParams(**engine.sampling_defaults)
    n_predict = engine.max_new_tokens or lp.UNLIMITED
    return lp.SlotParams(n_predict=n_predict, max_tokens=n_predict, temperature=defaults.temperature,
                         top_k=defaults.top_k, top_p=defaults.top_p, min_p=defaults.min_p,
                         repeat_penalty=defaults.repetition_penalty, presence_penalty=defaults.presence_penalty,
                         frequency_penalty=defaults.frequency_penalty, stop=list(defaults.stop))


def tokenized(engine, content: str, add_special: bool, with_pieces: bool) -> lp.TokenizeResponse:
    """`/tokenize` in llama.cpp's shape: the text's tokens (the BOS first with `add_special`), each with its
    piece with `with_pieces`."""
    tokens = engine.encode(content, add_special_tokens=add_special)
    if not with_pieces:
        return lp.TokenizeResponse(tokens=tokens)
    return lp.TokenizeResponse(tokens=[lp.TokenPiece(id=t, piece=token_piece(engine, t)) for t in tokens])


def token_piece(engine, token: int) -> str | list[int]:
    """A token's text; where it is a part of a character (byte-level BPE), its bytes, as llama.cpp gives them."""
    text = engine.decode([token], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text
    raw = token_bytes(engine.tokenizer.convert_ids_to_tokens(token))
    try:
        return raw.decode() if raw is not None else text
    except UnicodeDecodeError:
        return list(raw)


def token_bytes(symbol: str) -> bytes | None:
    """A byte-level BPE token's bytes (GPT-2's byte-to-character map undone); None for other vocabularies."""
    if not all(char in BYTE_OF_CHAR for char in symbol):
        return None
    return bytes(BYTE_OF_CHAR[char] for char in symbol)


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable bytes stand for themselves, the others for the
    characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


BYTE_OF_CHAR = _byte_of_char()


def nothing_predicted(fmt: CompletionFormat, prompt_tokens: int, stream: bool) -> Response:
    """The answer to `n_predict: 0`, at once: no token generated, the prompt counted."""
    outcome = TimedOutcome(finish_reason="length", usage=Usage(prompt_tokens, 0))
    if not stream:
        return JSONResponse(fmt.response([outcome]).model_dump(exclude_unset=True))

    async def last_event() -> AsyncIterator[str]:
        yield event_data(fmt.final(outcome, ""))

    return EventSourceResponse(last_event(), sep="\n")


@dataclass
class CompletionFormat(DataEvents):
    """The `Format` (server/serving.py) of `/completion`: one choice, llama.cpp's `/completion` fields."""

    prompt_param: ClassVar[str] = "prompt"
    done_marker: ClassVar[str | None] = None
    model: str
    max_model_len: int
    response_fields: list[str] | None = None
    want_probs: bool = False  # `n_probs`: `completion_probabilities` in every piece and the whole answer
    held_tokens: list[int] = field(default_factory=list)  # tokens whose text is held back (part of a character)

    def choice(self, index: int) -> CompletionFormat:
        return self

    def outcome(self) -> Outcome:
        return TimedOutcome()

    def opening(self) -> list[BaseModel]:
        return []

    def delta(self, event: GenerationEvent, offset: int) -> list[BaseModel]:
        self.held_tokens.extend(event.token_ids)
        if not (event.text or (self.want_probs and event.logprobs)):
            return []  # its tokens go with the piece that carries their text, as llama.cpp sends them
        chunk = lp.CompletionChunk(content=event.text, tokens=self.held_tokens)
        self.held_tokens = []
        if self.want_probs:
            chunk.completion_probabilities = lp.probabilities(event.logprobs)
        return [chunk]

    def finish(self, outcome: Outcome) -> list[BaseModel]:
        return [self.final(outcome, "")]

    def usage(self, outcomes: list[Outcome]) -> BaseModel:
        return self.final(outcomes[0], "")  # not asked for: the last event carries the totals

    def response(self, outcomes: list[Outcome]) -> BaseModel:
        (outcome,) = outcomes
        answer = self.final(outcome, outcome.text)
        if self.want_probs:
            answer.completion_probabilities = lp.probabilities(outcome.logprobs)
        if self.response_fields is None:
            return answer
        return lp.select_fields(answer.model_dump(exclude_unset=True), self.response_fields)

    def final(self, outcome: TimedOutcome, content: str) -> lp.CompletionResponse:
        """The answer's totals with `content` (a stream's last event: empty)."""
        usage = outcome.usage or Usage(0, 0)
        return lp.CompletionResponse(
            content=content, model=self.model, tokens_predicted=usage.completion_tokens,
            tokens_evaluated=usage.prompt_tokens, tokens_cached=usage.cached_tokens,
            stop_type=stop_type(outcome), stopping_word=outcome.stop_sequence or "",
            truncated=outcome.finish_reason == "length" and usage.prompt_tokens + usage.completion_tokens
            >= self.max_model_len,
            timings=timings(outcome, usage))


@dataclass
class InfillFormat(CompletionFormat):
    """`/infill`'s: `/completion`'s, its prompt in `input_prefix`."""

    prompt_param: ClassVar[str] = "input_prefix"


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
