"""Embeddings: OpenAI's `/v1/embeddings` wire types, and what it shares with Ollama's `/api/embed` and
`/api/embeddings` (server/ollama_routes.py).

An engine request with `pooling` (the server's `--pooling`) computes its inputs and pools the model's last
hidden states of each into one vector [H]. A request's inputs go in batches of similar length, one engine request
each, run one after another under one ticket as a batch of completion prompts is (a streamed chat goes first
between two of them).
OpenAI's vectors and Ollama's `/api/embed`'s are L2-normalized; `dimensions` keeps the first N components
and normalizes again, as Ollama does (a model not trained for shorter vectors loses information so).
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from engine.api import GenerationRequest, InvalidRequestError, embedding_batches
from server.protocol import OpenAIBaseModel, ResponseModel, random_id
from server.serving import Outcome, Serving

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
    if norm < 0:
        return v.tolist()
    scale = v.abs().max() / 32760 if norm == 0 else torch.linalg.vector_norm(v, ord=norm)
    return (v / scale if scale > 0 else v).tolist()


def base64_floats(vector: Sequence[float]) -> str:
    """OpenAI's `encoding_format: "base64"`: the vector as little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


Vectors = list[tuple[float, ...]]  # [N, H], in the order of the request's inputs


@dataclass(frozen=True)
class EmbeddingFormat:
    """What `Serving.run` needs to collect a request's vectors (never streamed): `build` makes the response
    from the vectors in input order and the prompt tokens they took."""

    build: Callable[[Vectors, int], BaseModel]
    order: list[int]  # the input each vector the engine requests return stands for, in turn
    prompt_param: str = "input"  # the request field errors about an input name

    def choice(self, index: int) -> EmbeddingFormat:
        return self

    def outcome(self) -> Outcome:
        return Outcome()

    def response(self, outcomes: list[Outcome]) -> BaseModel:
        vectors: Vectors = [()] * len(self.order)
        for index, vector in zip(self.order, (v for outcome in outcomes for v in outcome.embeddings), strict=True):
            vectors[index] = vector
        return self.build(vectors, sum(outcome.usage.prompt_tokens for outcome in outcomes))


async def run_embeddings(raw: Request, serving: Serving, inputs: list[list[int]],
                         build: Callable[[Vectors, int], BaseModel], prompt_param: str = "input") -> Response:
    """Each input's pooled vector (the inputs' token ids), collected by `build`. Inputs of similar length go
    to the engine together (`embedding_batches`); a streamed chat goes first between two such batches."""
    request_id, pooling = random_id("embd"), raw.app.state.pooling
    alone = [GenerationRequest(request_id, ids, pooling=pooling) for ids in inputs]
    batches = embedding_batches([len(ids) for ids in inputs])
    fmt = EmbeddingFormat(build, [index for batch in batches for index in batch], prompt_param)
    serving.validate(fmt, alone)  # a refused input is named by its own index, not its batch's
    requests = [GenerationRequest(request_id, inputs[first], pooling=pooling,
                                  more_inputs=tuple(inputs[index] for index in rest))
                for first, *rest in batches]
    return await serving.run(raw, fmt, requests if len(requests) > 1 else requests[0], stream=False)


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
