"""The engine's public types: what the server sends in and what streams back.

The server depends only on these and on `EngineClient` (engine/client.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]
Pooling = Literal["mean", "last"]  # how an embedding request's last hidden states [T, H] become one vector
POOLINGS: tuple[Pooling, ...] = ("mean", "last")
# padded positions in one embedding pass: several inputs at once read each expert once, not once per input
# (the demo model on the CPU: 16 inputs of 150-300 tokens in 0.5-0.8 of the time one after another, 17 of ~25
# in 0.23; bench.embedding_batches), yet a streamed chat waits for no more than a prompt of this length
EMBEDDING_BATCH_TOKENS = 2048
TEMPLATE_TIMEOUT_CODE = "chat_template_timeout"  # the error code of a chat template that ran too long
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes: int64 or uint64
# requests waiting or running (--max-queue), Ollama's OLLAMA_MAX_QUEUE: Open WebUI embeds a document one chunk per
# request, all at once (a 100 KB text is ~120 requests); a waiting request holds only its prompt's ids
DEFAULT_MAX_QUEUE = 512
MAX_STOP_SEQUENCES = 16  # OpenAI allows 4; chat front ends add a few per role name and template
MAX_STOP_CHARS = 256  # each stop string: checked against the text held back at every token
GREEDY_BELOW = 1e-5  # a lower temperature is greedy (as in vLLM): float32 cannot divide by it safely


class EngineError(Exception):
    """Base class of errors the engine reports to its caller."""


class InvalidRequestError(EngineError):
    """The request cannot run as given (the server answers 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ContextLengthError(InvalidRequestError):
    """Prompt plus completion exceed the context; `prompt_param` names the prompt's field in the request."""

    def __init__(self, limit: int, prompt_tokens: int, completion_tokens: int, prompt_param: str = "messages") -> None:
        self.limit, self.prompt_tokens, self.completion_tokens = limit, prompt_tokens, completion_tokens
        super().__init__(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the {prompt_param}, "
            f"{completion_tokens} in the completion). Please reduce the length of the {prompt_param} or completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )

    def for_prompt(self, prompt_param: str) -> ContextLengthError:
        """The same error, naming the request field that holds the prompt ("messages" or "prompt")."""
        return ContextLengthError(self.limit, self.prompt_tokens, self.completion_tokens, prompt_param)


class QueueFullError(EngineError):
    """The engine's queue is at `--max-queue` (the server answers 503)."""


class EngineUnavailableError(EngineError):
    """The engine is still loading or its worker has died (the server answers 503)."""


class DeviceMemoryError(EngineError):
    """The device ran out of memory during a request (its KV cache grows with the context); the
    engine goes on serving (the server answers 503)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None: up to the context length
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    top_logprobs: int | None = None  # None: no logprobs; 0..20: the chosen token plus that many
    # None: off; 0..20: each prompt token's logprob given those before it, plus that many alternatives
    # (the whole prompt is computed: no kept prefix is reused). Allows max_tokens 0: only the prompt is scored
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end the completion as end-of-sequence does (FIM's)
    text_continues_prompt: bool = False  # decoded after the prompt's last tokens (completions: a leading space kept)
    skip_special_tokens: bool = True  # False where a tool-call parser reads special tokens ([TOOL_CALLS])
    grammar: str | None = None  # a Lark grammar (llguidance dialect) the whole completion must match
    grammar_after: int | None = None  # ... or the completion after this token (a thinking model's `</think>`)
    grammar_may_open: int | None = None  # with grammar_after: a first token (`<think>`) that defers the grammar
    # a thinking budget: tokens the model may write inside its `<think>` block before the block is closed for it
    thinking_budget: int | None = None  # None: no limit
    thinking_end_ids: tuple[int, ...] = ()  # written once it is spent ("\n</think>\n\n"), `</think>` among them
    thinking_close: int | None = None  # `</think>`: the model closing the block itself ends the counting
    thinking_open: int | None = None  # `<think>`: the model opening the block starts the counting
    thinking_open_at_start: bool = False  # the prompt opened the block: the counting starts at once

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens is None or self.max_tokens >= 1 or self._scores_prompt_only, "max_tokens",
             "must be at least 1"),
            (0 <= self.temperature < math.inf, "temperature", "must be a finite number >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be -1, 0 or positive"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (0 < self.repetition_penalty < math.inf, "repetition_penalty", "must be a finite number > 0"),
            (self.seed is None or SEED_RANGE[0] <= self.seed < SEED_RANGE[1], "seed",
             f"must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]})"),
            (self.top_logprobs is None or 0 <= self.top_logprobs <= 20, "top_logprobs", "must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             "must be in [0, 20]"),
            (len(self.stop) <= MAX_STOP_SEQUENCES, "stop", f"may hold at most {MAX_STOP_SEQUENCES} sequences"),
            (all(len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
             f"sequences may be at most {MAX_STOP_CHARS} characters long"),
            (self.thinking_budget is None or self.thinking_budget >= 0, "thinking_budget", "must be >= 0"),
            (self.thinking_budget is None or self.thinking_close in self.thinking_end_ids, "thinking_budget",
             "needs the token that closes the thinking among the ids written when it is spent"),
            (self.grammar is None or not self.ignore_eos, "ignore_eos",
             "cannot be combined with a grammar: a finished grammar allows only end-of-sequence"),
            (
                all(-100 <= b <= 100 for b in self.logit_bias.values()),
                "logit_bias",
                "values must be in [-100, 100]",
            ),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(f"{param} {message}", param=param)

    @property
    def _scores_prompt_only(self) -> bool:
        return self.max_tokens == 0 and self.prompt_logprobs is not None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class ChatTemplateInfo:
    """What the model's chat template can do: the server picks its tool handling from this."""

    supports_tools: bool  # the template renders a `tools` list
    source: str  # the template text (tells a tool-call format apart, e.g. `<tool_call>`)
    model_type: str  # the checkpoint's config.model_type


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # an embedding instead of a completion: the model's last hidden states over the prompt, pooled (mean: the
    # average over every position; last: the last position's), on the only event; no token is sampled
    pooling: Pooling | None = None
    # with `pooling`: further inputs, embedded in the same pass as `prompt_token_ids` (a right-padded batch);
    # the only event then carries one vector per input, in this order
    more_inputs: tuple[list[int], ...] = ()

    @property
    def inputs(self) -> list[list[int]]:
        return [self.prompt_token_ids, *self.more_inputs]


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class EchoedPrompt:
    """A prompt as a completion's `echo` shows it."""

    text: str  # its token ids decoded, special tokens skipped
    tokens: tuple[str, ...]  # each token's text, as logprobs name tokens
    offsets: tuple[int, ...]  # where each token's text starts in `text` (a special token's: where it stood)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt: read from a kept KV cache, not computed

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class GenerationEvent:
    """One step of output. `text` may be empty while a possible stop string is held back."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # set on the last event
    stop_sequence: str | None = None  # on a "stop" event: the stop string that ended it; None: end of sequence
    # on the first event when SamplingParams.prompt_logprobs asked: one per prompt token, None for the first
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    embeddings: tuple[tuple[float, ...], ...] = ()  # [N, H]: on the only event of a request with `pooling`


def embedding_batches(lengths: list[int]) -> list[list[int]]:
    """The indices of inputs of these lengths, grouped into embedding passes: by length (little padding), each
    group's count × its longest within EMBEDDING_BATCH_TOKENS; a longer input goes alone (fed in chunks)."""
    batches: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[index] <= EMBEDDING_BATCH_TOKENS:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def supported_families() -> tuple[str, ...]:
    """Model types the engine can load: those whose experts use transformers' experts interface."""
    from engine.moe_layers import interface_families  # imports transformers: only when asked

    return interface_families()
