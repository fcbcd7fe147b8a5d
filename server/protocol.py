"""OpenAI wire types (requests, responses, stream chunks, errors), in the shapes OpenAI uses.

Requests ignore fields they do not know (clients send many; each is logged), but fields we
know and cannot honour (`best_of` > 1, `echo` with a `suffix`, ...) are refused with a 400 that names them.
`to_sampling_params()` is the only way a request reaches the engine. What `tools` and
`response_format` mean is decided in server/tools.py and server/structured.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.api import InvalidRequestError, SamplingParams, TokenLogprob

FinishReason = Literal["stop", "length", "tool_calls"]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


MAX_MESSAGES = 4096  # per chat request; also content parts per message
MAX_TOOLS = 128  # OpenAI's limit
MAX_N = 16  # choices per request: each is a whole generation, run one after another
MAX_BATCH = 64  # prompts per /v1/completions request: each prompt's choices run one after another


class OpenAIBaseModel(BaseModel):
    """A request: unknown fields are kept aside (and logged), not refused; clients send many.
    Types are strict, as OpenAI's: `"5"` is not a number nor `1` a boolean."""

    model_config = ConfigDict(extra="allow", strict=True)

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def check_text(self) -> None:
        """Refuse a lone surrogate (`"\\ud800"`) in any string: JSON allows it, UTF-8 and tokenizers do not."""
        param = _surrogate_path(self.model_dump())
        if param is not None:
            raise InvalidRequestError(f"{param or 'a field name'}: a string holds a lone surrogate (invalid Unicode)",
                                      param=param or None)


def _surrogate_path(value: Any, path: str = "") -> str | None:
    """The path (`messages[0].content`) of the first string or key holding a lone surrogate, else None."""
    if isinstance(value, str):
        return path if _has_surrogate(value) else None
    if isinstance(value, dict):
        children = ((f"{path}.{key}" if path else str(key), str(key), item) for key, item in value.items())
    elif isinstance(value, list):
        children = ((f"{path}[{i}]", "", item) for i, item in enumerate(value))
    else:
        return None
    for here, key, item in children:
        if _has_surrogate(key):
            return path  # the key itself cannot be quoted: "" for a field name
        found = _surrogate_path(item, here)
        if found is not None:
            return found
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class ResponseModel(BaseModel):
    """A response object. Dumped with `exclude_unset=True`, so every field counts as set (OpenAI
    sends `"logprobs": null` and the like) except those in `_omit_unless_given`."""

    _omit_unless_given: ClassVar[frozenset[str]] = frozenset()

    def model_post_init(self, context: Any, /) -> None:
        self.model_fields_set.update(set(type(self).model_fields) - self._omit_unless_given)


# -- errors ---------------------------------------------------------------------------------
class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


class AnthropicErrorResponse(ResponseModel):
    """Anthropic's error shape around OpenAI's four keys: a client of either API reads it."""

    type: Literal["error"] = "error"
    error: ErrorInfo


# -- models ---------------------------------------------------------------------------------
class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "moe-serve"
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- shared request parts -------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class ResponseFormat(OpenAIBaseModel):
    type: str
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict"} with type json_schema


class SamplingControls(OpenAIBaseModel):
    """Sampling fields every generating request takes, whatever its API (the Responses API has none of
    these; we take them there too, as vLLM does)."""

    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None


class SamplingRequest(SamplingControls):
    """The sampling fields chat and completions share (OpenAI's plus vLLM's common extensions)."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False  # some clients send null for the defaults
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = 1

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        """(param, refused?, why) for each field we know but cannot honour, alone or in this combination."""
        return []

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _top_logprobs(self) -> int | None:
        return None

    def _prompt_logprobs(self) -> int | None:
        return None

    def _request_param(self, param: str | None) -> str | None:
        """The request field that set the SamplingParams field `param` (for error messages)."""
        return param

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the model's values for the fields the request leaves out."""
        if not 1 <= self.num_choices <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}]", param="n")
        for param, refused, why in self._unsupported():
            if refused:
                raise InvalidRequestError(f"'{param}' cannot be used here: {why}", param=param)
        try:
            return self._sampling_params(defaults or {})
        except InvalidRequestError as e:
            param = self._request_param(e.param)
            message = str(e) if param == e.param else str(e).replace(e.param, param, 1)
            raise InvalidRequestError(message, param=param, code=e.code) from None

    def _sampling_params(self, defaults: Mapping[str, Any]) -> SamplingParams:
        given = {
            "max_tokens": self._max_tokens(),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()) or None,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": _token_bias(self.logit_bias),
            "top_logprobs": self._top_logprobs(),
            "prompt_logprobs": self._prompt_logprobs(),
            "ignore_eos": self.ignore_eos,
        }
        return SamplingParams(**{**defaults, **{k: v for k, v in given.items() if v is not None}})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    try:
        return {int(token): float(value) for token, value in bias.items()}
    except ValueError:
        raise InvalidRequestError("logit_bias keys must be token ids (integers)", param="logit_bias") from None


