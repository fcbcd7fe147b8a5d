"""The Responses API (`/v1/responses`) translated into the chat pipeline: a `ResponsesRequest` becomes a
`ChatCompletionRequest` (input items -> chat messages, tools -> chat functions (`responses_tools`), `text.format` ->
`response_format`), and errors the chat pipeline raises name the Responses request's fields.

Stored responses (`store`, the default) are kept in memory, the most recent `STORED_RESPONSES` within
`STORED_BYTES`, each with its conversation as input items, so that `previous_response_id` continues it.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from engine.api import ContextLengthError, InvalidRequestError
from server import protocol as p
from server import responses_protocol as rp
from server.errors import APIError
from server.responses_tools import ResponseTools, chat_tool_name, custom_arguments

STORED_RESPONSES = 128
STORED_BYTES = 64 * 2**20
TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")
# chat request fields -> the Responses fields they came from (a prefix match: `messages[2].content`)
CHAT_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format.json_schema.schema": "text.format.schema",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "grammar": "text.format",
}


# -- the conversation store -----------------------------------------------------------------
@dataclass
class StoredResponse:
    response: rp.ResponseObject
    conversation: list[rp.InputItem]  # every turn up to and including this response's output

    def size(self) -> int:
        """Its bytes as JSON: what the store's budget counts (a chain of follow-ups repeats its history)."""
        return len(self.response.model_dump_json()) + sum(len(item.model_dump_json()) for item in self.conversation)


class ResponseStore:
    """Finished responses by id, least recently used dropped first (in memory: lost on restart): at most
    `capacity` of them and `max_bytes` of JSON in all (a request body may hold 4 MiB)."""

    def __init__(self, capacity: int = STORED_RESPONSES, max_bytes: int = STORED_BYTES) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self.bytes = 0

    def put(self, entry: StoredResponse) -> None:
        self.delete(entry.response.id)
        size = entry.size()
        self._entries[entry.response.id] = (entry, size)
        self.bytes += size
        while len(self._entries) > self.capacity or (self.bytes > self.max_bytes and len(self._entries) > 1):
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped

    def get(self, response_id: str) -> StoredResponse | None:
        if response_id not in self._entries:
            return None
        self._entries.move_to_end(response_id)
        return self._entries[response_id][0]

    def delete(self, response_id: str) -> bool:
        removed = self._entries.pop(response_id, None)
        if removed is not None:
            self.bytes -= removed[1]
        return removed is not None


def response_not_found(response_id: str, param: str | None = None) -> APIError:
    code = "previous_response_not_found" if param else "not_found"
    return APIError(404, f"Response with id '{response_id}' not found.", param=param, code=code)


@dataclass(frozen=True)
class Conversation:
    earlier: list[rp.InputItem]  # the stored turns `previous_response_id` continues
    new: list[rp.InputItem]  # this request's input

    @property
    def items(self) -> list[rp.InputItem]:
        return self.earlier + self.new


def conversation_of(body: rp.ResponsesRequest, store: ResponseStore) -> Conversation:
    """The earlier turns (from `previous_response_id`) and this request's input."""
    if not body.input:
        raise InvalidRequestError("input must not be empty", param="input")
    items = [rp.InputItem(role="user", content=body.input)] if isinstance(body.input, str) else list(body.input)
    if body.previous_response_id is None:
        return Conversation([], items)
    previous = store.get(body.previous_response_id)
    if previous is None:
        raise response_not_found(body.previous_response_id, param="previous_response_id")
    return Conversation(previous.conversation, items)


def as_input_items(output: list[rp.OutputItem]) -> list[rp.InputItem]:
    """A response's output as it is sent back as input (the next turn's history)."""
    return [rp.InputItem.model_validate(item.model_dump()) for item in output]


# -- request translation --------------------------------------------------------------------
def refuse_unsupported(body: rp.ResponsesRequest) -> None:
    if body.background:
        raise InvalidRequestError("background responses are not supported by this server", param="background")


def to_chat_request(body: rp.ResponsesRequest, conversation: Conversation, tools: ResponseTools,
                    ) -> p.ChatCompletionRequest:
    """The chat request that means the same (`tools`: the request's, as `response_tools` read them)."""
    refuse_unsupported(body)
    messages = ([p.ChatMessage(role="system", content=body.instructions)] if body.instructions else [])
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages + chat_messages(conversation.items, len(conversation.earlier)),
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        **{name: getattr(body, name) for name in p.SamplingControls.model_fields}, "user": body.user,
        "tools": tools.functions or None, "tool_choice": _chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls, "response_format": _response_format(body.text),
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
        "chat_template_kwargs": body.chat_template_kwargs, **_logprob_fields(body),
        "continue_final_message": False,  # an input that ends with the assistant's message gets a new turn
    }
    with chat_errors():
        try:
            return p.ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:  # a check only the chat request makes (its lengths)
            error = e.errors()[0]
            param = ".".join(str(part) for part in error["loc"]) or None
            raise InvalidRequestError(f"{param}: {error['msg']}", param=param) from None


def _logprob_fields(body: rp.ResponsesRequest) -> dict[str, Any]:
    """The chat request's logprobs: asked for `top_logprobs` alone too, so that the engine checks its range
    (the format shows them only where `include` asks)."""
    if not body.wants_logprobs and body.top_logprobs is None:
        return {}
    return {"logprobs": True, "top_logprobs": body.top_logprobs}


