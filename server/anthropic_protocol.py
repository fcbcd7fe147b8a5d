"""Anthropic Messages API wire types (`POST /v1/messages`, `/v1/messages/count_tokens`), in Anthropic's shapes.

Requests are read as OpenAI's are (`OpenAIBaseModel`: unknown fields logged and ignored, strict
types). Blocks this server cannot take (images, documents, Anthropic's server tools) parse here
and are refused, by name, in server/anthropic_messages.py, which translates a request to chat.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from server.protocol import MAX_MESSAGES, MAX_TOOLS, OpenAIBaseModel, ResponseModel

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


# -- request --------------------------------------------------------------------------------
class _Block(OpenAIBaseModel):
    cache_control: dict[str, Any] | None = None  # prompt caching hints: the prefix cache needs none


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Block):
    """An assistant turn's call."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    """A user turn's answer to a call."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | Annotated[list[TextBlock], Field(max_length=MAX_MESSAGES)] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str | None = None


class UnsupportedBlock(_Block):
    """Blocks Anthropic takes and this server cannot: parsed so that the refusal can name them."""

    type: Literal["image", "document", "search_result", "server_tool_use", "web_search_tool_result",
                  "container_upload"]


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
                         | UnsupportedBlock, Field(discriminator="type")]


class MessageParam(OpenAIBaseModel):
    # "system": an instruction given mid-conversation (Claude Code sends these, beta
    # mid-conversation-system-2026-04-07); text only
    role: Literal["user", "assistant", "system"]
    content: str | Annotated[list[ContentBlock], Field(max_length=MAX_MESSAGES)]


class ToolParam(OpenAIBaseModel):
    """A client tool; one with a `type` other than "custom" is one of Anthropic's server tools."""

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with "tool"
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(OpenAIBaseModel):
    type: Literal["enabled", "adaptive", "disabled"]
    # with "enabled": the thinking is closed after this many tokens. Anthropic's minimum of 1024 is not kept:
    # a local model thinks a few tokens per second, so smaller budgets are worth having
    budget_tokens: int | None = Field(default=None, ge=1)


class OutputFormat(OpenAIBaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")  # `schema` would shadow BaseModel's


class OutputConfig(OpenAIBaseModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(OpenAIBaseModel):
    """What a message request's prompt is made of (`/v1/messages/count_tokens` takes just this)."""

    model: str | None = None  # None: the served model
    messages: list[MessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_MESSAGES)] | None = None
    tools: list[ToolParam] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int  # required, as Anthropic's API has it
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None  # `user_id`: nothing here uses it


# -- response -------------------------------------------------------------------------------
class TextOut(ResponseModel):
    _omit_unless_given = frozenset({"citations"})
    type: Literal["text"] = "text"
    text: str
    citations: list | None = None


class ThinkingOut(ResponseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # nothing signs the thinking; a client sends it back as it got it


class ToolUseOut(ResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentOut = TextOut | ThinkingOut | ToolUseOut


class MessageUsage(ResponseModel):
    input_tokens: int = 0  # the prompt's tokens computed, not those read from the prefix cache
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


# -- stream events --------------------------------------------------------------------------
class MessageStart(ResponseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStart(ResponseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentOut


class TextDelta(ResponseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(ResponseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJsonDelta(ResponseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDelta(ResponseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(ResponseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopInfo(ResponseModel):
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class MessageDelta(ResponseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: StopInfo
    usage: MessageUsage  # totals: the prefix cache's share of the prompt is known only now


class MessageStop(ResponseModel):
    type: Literal["message_stop"] = "message_stop"


class CountTokensResponse(ResponseModel):
    input_tokens: int
