"""An Ollama `/api/chat` or `/api/generate` request as the chat request it means, so that it runs
through the same chat pipeline (`plan_chat`: tools, reasoning, the model's template) as
`/v1/chat/completions`.

- `options` are chat's sampling fields: `num_predict` is `max_tokens` (negative: no limit),
  `repeat_penalty` is `repetition_penalty`; runtime options (`num_gpu`, ...) are ignored and logged.
  `num_ctx` (and `truncate`) are `/api/chat`'s: how its history is cut to fit (server/ollama_context.py);
  `/api/generate` ignores `num_ctx` (logged).
- `format` "json" is a `json_object` response format, a JSON schema a `json_schema` one.
- `think` true/false is the template's `enable_thinking`; "low"/"medium"/"high" also `reasoning_effort`.
- An assistant turn's `tool_calls` (arguments an object) become chat's (a JSON string, with ids), its
  `thinking` its `reasoning_content`; a `tool` turn answers the first unanswered call of its
  `tool_name` (else the next unanswered one).
- `/api/generate` is one user turn (after `system`); with `raw` the prompt is encoded as it is; with a
  `suffix` (`raw` or not) the prompt and suffix are the code around the cursor, completed between them with
  the model's fill-in-the-middle tokens (`system` ignored, logged).
- Refused with a 400 that names them: images, a `template` of the request's own.
"""

from __future__ import annotations

import json
import logging

from engine.api import InvalidRequestError
from server import protocol as p
from server.ollama_protocol import ChatRequest, GenerateRequest, GeneratingRequest, Message, Options

log = logging.getLogger(__name__)

OUTPUT_SCHEMA_NAME = "output"  # chat names its schema; Ollama's has no name
OPTION_OF_PARAM = {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty"}


class TranslatedChatRequest(p.ChatCompletionRequest):
    """A chat request read from an Ollama request: its sampling errors name Ollama's `options`."""

    def _request_param(self, param: str | None) -> str | None:
        return None if param is None else f"options.{OPTION_OF_PARAM.get(param, param)}"


def chat_request(body: ChatRequest) -> p.ChatCompletionRequest:
    """The chat request `/api/chat`'s `body` means."""
    for i, message in enumerate(body.messages):
        _refuse_images(message.images, f"messages[{i}].images")
    tools = [p.ToolDefinition(type="function", function=tool.function) for tool in body.tools or []]
    return _translated(body, _chat_messages(body.messages), tools or None)


def generate_request(body: GenerateRequest) -> p.ChatCompletionRequest:
    """The chat request `/api/generate`'s `body` means (with `raw` or a `suffix`, only its sampling is read)."""
    _refuse_images(body.images, "images")
    if body.suffix and body.system:
        log.info("ignoring `system` on /api/generate with a suffix: fill-in-the-middle takes only the code")
    if body.template:
        raise InvalidRequestError("'template' is not supported by this server: the chat template comes from the "
                                  "model", param="template")
    if body.context:
        log.info("ignoring the deprecated `context` of /api/generate: send the conversation to /api/chat")
    if body.options is not None and body.options.num_ctx is not None:
        log.info("ignoring options.num_ctx on /api/generate: the prompt is not cut to fit")
    system = [p.ChatMessage(role="system", content=body.system)] if body.system else []
    return _translated(body, system + [p.ChatMessage(role="user", content=body.prompt or "")], None)


def _translated(body: GeneratingRequest, messages: list[p.ChatMessage],
                tools: list[p.ToolDefinition] | None) -> p.ChatCompletionRequest:
    fields: dict = {"model": body.model, "messages": messages, "tools": tools, "stream": body.streams,
                    **_sampling(body.options or Options()), **_thinking(body.think)}
    response_format = _response_format(body.format)
    if response_format is not None:
        fields["response_format"] = response_format
    return TranslatedChatRequest(**fields)


def _refuse_images(images: list[str] | None, param: str) -> None:
    if images:
        raise InvalidRequestError(f"{param}: images are not supported by this server (it serves a text-only model)",
                                  param=param)


def _sampling(options: Options) -> dict:
    if options.ignored_fields:
        log.info("ignoring Ollama options this server does not use: %s", ", ".join(options.ignored_fields))
    given = {
        "temperature": options.temperature, "top_p": options.top_p, "top_k": options.top_k, "min_p": options.min_p,
        "seed": options.seed, "stop": options.stop, "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty, "repetition_penalty": options.repeat_penalty,
        "max_tokens": None if options.num_predict is None or options.num_predict < 0 else options.num_predict,
    }
    return {key: value for key, value in given.items() if value is not None}


def _thinking(think: bool | str | None) -> dict:
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"chat_template_kwargs": {"enable_thinking": think}}
    return {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": think}


def _response_format(format_: str | dict | None) -> p.ResponseFormat | None:
    if not format_:
        return None
    if format_ == "json":
        return p.ResponseFormat(type="json_object")
    return p.ResponseFormat(type="json_schema", json_schema={"name": OUTPUT_SCHEMA_NAME, "schema": format_})


def _chat_messages(messages: list[Message]) -> list[p.ChatMessage]:
    """Chat's messages; each call gets an id, and each tool answer the id of the call it answers."""
    unanswered: list[tuple[str, str]] = []  # (id, name) of the calls of the last assistant turn
    chat = []
    for i, message in enumerate(messages):
        if message.role == "assistant":
            calls = [p.ToolCallIn(id=f"call_{i}_{j}", function=p.FunctionCallIn(
                name=call.function.name, arguments=json.dumps(call.function.arguments)))
                for j, call in enumerate(message.tool_calls or [])]
            unanswered = [(call.id, call.function.name) for call in calls]
            chat.append(p.ChatMessage(role="assistant", content=message.content or (None if calls else ""),
                                      tool_calls=calls or None, reasoning_content=message.thinking or None))
        elif message.role == "tool":
            call_id = _answered_call(unanswered, message.tool_name)
            chat.append(p.ChatMessage(role="tool", content=message.content or "", tool_call_id=call_id,
                                      name=message.tool_name))
        else:
            chat.append(p.ChatMessage(role=message.role, content=message.content or ""))
    return chat


def _answered_call(unanswered: list[tuple[str, str]], tool_name: str | None) -> str | None:
    """The id of the call a tool turn answers (removed from `unanswered`); None when there is none."""
    for k, (call_id, name) in enumerate(unanswered):
        if tool_name is None or name == tool_name:
            del unanswered[k]
            return call_id
    return unanswered.pop(0)[0] if unanswered else None
