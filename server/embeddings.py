"""Embeddings: OpenAI's `/v1/embeddings` wire types, and what it shares with Ollama's `/api/embed` and
`/api/embeddings` (server/ollama_routes.py).

An engine request with `pooling` (the server's `--pooling`) computes its inputs and pools the model's last
hidden states of each into one vector [H]. The inputs of the requests waiting together (`EmbeddingGroups`) go in
batches of similar length, one engine request each, run one after another under one ticket as a batch of
completion prompts is (a streamed chat goes first between two of them).
OpenAI's vectors and Ollama's `/api/embed`'s are L2-normalized; `dimensions` keeps the first N components
and normalizes again, as Ollama does (a model not trained for shorter vectors loses information so).
"""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from engine.api import GenerationRequest, InvalidRequestError, Pooling, embedding_batches
from server.metrics import ABORTED, OK
from server.protocol import OpenAIBaseModel, ResponseModel, random_id
from server.scheduling import Ticket
from server.serving import CLIENT_CLOSED_STATUS, Outcome, Serving, wait_for_disconnect

MAX_INPUTS = 2048  # per request, OpenAI's limit (LangChain sends up to 1,000 chunks at once)


# -- OpenAI's wire types -------------------------------------------------------------------
class EmbeddingRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]  # texts, or token ids of this model's tokenizer
    encoding_format: Literal["float", "base64"] = "float"  # the openai SDK asks base64 unless told otherwise
    dimensions: int | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """The inputs, each a text or token ids; a lone text or token-id list is one input."""
        given = self.input
        inputs = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else list(given)
        check_inputs(inputs, "input")
        return inputs


