"""Chat messages as a model's chat template takes them, tool calls and tool results included.

A template that can take tools gets the messages as transformers documents them (assistant
`tool_calls` with `arguments` as a mapping, `tool` messages with their `tool_call_id`). A
template that cannot gets a plain chat: the calls and their results written out as text.
DeepSeek-V3 and R1's templates render calls and tool results but not the tool list: they take
tools, and the server writes the list into the system message (`with_system_text`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.api import ChatTemplateInfo, InvalidRequestError

ROLES = ("system", "user", "assistant", "developer", "tool")
_TOOLS_VARIABLE = re.compile(r"\btools\b")  # how a template declares that it renders a tool list
_CALLS_ONLY_SIGNS = ("tool▁call▁begin",)  # templates that render calls, whose tool list goes in the system prompt


def template_info(template: str | dict[str, str] | None, model_type: str) -> ChatTemplateInfo:
    """What a tokenizer's chat template can do; `template` may be one or several named templates."""
    source = "\n".join(template.values()) if isinstance(template, dict) else template or ""
    supports = renders_tool_list(source) or any(sign in source for sign in _CALLS_ONLY_SIGNS)
    if isinstance(template, dict):  # e.g. {"default": ..., "tool_use": ...}
        supports = supports or "tool_use" in template
    return ChatTemplateInfo(supports_tools=supports, source=source, model_type=model_type)


def renders_tool_list(source: str) -> bool:
    """Whether a chat template's source renders the request's `tools` itself."""
    return bool(_TOOLS_VARIABLE.search(source))


def with_system_text(messages: list[dict], text: str) -> list[dict]:
    """`text` at the end of the leading system message (added first where there is none)."""
    if messages and messages[0].get("role") in ("system", "developer"):
        first = messages[0]
        content = _text(first.get("content"), "messages[0]", may_be_empty=True)
        return [{**first, "content": f"{content}\n\n{text}" if content else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


THOUGHT_KEYS = ("reasoning_content", "thinking")  # an assistant turn's thinking, as Qwen3's and GPT-OSS's templates name it


def prepare_messages(messages: list[dict], tool_template: bool) -> list[dict]:
    """Checked, normalised messages; for a template without tools, tool turns become plain text."""
    normalised = [_normalise(m, i) for i, m in enumerate(messages)]
    if not normalised:
        raise InvalidRequestError("messages must not be empty", param="messages")
    return normalised if tool_template else _as_plain_chat(normalised)


def _normalise(message: dict, index: int) -> dict:
    where = f"messages[{index}]"
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequestError(f"{where}.role must be system, user, assistant or tool", param=f"{where}.role")
    tool_calls = (message.get("tool_calls") or []) if role == "assistant" else []
    content = _text(message.get("content"), where, may_be_empty=bool(tool_calls))
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if tool_calls:
        out["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(tool_calls)]
    thought = message.get("reasoning_content")
    if role == "assistant" and isinstance(thought, str) and thought:
        out.update(dict.fromkeys(THOUGHT_KEYS, thought))
    if role == "tool":
        out["tool_call_id"] = str(message.get("tool_call_id") or "")
        if message.get("name"):
            out["name"] = str(message["name"])
    return out


def _text(content: Any, where: str, may_be_empty: bool) -> str:
    if content is None and may_be_empty:  # an assistant turn that only calls tools
        return ""
    if isinstance(content, list):
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidRequestError(_part_refusal(part, f"{where}.content[{i}]"), param=f"{where}.content")
        return "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise InvalidRequestError(f"{where}.content must be a string or text parts", param=f"{where}.content")
    return content


IMAGE_PARTS = {"image_url", "input_image", "image"}  # OpenAI's chat, its Responses, Anthropic's


def _part_refusal(part: Any, where: str) -> str:
    """Why a content part is refused: an image says so (a chat UI shows this text to its user, who attached
    one to a text-only model), any other part names its type."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in IMAGE_PARTS:
        return f"{where}: images are not supported by this server (it serves a text-only model); send text only"
    return f"{where}: only text parts are supported" + (f" (got {kind!r})" if isinstance(kind, str) else "")


def _tool_call(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', "
                                  "'arguments'}}}", param=where)
    return {"id": str(call.get("id") or ""), "type": "function",
            "function": {"name": function["name"], "arguments": _arguments(function.get("arguments"))}}


def _arguments(arguments: Any) -> Any:
    """OpenAI sends a JSON string; templates expect a mapping (Qwen's would quote the string again)."""
    if not isinstance(arguments, str):
        return arguments if arguments is not None else {}
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def _as_plain_chat(messages: list[dict]) -> list[dict]:
    """Tool calls as assistant text, tool results as user turns (merged with what follows, so that
    templates that insist on alternating roles still take them)."""
    out: list[dict] = []
    merge_next = False  # the last message is a tool result: a user turn that follows joins it
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "assistant" and message.get("tool_calls"):
            content = "\n".join([content] * bool(content) + [_call_text(c) for c in message["tool_calls"]])
        if role == "tool":
            role, content = "user", f"Result of tool call {message.get('name') or message['tool_call_id']}:\n{content}"
        if role == "user" and merge_next:
            out[-1]["content"] += "\n\n" + content
        else:
            out.append({**{k: v for k, v in message.items() if k in THOUGHT_KEYS}, "role": role, "content": content})
        merge_next = message["role"] == "tool" or (merge_next and role == "user")
    return out


def _call_text(call: dict) -> str:
    function = call["function"]
    arguments = function["arguments"]
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f"Tool call {function['name']}({arguments})"


SYSTEM_FOLD_JOIN = "\n\n"  # between a folded system message's text and the user turn's


def fold_late_system_messages(messages: list[dict]) -> list[dict] | None:
    """The messages with each system message after the first joined to a user turn (the next one, else the
    last before it), for templates that take a system message only at the start (Mixtral's raises on one
    mid-conversation, which OpenAI's chat allows and Claude Code sends); None when there is none to fold."""
    if not any(i > 0 and m["role"] == "system" for i, m in enumerate(messages)):
        return None
    out: list[dict] = []
    pending: list[str] = []  # late system text waiting for the next user turn
    for i, message in enumerate(messages):
        if i > 0 and message["role"] == "system":
            pending.append(message["content"])
            continue
        if message["role"] == "user" and pending:
            message = {**message, "content": SYSTEM_FOLD_JOIN.join([*pending, message["content"]])}
            pending = []
        out.append(message)
    if pending:
        users = [i for i, m in enumerate(out) if m["role"] == "user"]
        if not users:
            return None
        last = out[users[-1]]
        out[users[-1]] = {**last, "content": SYSTEM_FOLD_JOIN.join([last["content"], *pending])}
    return out
