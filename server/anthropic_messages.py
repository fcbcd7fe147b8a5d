"""An Anthropic Messages request as the chat request it means, so that it runs through the same chat
pipeline (`plan_chat`: tools, reasoning, the model's template) as `/v1/chat/completions`.

- `system` becomes a system message, as does a turn with the role "system" (an instruction given
  mid-conversation, which Claude Code sends) in its place; a user turn's `tool_result` blocks become `tool` messages (before
  the turn's text: templates expect them right after the calls), an assistant turn's `tool_use` blocks
  its `tool_calls` and its `thinking` its `reasoning_content` (`redacted_thinking` is dropped).
- `tool_choice` auto/any/tool/none is chat's auto/required/named/none; `disable_parallel_tool_use`
  is `parallel_tool_calls: false`; `thinking` enabled (or adaptive)/disabled is the template's
  `enable_thinking`, and an enabled one's `budget_tokens` chat's `thinking_token_budget`; `output_config`
  is chat's `response_format` (a JSON schema) and `reasoning_effort`.
- A final assistant turn is a prefill, as in Anthropic's API: the answer continues its text (chat's
  `continue_final_message`); one that holds no text to continue is a 400.
- Refused with a 400 that names them: images, documents and other blocks that are not text, and Anthropic's
  server tools (`web_search_...`).
"""

from __future__ import annotations

import json

from engine.api import InvalidRequestError
from server import protocol as p
from server.anthropic_protocol import (
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
    OutputConfig,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolParam,
    ToolResultBlock,
    ToolUseBlock,
    UnsupportedBlock,
)

INPUT_JOIN = "\n\n"  # between the text blocks of a user turn or the system prompt: separate pieces of input
CLIENT_TOOL_TYPES = (None, "custom")  # any other `type` names one of Anthropic's server tools
CHAT_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}
CHAT_EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
OUTPUT_SCHEMA_NAME = "output"  # chat names its schema; Anthropic's has no name
TOOL_ERROR_PREFIX = "Error: "  # a chat tool message has no is_error: the model reads it in the text


class TranslatedChatRequest(p.ChatCompletionRequest):
    """A chat request read from a Messages request: its sampling errors name the Messages fields."""

    def _request_param(self, param: str | None) -> str | None:
        return "stop_sequences" if param == "stop" else super()._request_param(param)


def to_chat_request(body: CountTokensRequest) -> p.ChatCompletionRequest:
    """The chat request `body` means; a `MessagesRequest` brings its sampling fields too."""
    _refuse_system_only(body.messages)
    messages = _system(body.system) + [m for i, turn in enumerate(body.messages) for m in _turn(turn, i)]
    prefill = body.messages[-1].role == "assistant"
    if prefill and (messages[-1].tool_calls or not messages[-1].text().strip()):
        raise InvalidRequestError("a last assistant turn is a prefill: it needs text to continue and no tool_use",
                                  param=f"messages[{len(body.messages) - 1}].content")
    fields: dict = {
        "model": body.model,
        "messages": messages,
        "tools": _tools(body.tools),
        "chat_template_kwargs": _thinking(body),
        "thinking_token_budget": _thinking_budget(body),
        **_tool_choice(body.tool_choice),
        **_output_config(body.output_config),
        "continue_final_message": prefill,
    }
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                      stop=body.stop_sequences, stream=body.stream)
    return TranslatedChatRequest(**fields)


def _refuse_system_only(messages: list[MessageParam]) -> None:
    if all(m.role == "system" for m in messages):
        raise InvalidRequestError("messages must hold a user turn (system turns alone ask nothing)",
                                  param="messages")


def _system(system: str | list[TextBlock] | None) -> list[p.ChatMessage]:
    text = system if isinstance(system, str) or system is None else INPUT_JOIN.join(b.text for b in system)
    return [p.ChatMessage(role="system", content=text)] if text else []


def _turn(turn: MessageParam, index: int) -> list[p.ChatMessage]:
    if isinstance(turn.content, str):
        return [p.ChatMessage(role=turn.role, content=turn.content)]
    where = f"messages[{index}].content"
    for j, block in enumerate(turn.content):
        _check_block(block, turn.role, f"{where}[{j}]")
    if turn.role == "system":
        return _system(turn.content)
    return [_assistant_turn(turn.content)] if turn.role == "assistant" else _user_turn(turn.content)


