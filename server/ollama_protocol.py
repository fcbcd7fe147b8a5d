"""Ollama's native API wire types (`/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`, `/api/tags`,
`/api/show`, `/api/ps`, `/api/version`), in Ollama's shapes (docs/api.md of ollama/ollama).

Requests are read as OpenAI's are (`OpenAIBaseModel`: unknown fields logged and ignored, strict
types). What this server cannot take (images, a request's `template`) parses here and is refused, by name,
in server/ollama_messages.py, which translates a request to chat.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from server.protocol import MAX_MESSAGES, MAX_TOOLS, FunctionDefinition, OpenAIBaseModel, ResponseModel

Think = bool | Literal["low", "medium", "high"]
Format = Literal["", "json"] | dict[str, Any]  # "json", or a JSON schema


# -- requests -------------------------------------------------------------------------------
class Options(OpenAIBaseModel):
    """The sampling options, and `num_ctx` (on `/api/chat`: the context its history is cut to, see
    server/ollama_context.py); Ollama's other runtime options (`num_gpu`, `num_thread`, ...) mean nothing
    here: they are ignored, and logged, as any unknown field."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    num_predict: int | None = None  # -1 (or any negative): no limit
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)  # an object, not OpenAI's JSON string
    index: int | None = None


class ToolCall(OpenAIBaseModel):
    function: FunctionCall


class Message(OpenAIBaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None  # refused: this server reads text only
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_name: str | None = None  # a tool turn: the tool it answers for
    thinking: str | None = None  # an assistant turn's reasoning


class Tool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class GeneratingRequest(OpenAIBaseModel):
    """The fields `/api/chat` and `/api/generate` share."""

    model: str = Field(min_length=1)
    format: Format | None = None
    options: Options | None = None
    stream: bool | None = True  # Ollama streams unless told not to (null too)
    think: Think | None = None
    keep_alive: str | int | float | None = None  # the model stays loaded anyway

    @property
    def streams(self) -> bool:
        return self.stream is not False

    @property
    def unloads(self) -> bool:
        """`keep_alive` 0: Ollama's clients unload a model so (this server keeps it)."""
        return self.keep_alive in (0, "0", "0s")


class ChatRequest(GeneratingRequest):
    messages: list[Message] = Field(default_factory=list, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    truncate: bool | None = True  # drop the oldest messages where the prompt is longer than the context


class GenerateRequest(GeneratingRequest):
    prompt: str | None = ""
    system: str | None = None
    suffix: str | None = None  # fill-in-the-middle: `prompt` is the code before the cursor, this the code after
    images: list[str] | None = None  # refused
    raw: bool | None = False
    template: str | None = None  # refused: the template comes from the model
    context: list[int] | None = None  # deprecated by Ollama; ignored (logged)


class EmbedRequest(OpenAIBaseModel):
    """`/api/embed`: one text or several; an input longer than the context is cut to it unless `truncate` is
    false. An empty list embeds nothing (a client loading the model)."""

    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None
    options: Options | None = None  # nothing in them changes an embedding: ignored
    keep_alive: str | int | float | None = None  # the model stays loaded anyway


class EmbeddingsRequest(OpenAIBaseModel):
    """`/api/embeddings` (Ollama's older route): one `prompt`; its vector is not normalized. An empty prompt
    embeds nothing (a client loading the model)."""

    model: str = Field(min_length=1)
    prompt: str = ""
    options: Options | None = None
    keep_alive: str | int | float | None = None


class ShowRequest(OpenAIBaseModel):
    model: str | None = None
    name: str | None = None  # the older name of `model`
    verbose: bool | None = None


# -- responses ------------------------------------------------------------------------------
class Details(ResponseModel):
    parent_model: str = ""
    format: str = "safetensors"
    family: str = ""
    families: list[str] = Field(default_factory=list)
    parameter_size: str = ""
    quantization_level: str = ""


class ModelEntry(ResponseModel):
    """A model in `/api/tags` (and, with `expires_at`, `size_vram` and `context_length`, in `/api/ps`)."""

    _omit_unless_given = frozenset({"modified_at", "expires_at", "size_vram", "context_length"})
    name: str
    model: str
    modified_at: str | None = None
    size: int = 0
    digest: str = ""
    details: Details
    expires_at: str | None = None
    size_vram: int | None = None
    context_length: int | None = None


class ModelList(ResponseModel):
    models: list[ModelEntry]


class ShowResponse(ResponseModel):
    modelfile: str = ""
    parameters: str = ""
    template: str = ""
    details: Details
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class VersionResponse(ResponseModel):
    version: str  # the Ollama API this server speaks: clients check it (VS Code Copilot wants >= 0.6.4)
    moe_serve_version: str


class FunctionCallOut(ResponseModel):
    name: str
    arguments: dict[str, Any]


class ToolCallOut(ResponseModel):
    function: FunctionCallOut


class MessageOut(ResponseModel):
    _omit_unless_given = frozenset({"thinking", "tool_calls"})
    role: Literal["assistant"] = "assistant"
    content: str = ""
    thinking: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class _Reply(ResponseModel):
    """The counts and durations (nanoseconds) are on a finished answer's last object only."""

    _omit_unless_given = frozenset({"done_reason", "total_duration", "load_duration", "prompt_eval_count",
                                    "prompt_eval_duration", "eval_count", "eval_duration"})
    model: str
    created_at: str
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class ChatReply(_Reply):
    """A whole `/api/chat` answer, or one line of its stream."""

    message: MessageOut


class GenerateReply(_Reply):
    """A whole `/api/generate` answer, or one line of its stream."""

    _omit_unless_given = _Reply._omit_unless_given | {"thinking"}
    response: str = ""
    thinking: str | None = None


class EmbedReply(ResponseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int = 0
    prompt_eval_count: int


class EmbeddingsReply(ResponseModel):
    embedding: list[float]


class ErrorResponse(ResponseModel):
    error: str

