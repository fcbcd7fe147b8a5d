"""The Responses API's tools as the chat functions the model is offered, and its calls back as the
output items the client expects. Agent clients such as Codex CLI send all of these kinds at once:

- `function`: a chat function as it is.
- `custom` (freeform: the call's input is raw text, such as Codex's `apply_patch` patch): a chat
  function with one string argument, `input`, and the input's format (a grammar) in its description.
  A call comes back as a `custom_tool_call` holding that text. The grammar is not enforced while
  decoding: the model is told it.
- `namespace` (a group of function and custom tools): each of its tools, offered to the model as
  `<namespace>__<name>`; a call comes back with `namespace` and `name` apart.
- Tools hosted by OpenAI (`web_search`, `file_search`, `code_interpreter`, `mcp`, ...) run on OpenAI's
  servers, not here: they are left out and the response says so in a warning header. A client that
  always declares them (Codex) still works; failing its every request would not help it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.api import InvalidRequestError
from server import protocol as p
from server import responses_protocol as rp
from server.tool_parsers import ToolCall

NAMESPACE_JOIN = "__"
CUSTOM_ARGUMENT = "input"  # the one argument of a custom tool's chat function


def chat_tool_name(name: str, namespace: str | None) -> str:
    """The name the model sees for tool `name` (of `namespace`)."""
    return f"{namespace}{NAMESPACE_JOIN}{name}" if namespace else name


def custom_arguments(text: str) -> str:
    """A custom tool call's raw input as the chat function's arguments (for the history sent back)."""
    return json.dumps({CUSTOM_ARGUMENT: text})


def custom_input(arguments: str) -> str:
    """The raw text of a custom tool call, from the arguments the model wrote for its function."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_ARGUMENT), str):
        return value[CUSTOM_ARGUMENT]
    if isinstance(value, dict) and len(value) == 1 and isinstance(next(iter(value.values())), str):
        return next(iter(value.values()))  # the model named the one argument otherwise
    return arguments


@dataclass(frozen=True)
class ToolIdentity:
    """Which declared tool a chat function stands for."""

    name: str
    namespace: str | None = None
    custom: bool = False


@dataclass(frozen=True)
class ResponseTools:
    """The request's tools: the chat functions offered, whom each stands for, and the hosted ones left out."""

    functions: list[p.ToolDefinition] = field(default_factory=list)
    identities: dict[str, ToolIdentity] = field(default_factory=dict)  # by chat function name
    hosted: list[str] = field(default_factory=list)  # the types left out

    @property
    def warning(self) -> str | None:
        if not self.hosted:
            return None
        return ("tools hosted by OpenAI do not run on this server and were not offered to the model: "
                + ", ".join(repr(t) for t in self.hosted))

    def output_item(self, call: ToolCall) -> rp.ToolCallItem:
        """A parsed call as the output item of the tool it names (a name never declared: a function call)."""
        identity = self.identities.get(call.name, ToolIdentity(call.name))
        where = {"namespace": identity.namespace} if identity.namespace else {}
        if identity.custom:
            return rp.CustomToolCallItem(call_id=call.id, name=identity.name, input=custom_input(call.arguments),
                                         **where)
        return rp.FunctionCallItem(call_id=call.id, name=identity.name, arguments=call.arguments,
                                   status="completed", **where)


def response_tools(tools: list[rp.RequestTool] | None) -> ResponseTools:
    functions: list[p.ToolDefinition] = []
    identities: dict[str, ToolIdentity] = {}
    hosted: list[str] = []
    for index, tool in enumerate(tools or []):
        where = f"tools[{index}]"
        if tool.type == "namespace":
            namespace = _name(tool, where)
            for inner_index, inner in enumerate(tool.tools or []):
                _add(inner, f"{where}.tools[{inner_index}]", namespace, functions, identities)
        elif tool.type in ("function", "custom"):
            _add(tool, where, None, functions, identities)
        elif tool.type not in hosted:
            hosted.append(tool.type)
    return ResponseTools(functions, identities, hosted)


def _add(tool: rp.RequestTool, where: str, namespace: str | None, functions: list[p.ToolDefinition],
         identities: dict[str, ToolIdentity]) -> None:
    if tool.type not in ("function", "custom"):
        raise InvalidRequestError(f"{where}: a namespace holds function and custom tools, not {tool.type!r}",
                                  param=f"{where}.type")
    name = _name(tool, where)
    chat_name = chat_tool_name(name, namespace)
    if chat_name in identities:
        raise InvalidRequestError(f"{where}: tool {chat_name!r} is declared twice", param=f"{where}.name")
    custom = tool.type == "custom"
    identities[chat_name] = ToolIdentity(name, namespace, custom)
    definition = (p.FunctionDefinition(name=chat_name, description=_custom_description(tool),
                                       parameters=_CUSTOM_PARAMETERS) if custom else
                  p.FunctionDefinition(name=chat_name, description=tool.description, parameters=tool.parameters,
                                       strict=tool.strict))
    functions.append(p.ToolDefinition(type="function", function=definition))


def _name(tool: rp.RequestTool, where: str) -> str:
    if not tool.name:
        raise InvalidRequestError(f"{where} needs a name", param=f"{where}.name")
    return tool.name


_CUSTOM_PARAMETERS = {"type": "object", "properties": {CUSTOM_ARGUMENT: {"type": "string"}},
                      "required": [CUSTOM_ARGUMENT], "additionalProperties": False}


def _custom_description(tool: rp.RequestTool) -> str:
    parts = [tool.description] if tool.description else []
    parts.append(f"Give the tool's whole input as the text of `{CUSTOM_ARGUMENT}` (raw text, not JSON).")
    fmt = tool.format
    if fmt is not None and fmt.type == "grammar" and fmt.definition:
        syntax = f" ({fmt.syntax})" if fmt.syntax else ""
        parts.append(f"That text must match this grammar{syntax}:\n{fmt.definition}")
    return "\n\n".join(parts)
