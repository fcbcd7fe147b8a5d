"""OpenAI Responses API wire types (`/v1/responses`): the request, the response object, its output
items and its stream events, in the shapes the openai SDK parses (`openai.types.responses`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from server import protocol as p

MAX_INPUT_ITEMS = p.MAX_MESSAGES
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # `include`: each output_text carries its tokens' logprobs


def item_id(prefix: str) -> str:
    """OpenAI's id style for responses and items: `resp_...`, `msg_...`, `fc_...`."""
    return p.random_id(prefix).replace("-", "_", 1)


# -- request --------------------------------------------------------------------------------
class InputContentPart(p.OpenAIBaseModel):
    type: str  # input_text, output_text (text parts); anything else is refused
    text: str | None = None


Parts = Annotated[list[InputContentPart], Field(max_length=MAX_INPUT_ITEMS)]  # the limit is on lists, not text


class InputItem(p.OpenAIBaseModel):
    """One input item: a message (`type` may be omitted), a function or custom tool call, its output, or a
    reasoning item. Output items of an earlier response are valid input items as they are."""

    type: Literal["message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
                  "reasoning"] | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | Parts | None = None
    id: str | None = None
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None  # a call to a tool of a `namespace` tool
    arguments: str | None = None  # a function call's
    input: str | None = None  # a custom tool call's raw text
    output: str | Parts | None = None
    summary: Parts | None = None


class CustomToolFormat(p.OpenAIBaseModel):
    """What a custom (freeform) tool's input must be: any text, or text a grammar accepts."""

    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class RequestTool(p.OpenAIBaseModel):
    """A tool as the Responses API declares it: `function` (flat), `custom` (freeform text input),
    `namespace` (a group of those), or a tool hosted by OpenAI (`web_search`, ...), which is not run here."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    format: CustomToolFormat | None = None  # a custom tool's
    tools: list[RequestTool] | None = Field(default=None, max_length=p.MAX_TOOLS)  # a namespace's


class NamedFunction(p.OpenAIBaseModel):
    type: Literal["function", "custom"]
    name: str


class TextFormat(p.OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(p.OpenAIBaseModel):
    format: TextFormat | None = None


class ReasoningConfig(p.OpenAIBaseModel):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None


class ResponsesRequest(p.SamplingControls):
    model: str | None = None  # None: the served model
    input: str | Annotated[list[InputItem], Field(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    tools: list[RequestTool] | None = Field(default=None, max_length=p.MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # as the chat request's

    @property
    def wants_logprobs(self) -> bool:
        """Logprobs come back only where `include` asks (as OpenAI: `top_logprobs` alone gives none)."""
        return LOGPROBS_INCLUDE in (self.include or [])


# -- response -------------------------------------------------------------------------------
class OutputText(p.ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[p.ChatLogprobToken] = Field(default_factory=list)


class ReasoningText(p.ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class MessageItem(p.ResponseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: item_id("msg"))
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningItem(p.ResponseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: item_id("rs"))
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class FunctionCallItem(p.ResponseModel):
    _omit_unless_given = frozenset({"namespace"})
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: item_id("fc"))
    call_id: str
    name: str
    namespace: str | None = None
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


class CustomToolCallItem(p.ResponseModel):
    _omit_unless_given = frozenset({"namespace"})
    type: Literal["custom_tool_call"] = "custom_tool_call"
    id: str = Field(default_factory=lambda: item_id("ctc"))
    call_id: str
    name: str
    namespace: str | None = None
    input: str = ""


ToolCallItem = FunctionCallItem | CustomToolCallItem
OutputItem = MessageItem | ReasoningItem | FunctionCallItem | CustomToolCallItem


class InputTokensDetails(p.ResponseModel):
    cached_tokens: int = 0


class OutputTokensDetails(p.ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(p.ResponseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int = 0


class IncompleteDetails(p.ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(p.ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=p.now)
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    truncation: str = "disabled"
    user: str | None = None

    @property
    def output_text(self) -> str:
        return "".join(part.text for item in self.output if isinstance(item, MessageItem) for part in item.content)


class DeletedResponse(p.ResponseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


# -- stream events --------------------------------------------------------------------------
class StreamEvent(p.ResponseModel):
    """Every event carries its `type` (also the SSE event name) and its place in the stream."""

    type: str
    sequence_number: int


class ResponseEvent(StreamEvent):  # response.created, .in_progress, .completed, .incomplete
    response: ResponseObject


class ItemEvent(StreamEvent):  # response.output_item.added, .done
    output_index: int
    item: OutputItem


class ContentPartEvent(StreamEvent):  # response.content_part.added, .done
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(StreamEvent):  # response.output_text.delta
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[p.ChatLogprobToken] = Field(default_factory=list)


class TextDoneEvent(StreamEvent):  # response.output_text.done
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[p.ChatLogprobToken] = Field(default_factory=list)


class ReasoningDeltaEvent(StreamEvent):  # response.reasoning_text.delta
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningDoneEvent(StreamEvent):  # response.reasoning_text.done
    item_id: str
    output_index: int
    content_index: int
    text: str


class ArgumentsDeltaEvent(StreamEvent):  # response.function_call_arguments.delta
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(StreamEvent):  # response.function_call_arguments.done
    item_id: str
    output_index: int
    name: str
    arguments: str


class CustomInputDeltaEvent(StreamEvent):  # response.custom_tool_call_input.delta
    item_id: str
    output_index: int
    delta: str


class CustomInputDoneEvent(StreamEvent):  # response.custom_tool_call_input.done
    item_id: str
    output_index: int
    input: str


class ErrorEvent(StreamEvent):
    code: str | None = None
    message: str
    param: str | None = None