class EmbeddingData(ResponseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a base64 string of little-endian float32 with encoding_format "base64"


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


# -- shared by OpenAI's and Ollama's routes ------------------------------------------------
def check_inputs(inputs: Sequence[str | list[int]], param: str) -> None:
    """At least one input, at most MAX_INPUTS, none empty (an empty one has no hidden state to pool)."""
    if not inputs:
        raise InvalidRequestError(f"{param} is an empty list: send at least one input", param=param)
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequestError(f"at most {MAX_INPUTS} inputs in one request (got {len(inputs)})", param=param)
    for index, item in enumerate(inputs):
        if len(item) == 0:
            raise InvalidRequestError(f"{_named(param, index, inputs)} is empty: there is nothing to embed",
                                      param=param)


def check_token_ids(inputs: Sequence[str | list[int | str]], vocab_size: int, param: str) -> None:
    for index, item in enumerate(inputs):
        if isinstance(item, list) and any(isinstance(t, int) and not 0 <= t < vocab_size for t in item):
            raise InvalidRequestError(f"{_named(param, index, inputs)}: token ids must be in [0, {vocab_size})",
                                      param=param)


def _named(param: str, index: int, inputs: Sequence) -> str:
    """How an error names input `index`: the field alone for a lone input, else with its index."""
    return param if len(inputs) == 1 else f"{param}[{index}]"


def check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    if dimensions is not None and not 1 <= dimensions <= hidden_size:
        raise InvalidRequestError(f"dimensions must be in [1, {hidden_size}] (this model's vectors have "
                                  f"{hidden_size})", param="dimensions")


def unit_vector(vector: Sequence[float], dimensions: int | None = None) -> list[float]:
    """The first `dimensions` components (all when None), L2-normalized."""
    return normalized(vector[:dimensions], 2)


def normalized(vector: Sequence[float], norm: int) -> list[float]:
    """llama.cpp's `embd_normalize`: -1 as is, 0 scaled so its largest component is ±32760 (int16's range), p ≥ 1
    divided by its p-norm (1 taxicab, 2 Euclidean). A zero vector stays zero."""
    v = torch.tensor(vector, dtype=torch.float32)
    if norm < 0 or not v.any():
        return v.tolist()
    largest = v.abs().max()
    # the p-norm of v / largest (in [1, n^(1/p)]) cannot overflow for a large p, as v's own p-th powers do
    scale = largest / 32760 if norm == 0 else largest * torch.linalg.vector_norm(v / largest, ord=norm)
    return (v / scale).tolist()


def base64_floats(vector: Sequence[float]) -> str:
    """OpenAI's `encoding_format: "base64"`: the vector as little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


Vectors = list[tuple[float, ...]]  # [N, H], in the order of the request's inputs


@dataclass(frozen=True)
class EmbeddingFormat:
    """What `Serving` needs to run embedding passes (never streamed)."""

    prompt_param: str = "input"  # the request field errors about an input name

    def choice(self, index: int) -> EmbeddingFormat:
        return self

    def outcome(self) -> Outcome:
        return Outcome()


@dataclass(eq=False)
class _Member:
    """One HTTP request's inputs in a group; `done` gets their vectors and prompt tokens."""

    inputs: list[list[int]]
    done: asyncio.Future


@dataclass(eq=False)
class _Group:
    members: list[_Member] = field(default_factory=list)
    inputs: int = 0


class EmbeddingGroups:
    """Embedding requests that arrive while the engine is busy wait for its next turn together, and their inputs
    go through it as one request's would: grouped by length into padded passes (`embedding_batches`), so each
    expert is read once per pass and not once per input. Open WebUI sends one request per document chunk, all at
    once; clients with a batch size send several at a time. A request on an idle engine goes at once, alone.

    A group holds one scheduler ticket: between two of its passes a streamed chat goes first, and the group is
    preempted by one as any non-streamed request. A request whose client leaves is dropped from its group
    (answered 499); the group stops before its next pass once none of its requests is left."""

    def __init__(self, serving: Serving, max_inputs: int = MAX_INPUTS) -> None:
        self.serving, self.max_inputs = serving, max_inputs
        self._open: _Group | None = None  # the group waiting for its turn, which later requests join
        self._running: set[asyncio.Task] = set()  # the event loop keeps only weak references to tasks

    async def run(self, raw: Request, inputs: list[list[int]], build: Callable[[Vectors, int], BaseModel],
                  prompt_param: str = "input") -> Response:
        """Each input's pooled vector (the inputs' token ids), collected by `build` with the prompt tokens."""
        fmt, pooling = EmbeddingFormat(prompt_param), raw.app.state.pooling
        self.serving.validate(fmt, [GenerationRequest("check", ids, pooling=pooling) for ids in inputs])
        timer = self.serving.metrics.track()  # errors raised from here are counted by the error handlers
        member = _Member(inputs, asyncio.get_running_loop().create_future())
        self._join(member, fmt, pooling)
        gone = asyncio.ensure_future(wait_for_disconnect(raw))
        try:
            await asyncio.wait({member.done, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not member.done.done():  # the client left: its inputs are dropped unless their pass has begun
            member.done.cancel()
            timer.done(ABORTED)
            return Response(status_code=CLIENT_CLOSED_STATUS)
        vectors, tokens = member.done.result()
        timer.done(OK)
        return JSONResponse(build(vectors, tokens).model_dump(exclude_unset=True))

    def _join(self, member: _Member, fmt: EmbeddingFormat, pooling: Pooling) -> None:
        group = self._open
        if group is None or group.inputs + len(member.inputs) > self.max_inputs:
            group = self._open = _Group()
            task = asyncio.ensure_future(self._run_group(group, fmt, pooling))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
        group.members.append(member)
        group.inputs += len(member.inputs)

    async def _run_group(self, group: _Group, fmt: EmbeddingFormat, pooling: Pooling) -> None:
        try:
            ticket = await self.serving.scheduler.acquire(streams=False)
        except Exception as e:  # the queue is full
            self._close(group)
            _fail(group.members, e)
            return
        try:
            self._close(group)
            members = [m for m in group.members if not m.done.done()]
            inputs = [ids for m in members for ids in m.inputs]
            vectors = await self._vectors(inputs, fmt, pooling, ticket, lambda: _waiting(members)) if inputs else None
            if vectors is not None:  # None: every client left
                _deliver(members, vectors)
        except Exception as e:
            _fail(group.members, e)
        finally:
            self.serving.scheduler.release(ticket)

    def _close(self, group: _Group) -> None:
        if self._open is group:
            self._open = None

    async def _vectors(self, inputs: list[list[int]], fmt: EmbeddingFormat, pooling: Pooling, ticket: Ticket,
                       wanted: Callable[[], bool]) -> Vectors | None:
        """The inputs' vectors in their order, computed in padded passes under `ticket`."""
        request_id = random_id("embd")
        batches = embedding_batches([len(ids) for ids in inputs])
        requests = [GenerationRequest(request_id, inputs[first], pooling=pooling,
                                      more_inputs=tuple(inputs[index] for index in rest))
                    for first, *rest in batches]
        outcomes = await self.serving.run_in_turn(requests, fmt, ticket, wanted)
        if outcomes is None:
            return None
        vectors: Vectors = [()] * len(inputs)
        order = (index for batch in batches for index in batch)
        for index, vector in zip(order, (v for outcome in outcomes for v in outcome.embeddings), strict=True):
            vectors[index] = vector
        return vectors


async def run_embeddings(raw: Request, inputs: list[list[int]], build: Callable[[Vectors, int], BaseModel],
                         prompt_param: str = "input") -> Response:
    """Each input's pooled vector (the inputs' token ids), collected by `build`; see `EmbeddingGroups`."""
    return await raw.app.state.embedding_groups.run(raw, inputs, build, prompt_param)


def _waiting(members: list[_Member]) -> bool:
    return any(not m.done.done() for m in members)


def _deliver(members: list[_Member], vectors: Vectors) -> None:
    start = 0
    for member in members:
        end = start + len(member.inputs)
        if not member.done.done():
            member.done.set_result((vectors[start:end], sum(map(len, member.inputs))))
        start = end


def _fail(members: list[_Member], error: Exception) -> None:
    for member in members:
        if not member.done.done():
            member.done.set_exception(error)


def openai_response(body: EmbeddingRequest, model: str) -> Callable[[Vectors, int], EmbeddingResponse]:
    def build(vectors: Vectors, tokens: int) -> EmbeddingResponse:
        data = []
        for index, vector in enumerate(vectors):
            unit = unit_vector(vector, body.dimensions)
            data.append(EmbeddingData(index=index, embedding=base64_floats(unit)
                                      if body.encoding_format == "base64" else unit))
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return EmbeddingResponse(data=data, model=model, usage=usage)

    return build
