"""llama.cpp's own server API's wire types: `/completion` (a prompt used as given), `/infill` (the request
editor plugins such as llama.vim and llama.vscode send), the `/completion`-shaped answer both give (`content`,
`timings`, `tokens_cached`, `truncated`), `/tokenize`'s pieces, `/props` and `/embedding`.

The requests take `/completion`'s common sampling fields under llama.cpp's names (`n_predict`,
`repeat_penalty`, `seed` -1 for a random one). Fields llama.cpp has and this server does not honour
(`t_max_prompt_ms`, `t_max_predict_ms`, `samplers`, `n_indent`, `id_slot`, ...) are accepted and logged, as
every unknown field is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, RootModel

from engine.api import InvalidRequestError, SamplingParams, TokenLogprob, TopLogprob
from engine.fim import ExtraFiles
from server import protocol as p

RANDOM_SEED = -1  # llama.cpp's "no seed"
UNLIMITED = -1  # n_predict: until a stop or the end of the context
StopType = Literal["eos", "limit", "word"]


class ExtraChunk(p.OpenAIBaseModel):
    """Another file of the project (llama.vim sends chunks of recently seen buffers, with a `time` too)."""

    filename: str = "tmp"  # llama.cpp's default
    text: str = ""


class CompletionRequest(p.SamplingRequest):
    """`/completion`: the prompt as text (the tokenizer's BOS added, as `/v1/completions` does), token ids, or a
    list of both (BOS only when it starts with text, as in llama.cpp)."""

    prompt: str | list[int | str] = ""
    n_probs: int | None = None  # the top tokens' logprobs at each generated token (`completion_probabilities`)
    n_predict: int | None = None  # -1: no limit; 0: nothing generated (llama.vim warms its cache so)
    repeat_penalty: float | None = None
    cache_prompt: bool | None = None  # always on: the prefix cache keeps the prompt anyway
    # llama.cpp's forms: OpenAI's {"id": bias} or a list of [id, bias] pairs (SillyTavern sends the list, [] for
    # none); a bias of false bans the token (here OpenAI's -100). Token texts instead of ids are not supported.
    logit_bias: dict[str, float | bool] | list[list[int | float | str | bool]] | None = None  # type: ignore[assignment]
    response_fields: list[str] | None = None  # only these fields of the answer; "a/b" is b of a, at the top

    @property
    def predicted(self) -> int:
        """The token limit asked for, `n_predict` or OpenAI's `max_tokens`; -1 when neither is."""
        for value in (self.n_predict, self.max_tokens):
            if value is not None:
                return value
        return UNLIMITED

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        return super()._unsupported() + [
            ("n", self.num_choices != 1, "llama.cpp's routes answer one completion"),
            ("prompt", self.several_prompts, "send one prompt per request (a list of texts is several in llama.cpp)"),
        ]

    @property
    def several_prompts(self) -> bool:
        prompt = self.prompt
        return isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(piece, str) for piece in prompt)

    def _top_logprobs(self) -> int | None:
        return self.n_probs if self.n_probs else None

    def _max_tokens(self) -> int | None:
        if self.predicted < UNLIMITED:
            param = "n_predict" if self.n_predict is not None else "max_tokens"
            raise InvalidRequestError(f"{param} must be -1 (no limit), 0 or more", param=param)
        return None if self.predicted <= 0 else self.predicted  # 0 is answered without the engine

    def _sampling_params(self, defaults: Mapping[str, Any]) -> SamplingParams:
        renamed = self.model_copy(update={
            "logit_bias": _openai_bias(self.logit_bias),
            "seed": None if self.seed == RANDOM_SEED else self.seed,
            "repetition_penalty": self.repeat_penalty if self.repetition_penalty is None else self.repetition_penalty,
        })
        # the middle goes on from the prefix's text: its first word keeps its leading space
        return replace(super(CompletionRequest, renamed)._sampling_params(defaults), text_continues_prompt=True)

    def _request_param(self, param: str | None) -> str | None:
        renamed = {"max_tokens": "n_predict" if self.n_predict is not None else "max_tokens",
                   "repetition_penalty": "repeat_penalty" if self.repeat_penalty is not None else param,
                   "top_logprobs": "n_probs"}
        return renamed.get(param, param)


BANNED = -100.0  # OpenAI's lowest bias: the token is never sampled


def _openai_bias(bias: Mapping[str, float | bool] | Sequence[Sequence[int | float | str | bool]] | None
                 ) -> dict[str, float] | None:
    """llama.cpp's logit_bias as OpenAI's {"id": bias}; `false` (llama.cpp's ban) is -100."""
    if bias is None:
        return None
    pairs = list(bias.items()) if isinstance(bias, Mapping) else bias
    if any(len(pair) != 2 for pair in pairs):
        raise InvalidRequestError("logit_bias: each entry is a [token id, bias] pair", param="logit_bias")
    out = {}
    for token, value in pairs:
        if isinstance(token, bool | float) or isinstance(token, str) and not token.lstrip("-").isdigit():
            raise InvalidRequestError("logit_bias: token texts are not supported, send token ids", param="logit_bias")
        if isinstance(value, str) or value is True:
            raise InvalidRequestError("logit_bias: a bias is a number, or false to ban the token", param="logit_bias")
        out[str(token)] = BANNED if value is False else float(value)
    return out