def _check_block(block, role: str, where: str) -> None:
    if isinstance(block, UnsupportedBlock):
        raise InvalidRequestError(f"{where}: '{block.type}' blocks are not supported by this server (only text, "
                                  "tool_use, tool_result and thinking)", param=where)
    allowed = {"assistant": (ToolUseBlock, ThinkingBlock, RedactedThinkingBlock), "user": (ToolResultBlock,)}.get(role, ())
    if not isinstance(block, (TextBlock, *allowed)):
        raise InvalidRequestError(f"{where}: a '{block.type}' block cannot be in a {role} turn", param=where)


def _user_turn(blocks: list) -> list[p.ChatMessage]:
    results = [_tool_message(b) for b in blocks if isinstance(b, ToolResultBlock)]
    text = INPUT_JOIN.join(b.text for b in blocks if isinstance(b, TextBlock))
    return results + ([p.ChatMessage(role="user", content=text)] if text or not results else [])


def _tool_message(block: ToolResultBlock) -> p.ChatMessage:
    content = block.content if isinstance(block.content, str) or block.content is None else (
        INPUT_JOIN.join(b.text for b in block.content))
    content = content or ""
    return p.ChatMessage(role="tool", tool_call_id=block.tool_use_id,
                         content=TOOL_ERROR_PREFIX + content if block.is_error else content)


def _assistant_turn(blocks: list) -> p.ChatMessage:
    calls = [p.ToolCallIn(id=b.id, function=p.FunctionCallIn(name=b.name, arguments=json.dumps(b.input)))
             for b in blocks if isinstance(b, ToolUseBlock)]
    thought = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))  # pieces of one output, as it was written
    return p.ChatMessage(role="assistant", content=text or (None if calls else ""), tool_calls=calls or None,
                         reasoning_content=thought or None)


def _tools(tools: list[ToolParam] | None) -> list[p.ToolDefinition] | None:
    if not tools:
        return None
    for i, tool in enumerate(tools):
        if tool.type not in CLIENT_TOOL_TYPES:
            raise InvalidRequestError(f"tools[{i}]: Anthropic's server tool '{tool.type}' is not supported by this "
                                      "server; define a client tool (name, description, input_schema)",
                                      param="tools")
    return [p.ToolDefinition(type="function", function=p.FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.input_schema)) for tool in tools]


def _tool_choice(choice: ToolChoice | None) -> dict:
    """Chat's `tool_choice` and `parallel_tool_calls` for Anthropic's `tool_choice`."""
    if choice is None:
        return {}
    fields: dict = {"parallel_tool_calls": False} if choice.disable_parallel_tool_use else {}
    if choice.type != "tool":
        return {**fields, "tool_choice": CHAT_TOOL_CHOICE[choice.type]}
    if not choice.name:
        raise InvalidRequestError("tool_choice of type 'tool' needs the tool's `name`", param="tool_choice.name")
    return {**fields, "tool_choice": p.NamedToolChoice(type="function", function=p.FunctionName(name=choice.name))}


def _thinking(body: CountTokensRequest) -> dict | None:
    """The template's `enable_thinking` (Qwen3 and others read it)."""
    return None if body.thinking is None else {"enable_thinking": body.thinking.type != "disabled"}


def _thinking_budget(body: CountTokensRequest) -> int | None:
    """An enabled thinking's `budget_tokens`, less than `max_tokens` as Anthropic requires (the thinking is
    part of the answer's tokens)."""
    if body.thinking is None or body.thinking.type != "enabled" or body.thinking.budget_tokens is None:
        return None
    budget = body.thinking.budget_tokens
    if isinstance(body, MessagesRequest) and budget >= body.max_tokens:
        raise InvalidRequestError(f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                                  f"({body.max_tokens})", param="thinking.budget_tokens")
    return budget


def _output_config(config: OutputConfig | None) -> dict:
    fields: dict = {}
    if config is not None and config.effort is not None:
        fields["reasoning_effort"] = CHAT_EFFORT[config.effort]
    if config is not None and config.format is not None:
        fields["response_format"] = p.ResponseFormat(type="json_schema", json_schema={
            "name": OUTPUT_SCHEMA_NAME, "schema": config.format.schema_})
    return fields
