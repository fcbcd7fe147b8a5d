"""What the routes of every API share: the ready engine, the checks every request passes first, and the
chat plan (prompt, sampling, tools, reasoning) that chat completions and the APIs translated into chat
requests (Responses, Anthropic Messages, Ollama) all go through."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from engine.api import TEMPLATE_TIMEOUT_CODE, EngineUnavailableError, InvalidRequestError, SamplingParams
from engine.constraint import added_token_ids
from engine.fim import ExtraFiles
from server import protocol as p
from server.errors import model_not_found
from server.ollama_context import Render
from server.reasoning import BUDGET_IGNORED, ReasoningPlan, plan_reasoning
from server.serving import Serving
from server.structured import with_response_format
from server.tools import WARNING_HEADER, ToolPlan, plan_tools

log = logging.getLogger(__name__)


def ready_engine(raw: Request, model: str | None = None):
    """The loaded engine (503 while loading or dead); 404 when `model` is not the one served."""
    client = raw.app.state.client
    if client.error is not None:
        raise EngineUnavailableError(f"the engine failed: {client.error}")
    if not client.ready:
        raise EngineUnavailableError("the model is still loading" if client.engine is None else "the engine stopped")
    if model is not None and model not in client.engine.model_names:
        raise model_not_found(model)
    return client.engine


def model_name(engine, requested: str | None) -> str:
    """The name a response carries: the one the request sent (any of `--served-model-name`'s), else the first."""
    return requested or engine.model_name


def serving(raw: Request) -> Serving:
    return raw.app.state.serving


def accept(body: p.OpenAIBaseModel) -> None:
    """Checks every request must pass before anything else reads it."""
    body.check_text()  # first: error messages and logs may quote the request's strings
    if body.ignored_fields:
        log.info("ignoring unsupported request fields: %s", ", ".join(body.ignored_fields))


@dataclass(frozen=True)
class ChatPlan:
    """What a chat request becomes before the engine sees it: the prompt's tokens and the sampling,
    with how its tool calls and reasoning are read back out of the output."""

    prompt: list[int]
    params: SamplingParams
    tools: ToolPlan
    reasoning: ReasoningPlan
    warning: str | None = None  # something the request asked for that could not be done (not about tools)

    def params_within(self, max_model_len: int) -> SamplingParams:
        """`params` with `max_tokens` cut to the room the prompt leaves, for APIs whose clients ask for
        more than any local context holds (Anthropic's must send `max_tokens`, and Claude Code sends
        32,000) or whose servers cut it (Ollama's `num_predict`): the answer ends where the context does,
        with the token limit's finish reason, where chat answers a 400. A prompt that leaves no room is
        still refused."""
        room = max_model_len - len(self.prompt)
        if self.params.max_tokens is None or room < 1 or self.params.max_tokens <= room:
            return self.params
        return replace(self.params, max_tokens=room)


PromptFit = Callable[[list[p.ChatMessage], Render], list[int]]  # messages, their rendering -> the prompt


def whole_prompt(messages: list[p.ChatMessage], render: Render) -> list[int]:
    """The prompt of every message: a prompt longer than the context is refused later, by the engine."""
    return render(messages)


async def plan_chat(body: p.ChatCompletionRequest, raw: Request, engine, fit: PromptFit = whole_prompt) -> ChatPlan:
    """The chat pipeline every chat-shaped API shares (chat completions, and those translated to it);
    `fit`: which of the messages make the prompt (Ollama's `/api/chat` drops the oldest to fit the context)."""
    added_tokens = added_token_ids(engine.tokenizer) if body.tools else None
    tools = plan_tools(body, engine.chat_template_info, raw.app.state.tool_call_parser, added_tokens)
    params = body.to_sampling_params(engine.sampling_defaults)
    params = with_response_format(tools.sampling_params(params), body.response_format)

    continue_final = body.continues_final_message()

    def render(messages: list[p.ChatMessage]) -> list[int]:
        engine_messages = tools.messages([m.to_engine() for m in messages])
        try:
            return engine.apply_chat_template(engine_messages, tools.tools, body.template_kwargs(),
                                              continue_final=continue_final)
        except InvalidRequestError as e:
            # a continuation nobody asked for, which this template cannot render (it changes the last message's
            # text, or refuses to end on the assistant): a new turn, as this request got before continuing
            if not continue_final or body.continue_final_message or e.code == TEMPLATE_TIMEOUT_CODE:
                raise
            return engine.apply_chat_template(engine_messages, tools.tools, body.template_kwargs())

    # the model's own template, never the request's; off the event loop, like all tokenizing
    prompt = await run_in_threadpool(fit, body.messages, render)
    asked = body.thinking_token_budget
    budget = asked if asked is not None else raw.app.state.reasoning_budget
    reasoning = await run_in_threadpool(plan_reasoning, raw.app.state.reasoning_parser, engine, params, prompt,
                                        budget)
    # the server's default is for the models it fits; only a request's own budget is worth a warning
    warning = BUDGET_IGNORED if reasoning.budget_ignored and asked is not None else None
    return ChatPlan(prompt, reasoning.sampling_params(params), tools, reasoning, warning)


def with_tool_warning(response: Response, plan: ChatPlan, request_id: str, other: str | None = None) -> Response:
    """Tools the model could not be offered or read back (`other`: the API's own reason), and what else of the
    request was ignored: said in a header and the log."""
    warning = "; ".join(w for w in (other, plan.tools.warning, plan.warning) if w)
    if warning:
        log.warning("request %s: %s", request_id, warning)
        response.headers[WARNING_HEADER] = header_value(warning)
    return response


def header_value(text: str) -> str:
    """`text` as a valid HTTP header value: it may quote the request (tool names and types), whose characters
    a header cannot carry (non-ASCII, control characters, or whitespace at an end: h11 then drops the
    response and the client sees the connection closed). Non-ASCII is escaped as in Python (`\\u00e9`)."""
    escaped = text.encode("ascii", "backslashreplace").decode("ascii")
    return "".join(c if c.isprintable() else " " for c in escaped).strip()


async def fill_in_the_middle(engine, prefix: str, suffix: str, params: SamplingParams, files: ExtraFiles = (),
                             suffix_param: str = "suffix") -> tuple[list[int], SamplingParams]:
    """The fill-in-the-middle prompt for the code around the cursor (after other `files` of the project, as
    context), and `params` that also end at the format's tokens (they never belong in a middle); a model
    without FIM tokens: a 400 naming `suffix_param` (the request's name for the suffix)."""
    try:
        prompt = await run_in_threadpool(engine.fim_prompt, prefix, suffix, files)
    except InvalidRequestError as e:
        if e.param != "suffix":
            raise
        raise InvalidRequestError(str(e), param=suffix_param, code=e.code) from None
    return prompt, replace(params, stop_token_ids=engine.fim_stop_ids)