class InfillRequest(CompletionRequest):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = []
    prompt: str = ""  # the cursor line's text before the cursor: it goes on from input_prefix, as in llama.cpp

    @property
    def prefix(self) -> str:
        return self.input_prefix + self.prompt

    def files(self) -> ExtraFiles:
        return [(chunk.filename, chunk.text) for chunk in self.input_extra]


class Timings(p.ResponseModel):
    cache_n: int
    prompt_n: int  # the prompt's tokens computed (not read from the prefix cache)
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class TopProbability(p.ResponseModel):
    id: int
    token: str
    bytes: list[int]
    logprob: float

    @classmethod
    def of(cls, lp: TokenLogprob | TopLogprob) -> TopProbability:
        return cls(id=lp.token_id, token=lp.token, bytes=list(lp.token.encode()), logprob=lp.logprob)


class TokenProbability(TopProbability):
    """A generated token's logprob and the `n_probs` most likely tokens' in its place."""

    top_logprobs: list[TopProbability]


def probabilities(logprobs: Sequence[TokenLogprob]) -> list[TokenProbability]:
    """llama.cpp's `completion_probabilities` of the tokens `logprobs` scores."""
    return [TokenProbability(**TopProbability.of(lp).model_dump(), top_logprobs=[TopProbability.of(t) for t in lp.top])
            for lp in logprobs]


class CompletionChunk(p.ResponseModel):
    """A piece of a streamed answer."""

    _omit_unless_given: ClassVar[frozenset[str]] = frozenset({"completion_probabilities"})

    index: int = 0
    content: str
    tokens: list[int]
    stop: Literal[False] = False
    completion_probabilities: list[TokenProbability] | None = None  # with `n_probs`


class CompletionResponse(p.ResponseModel):
    """The whole answer, or a stream's last event (its `content` then empty)."""

    _omit_unless_given: ClassVar[frozenset[str]] = frozenset({"completion_probabilities"})

    index: int = 0
    content: str
    tokens: list[int] = []
    completion_probabilities: list[TokenProbability] | None = None  # with `n_probs`
    stop: Literal[True] = True
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    tokens_cached: int  # the prompt's tokens read from the prefix cache
    stop_type: StopType
    stopping_word: str
    truncated: bool  # the context ended the answer
    timings: Timings


class SelectedFields(BaseModel):
    """An answer cut to a request's `response_fields`."""

    model_config = ConfigDict(extra="allow")


def select_fields(answer: dict[str, Any], fields: list[str]) -> SelectedFields:
    """llama.cpp's `response_fields`: each path's value under the path itself (`timings/prompt_n`), at the
    top; a path the answer lacks is left out."""
    selected = {}
    for path in fields:
        value: Any = answer
        for key in path.split("/"):
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            selected[path] = value
    return SelectedFields(**selected)


class TokenPiece(p.ResponseModel):
    """A token of `/tokenize` with `with_pieces`: its text, or its bytes where they are not whole UTF-8."""

    id: int
    piece: str | list[int]


class TokenizeResponse(p.ResponseModel):
    tokens: list[int] | list[TokenPiece]


class DetokenizeResponse(p.DetokenizeResponse):
    content: str  # llama.cpp's name for vLLM's `prompt` (the same text)


Prompt = str | list[int | str]  # a text, token ids, or texts and ids joined


class EmbeddingRequest(p.OpenAIBaseModel):
    """`POST /embedding` (and `/embeddings`): `input` (or `content`) is one prompt or several, as llama.cpp reads
    them: a list of texts, or of lists, is several; a list of ids (texts among them or not) is one."""

    model: str | None = None
    input: Prompt | list[Prompt] | None = None
    content: Prompt | list[Prompt] | None = None
    embd_normalize: int = 2  # -1 none, 0 max absolute (int16 range), 1 taxicab, 2 Euclidean, p > 2 p-norm

    def prompts(self) -> list[Prompt]:
        given = self.input if self.input is not None else self.content
        if given is None:
            raise InvalidRequestError('"input" or "content" must be provided', param="content")
        if isinstance(given, str):
            return [given]
        if any(isinstance(item, int) for item in given) and not any(isinstance(item, list) for item in given):
            return [given]
        return list(given)

    @property
    def prompt_param(self) -> str:
        return "input" if self.input is not None else "content"


class EmbeddingResult(p.ResponseModel):
    index: int
    embedding: list[list[float]]  # one pooled vector (llama.cpp lists a vector per token without pooling)


class EmbeddingResults(RootModel[list[EmbeddingResult]]):
    """`/embedding`'s answer: a bare list, one result per prompt, in order."""


class SlotParams(p.ResponseModel):
    """The sampling values a `/completion` that sends none gets (the model's, from generation_config.json)."""

    n_predict: int
    seed: int = RANDOM_SEED
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    presence_penalty: float
    frequency_penalty: float
    stop: list[str] = []
    max_tokens: int
    ignore_eos: bool = False
    stream: bool = False
    n_probs: int = 0


class SlotSettings(p.ResponseModel):
    id: int = 0
    n_ctx: int
    speculative: bool = False
    is_processing: bool = False
    params: SlotParams


class Props(p.ResponseModel):
    """`GET /props`: what llama.cpp's front ends read to set themselves up (context size, template)."""

    default_generation_settings: SlotSettings
    total_slots: int = 1
    model_path: str
    model_alias: str
    chat_template: str
    modalities: dict[str, bool] = {"vision": False, "audio": False}
    build_info: str
    bos_token: str
    eos_token: str
    is_sleeping: bool = False