# -- tool calling ---------------------------------------------------------------------------
class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCallIn(OpenAIBaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class ToolCallIn(OpenAIBaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionCallOut(ResponseModel):
    name: str
    arguments: str


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaFunctionCall(ResponseModel):
    _omit_unless_given = frozenset({"name", "arguments"})
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    _omit_unless_given = frozenset({"id", "type"})  # only on a call's first chunk
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


# -- chat completions -----------------------------------------------------------------------
class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an assistant turn's thinking, as this server returned it
    reasoning: str | None = None  # the same, under vLLM's newer name

    def text(self) -> str:
        """The content's text (its text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""

    def to_engine(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = [part.model_dump(exclude_none=True) for part in content]
        message = {"role": self.role, "content": "" if content is None else content}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        if self.role == "assistant" and (self.reasoning_content or self.reasoning):
            message["reasoning_content"] = self.reasoning_content or self.reasoning
        if self.role == "tool":
            message.update(tool_call_id=self.tool_call_id, name=self.name)
        return message


def continues_final_message(messages: list[ChatMessage], asked: bool | None) -> bool:
    """Whether the prompt continues the last message instead of opening a new assistant turn. Unset (`asked`
    None), it does when that message is an assistant's with text and no tool calls (a partial answer: Open
    WebUI's "Continue Response" sends one, a prefill), as Ollama and llama.cpp's server do: a new turn after a
    partial answer repeats or contradicts it. `continue_final_message: false` opens a new turn (vLLM's
    default)."""
    last = messages[-1] if messages else None
    partial = last is not None and last.role == "assistant" and not last.tool_calls and bool(last.text().strip())
    if asked and not partial:
        raise InvalidRequestError("continue_final_message needs a last message from the assistant with text "
                                  "to continue", param="continue_final_message")
    return partial if asked is None else asked


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    response_format: ResponseFormat | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. enable_thinking
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # a template variable (GPT-OSS)
    thinking_token_budget: int | None = Field(default=None, ge=0)  # vLLM's: tokens of thinking, then it is closed
    continue_final_message: bool | None = None  # vLLM's; None: see continues_final_message()
    add_generation_prompt: bool | None = None  # vLLM's: false goes with continue_final_message

    def continues_final_message(self) -> bool:
        return continues_final_message(self.messages, self.continue_final_message)

    def template_kwargs(self) -> dict[str, Any] | None:
        """The template's extra variables: `chat_template_kwargs`, and `reasoning_effort` unless they set it."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        return super()._unsupported() + [
            ("functions", bool(self.functions), "the legacy `functions` are not supported; send `tools`"),
            ("chat_template", self.chat_template is not None, "the chat template comes from the model"),
            ("add_generation_prompt", self.add_generation_prompt is not None
             and self.add_generation_prompt == self.continues_final_message(),
             "it is the opposite of continue_final_message: a prompt opens the assistant's turn or continues it"),
            ("top_logprobs", self.top_logprobs is not None and not self.logprobs,
             "top_logprobs needs logprobs: true"),
        ]

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _request_param(self, param: str | None) -> str | None:
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return param

    def engine_messages(self) -> list[dict[str, Any]]:
        return [message.to_engine() for message in self.messages]


class ChatLogprobTop(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)

    @classmethod
    def of(cls, lp: TokenLogprob) -> ChatLogprobToken:
        """A generated token as chat's `logprobs.content[]` (and the Responses' `output_text.logprobs[]`)."""
        return cls(token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode()),
                   top_logprobs=[ChatLogprobTop(token=t.token, logprob=t.logprob, bytes=list(t.token.encode()))
                                 for t in lp.top])


class ChatChoiceLogprobs(ResponseModel):
    content: list[ChatLogprobToken] | None = None
    refusal: list[ChatLogprobToken] | None = None

    @classmethod
    def of(cls, logprobs: list[TokenLogprob]) -> ChatChoiceLogprobs:
        return cls(content=[ChatLogprobToken.of(lp) for lp in logprobs], refusal=None)


class AssistantMessage(ResponseModel):
    _omit_unless_given = frozenset({"reasoning_content", "reasoning", "tool_calls"})
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # as in DeltaMessage
    reasoning: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class CompletionTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0  # read from a kept KV cache (--prefix-cache), not computed


class UsageInfo(ResponseModel):
    _omit_unless_given = frozenset({"completion_tokens_details"})  # only where a reasoning parser read the output
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    completion_tokens_details: CompletionTokensDetails | None = None


