"""What a chat request's `tools` and `tool_choice` mean for this model.

A template that renders tools gets them and its output is read back by the parser of its
family. A template that cannot take tools answers as a plain chat, with a warning, unless the
request insists on a call (`required` or a named function): that is a 400. On a template with
tools, a forced call is met by a grammar the engine decodes under: the output is exactly one
valid call (to the named function, or to any of the tools), for formats that have a grammar.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

from engine.api import ChatTemplateInfo, InvalidRequestError, SamplingParams
from engine.chat_messages import renders_tool_list, with_system_text
from server import protocol as p
from server.tool_parsers import PARSERS, ToolCallStream, ToolParser, detect_parser

log = logging.getLogger(__name__)

WARNING_HEADER = "X-Moe-Serve-Warning"


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict] | None = None  # what the chat template renders
    parser: ToolParser | None = None  # reads calls back out of the output
    allowed_names: frozenset[str] = frozenset()
    max_calls: int | None = None  # 1 with parallel_tool_calls: false
    warning: str | None = None  # for the response header and the log
    grammar: str | None = None  # forces the output to be one valid call
    system_text: str | None = None  # the tool list, for a template that does not render one

    def messages(self, messages: list[dict]) -> list[dict]:
        """The request's messages as the template gets them (with the tool list where it needs one)."""
        return messages if self.system_text is None else with_system_text(messages, self.system_text)

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """The request's params, keeping special tokens in the text where the parser reads them."""
        if self.grammar is not None:
            params = replace(params, grammar=self.grammar)
        if self.parser is not None and self.parser.needs_special_tokens:
            params = replace(params, skip_special_tokens=False)
        return params

    def stream(self) -> ToolCallStream | None:
        """A fresh reader of one output, or None where no calls are read."""
        if self.parser is None:
            return None
        return ToolCallStream(self.parser, self.allowed_names, self.max_calls)


def plan_tools(request: p.ChatCompletionRequest, template: ChatTemplateInfo, parser_name: str,
               added_tokens: Mapping[str, int] | None = None) -> ToolPlan:
    """`parser_name`: a name from `PARSERS`, or "auto" (from the template, else the model type);
    `added_tokens`: the tokenizer's, by text (a grammar writes a format's markers as those)."""
    tools = request.tools or []
    choice = request.tool_choice or "auto"
    forced = _forced_name(choice, tools)
    if not tools:
        return ToolPlan()
    if not template.supports_tools:  # said also with tool_choice none: the client may not know
        return _plain_chat(len(tools), choice, forced)
    if choice == "none":
        return ToolPlan()
    definitions = [tool.model_dump(exclude_none=True) for tool in tools]
    name = detect_parser(template) if parser_name == "auto" else parser_name
    parser = PARSERS[name](definitions, added_tokens, template.source) if name is not None else None
    allowed = frozenset(t.function.name for t in tools)
    system_text = parser.prompt_tools(definitions) if parser and not renders_tool_list(template.source) else None
    if forced is not None:
        grammar = parser.call_grammar(definitions, None if forced == "*" else forced) if parser else None
        if grammar is None:
            raise InvalidRequestError(f"tool_choice {_describe(choice)} is not supported for this model's tool-call "
                                      f"format ({name or 'unknown'}) yet; use 'auto'", param="tool_choice",
                                      code="unsupported_tool_choice")
        return ToolPlan(tools=definitions, parser=parser, allowed_names=allowed, max_calls=1, grammar=grammar,
                        system_text=system_text)
    if parser is None:
        return ToolPlan(tools=definitions, warning="no tool-call parser is known for this model: the tools were "
                        "offered but calls come back as text; set --tool-call-parser")
    return ToolPlan(tools=definitions, parser=parser, allowed_names=allowed,
                    max_calls=1 if request.parallel_tool_calls is False else None, system_text=system_text)


def _plain_chat(tool_count: int, choice: str | p.NamedToolChoice, forced: str | None) -> ToolPlan:
    """For a template without tools: a plain chat with a warning, unless a call is demanded."""
    if forced is not None:
        raise InvalidRequestError("this model cannot call tools: its chat template does not take them, so "
                                  f"tool_choice {_describe(choice)} cannot be met", param="tool_choice")
    return ToolPlan(warning=f"this model's chat template cannot take tools: the {tool_count} tools were not "
                    "offered and the request was answered as a plain chat")


def _forced_name(choice: str | p.NamedToolChoice, tools: list[p.ToolDefinition]) -> str | None:
    """The function a call is forced to ("*" for any), or None; checks a named one is offered."""
    if isinstance(choice, p.NamedToolChoice):
        if choice.function.name not in {t.function.name for t in tools}:
            raise InvalidRequestError(f"tool_choice names function {choice.function.name!r}, which is not "
                                      "among the tools", param="tool_choice")
        return choice.function.name
    if choice == "required":
        if not tools:
            raise InvalidRequestError("tool_choice 'required' needs tools", param="tool_choice")
        return "*"
    return None


def _describe(choice: str | p.NamedToolChoice) -> str:
    return f"{choice!r}" if isinstance(choice, str) else f"naming function {choice.function.name!r}"