def chat_messages(items: list[rp.InputItem], first_input: int = 0) -> list[p.ChatMessage]:
    """Input items as chat turns: consecutive function calls join one assistant turn (with the text
    before them), a call's output is a tool turn, a reasoning item is the next assistant turn's thinking.
    `first_input`: the index of the first item of the request's `input` (for errors)."""
    messages: list[p.ChatMessage] = []
    thought: str | None = None
    names: dict[str, str] = {}  # call id -> function name, for the tool turns
    for index, item in enumerate(items):
        where = f"input[{index - first_input}]"
        kind = item.type or "message"
        if kind == "reasoning":
            thought = (thought or "") + _text(item.content or item.summary or [], f"{where}.content")
        elif kind == "message":
            if item.role is None:
                raise InvalidRequestError(f"{where}.role is required for a message", param=f"{where}.role")
            message = p.ChatMessage(role=item.role, content=_text(item.content or "", f"{where}.content"))
            if item.role == "assistant" and thought:
                message.reasoning_content, thought = thought, None
            messages.append(message)
        elif kind in ("function_call", "custom_tool_call"):
            call = _tool_call(item, where)
            names[call.id] = call.function.name
            last = messages[-1] if messages else None
            if last is None or last.role != "assistant":  # else the call joins the assistant's turn
                last = p.ChatMessage(role="assistant", content=None, tool_calls=[])
                messages.append(last)
            last.tool_calls = (last.tool_calls or []) + [call]
            if thought:
                last.reasoning_content, thought = thought, None
        else:  # function_call_output, custom_tool_call_output
            if not item.call_id:
                raise InvalidRequestError(f"{where}.call_id is required", param=f"{where}.call_id")
            output = _text(item.output if item.output is not None else "", f"{where}.output")
            messages.append(p.ChatMessage(role="tool", tool_call_id=item.call_id, name=names.get(item.call_id),
                                          content=output))
    return messages


def _tool_call(item: rp.InputItem, where: str) -> p.ToolCallIn:
    """A function or custom tool call as the chat tool call the model wrote for it."""
    for field in ("call_id", "name"):
        if not getattr(item, field):
            raise InvalidRequestError(f"{where}.{field} is required for a {item.type}", param=f"{where}.{field}")
    arguments = custom_arguments(item.input or "") if item.type == "custom_tool_call" else item.arguments or "{}"
    name = chat_tool_name(item.name, item.namespace)
    return p.ToolCallIn(id=item.call_id, function=p.FunctionCallIn(name=name, arguments=arguments))


def _text(content: str | list[rp.InputContentPart], where: str) -> str:
    if isinstance(content, str):
        return content
    for index, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise InvalidRequestError(f"{where}[{index}]: only text parts are supported (got {part.type!r})",
                                      param=f"{where}[{index}]")
    return "".join(part.text for part in content)


def _chat_tool_choice(choice: str | rp.NamedFunction | None) -> str | p.NamedToolChoice | None:
    if isinstance(choice, rp.NamedFunction):
        return p.NamedToolChoice(type="function", function=p.FunctionName(name=choice.name))
    return choice


def _response_format(text: rp.TextConfig | None) -> p.ResponseFormat | None:
    if text is None or text.format is None:
        return None
    fmt = text.format
    if fmt.type != "json_schema":
        return p.ResponseFormat(type=fmt.type)
    if fmt.schema_ is None:
        raise InvalidRequestError("text.format json_schema needs a `schema` object", param="text.format.schema")
    return p.ResponseFormat(type="json_schema", json_schema={"name": fmt.name or "response", "schema": fmt.schema_,
                                                             "strict": fmt.strict})


# -- errors ---------------------------------------------------------------------------------
def responses_param(param: str | None) -> str | None:
    """The Responses field behind a chat request's field (messages -> input, ...)."""
    if param is None:
        return None
    for chat, ours in CHAT_PARAMS.items():
        if param == chat or param.startswith((f"{chat}.", f"{chat}[")):
            return ours if chat == "messages" else ours + param[len(chat):]
    return param


@contextlib.contextmanager
def chat_errors() -> Iterator[None]:
    """Errors of the chat pipeline, reported against the Responses request's fields."""
    try:
        yield
    except ContextLengthError as e:
        raise e.for_prompt("input") from None
    except InvalidRequestError as e:
        param = responses_param(e.param)
        if param == e.param:
            raise
        message = str(e).replace(e.param, param, 1) if e.param else str(e)
        raise InvalidRequestError(message, param=param, code=e.code) from None


# -- the response object --------------------------------------------------------------------
def response_shell(body: rp.ResponsesRequest, model: str) -> rp.ResponseObject:
    """The response as created: its id, and the request's settings echoed as OpenAI does."""
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, rp.NamedFunction) else body.tool_choice
    text_format = body.text.format if body.text is not None and body.text.format is not None else None
    return rp.ResponseObject(
        id=rp.item_id("resp"), model=model, instructions=body.instructions, max_output_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p,
        tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []], tool_choice=choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False,
        text={"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"}},
        reasoning={"effort": body.reasoning.effort if body.reasoning else None,
                   "summary": body.reasoning.summary if body.reasoning else None},
        previous_response_id=body.previous_response_id, store=body.store is not False, metadata=body.metadata or {},
        truncation=body.truncation or "disabled", user=body.user)


def keeper(body: rp.ResponsesRequest, store: ResponseStore, conversation: Conversation):
    """What stores a finished response with its conversation (None with `store: false`)."""
    if body.store is False:
        return None

    def keep(response: rp.ResponseObject) -> None:
        store.put(StoredResponse(response, conversation.items + as_input_items(response.output)))

    return keep