class ChatCompletionChoice(ResponseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(ResponseModel):
    _omit_unless_given = frozenset({"role", "content", "reasoning_content", "reasoning", "tool_calls"})  # the last chunk's delta is {}
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking (DeepSeek's name; vLLM's older one)
    reasoning: str | None = None  # the same (vLLM's newer name)
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(ResponseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionStreamResponse(ResponseModel):
    _omit_unless_given = frozenset({"usage"})  # only on the usage chunk
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# -- completions ----------------------------------------------------------------------------
class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions
    logprobs: int | None = None
    echo: bool | None = False  # the text starts with the prompt (and logprobs with the prompt's)
    suffix: str | None = None  # fill-in-the-middle: `prompt` is the code before the cursor, this the code after
    best_of: int | None = None

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        return super()._unsupported() + [
            ("suffix", self.suffix is not None and self.text_prompt() is None,
             "a suffix (fill-in-the-middle) takes one prompt, as text: the code before the cursor"),
            ("echo", bool(self.echo) and self.suffix is not None,
             "echo cannot be combined with a suffix (fill-in-the-middle)"),
            ("best_of", self.best_of not in (None, 1), "only best_of=1 is supported"),
        ]

    def _sampling_params(self, defaults: Mapping[str, Any]) -> SamplingParams:
        # the completion's text goes on from the prompt's: its first word keeps its leading space
        return replace(super()._sampling_params(defaults), text_continues_prompt=True)

    def _top_logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        """The prompt's logprobs are computed for echo with logprobs, and for echo with max_tokens 0 (as
        vLLM takes it: only the prompt is read, which the engine allows only when it scores the prompt)."""
        if not self.echo:
            return None
        if self.logprobs is None and self.max_tokens == 0:
            return 0
        return self.logprobs

    def _request_param(self, param: str | None) -> str | None:
        return {"top_logprobs": "logprobs", "prompt_logprobs": "logprobs"}.get(param, param)

    def text_prompt(self) -> str | None:
        """The prompt when it is one text (alone or in a one-element batch), else None."""
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else None

    def prompts(self) -> list[str | list[int]]:
        """The batch's prompts, each as text or token ids; a lone text or token-id list is a batch of one."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt is an empty list: send at least one prompt", param="prompt")
        if len(prompt) > MAX_BATCH:
            raise InvalidRequestError(f"at most {MAX_BATCH} prompts in a batch (got {len(prompt)})", param="prompt")
        return list(prompt)


class CompletionLogprobs(ResponseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    @classmethod
    def of(cls, logprobs: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        out = cls()
        for lp in logprobs:
            out.tokens.append(lp.token)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({t.token: t.logprob for t in lp.top})
            out.text_offset.append(offset)
            offset += len(lp.token)
        return out

    @classmethod
    def of_prompt(cls, logprobs: Sequence[TokenLogprob | None], tokens: Sequence[str],
                  offsets: Sequence[int]) -> CompletionLogprobs:
        """An echoed prompt's: `tokens` its tokens' texts, `offsets` where each starts in the echoed text;
        the first token (None in `logprobs`: nothing predicts it) has no logprob, as OpenAI sends it."""
        return cls(tokens=list(tokens), text_offset=list(offsets),
                   token_logprobs=[None if lp is None else lp.logprob for lp in logprobs],
                   top_logprobs=[None if lp is None else {t.token: t.logprob for t in lp.top}
                                 for lp in logprobs])

    def followed_by(self, other: CompletionLogprobs) -> CompletionLogprobs:
        return CompletionLogprobs(tokens=self.tokens + other.tokens,
                                  token_logprobs=self.token_logprobs + other.token_logprobs,
                                  top_logprobs=self.top_logprobs + other.top_logprobs,
                                  text_offset=self.text_offset + other.text_offset)


class CompletionChoice(ResponseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(ResponseModel):
    _omit_unless_given = frozenset({"usage"})  # streamed chunks carry it only on the usage chunk
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


CompletionStreamResponse = CompletionResponse  # OpenAI streams the same object, one piece at a time


# -- /tokenize, /detokenize (vLLM's and llama.cpp's, for clients that count tokens) ----------------
class TokenizeRequest(OpenAIBaseModel):
    """A completion prompt (its ids as /v1/completions sees them) or chat messages (through the model's
    chat template, with the generation prompt, as /v1/chat/completions sees them); or llama.cpp's `content`
    (its own tokens, the BOS only with `add_special`), answered in llama.cpp's shape."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, max_length=MAX_MESSAGES)
    content: str | None = None
    add_special: bool = False
    with_pieces: bool = False
    continue_final_message: bool | None = None  # with `messages`, as a chat request reads them


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str

