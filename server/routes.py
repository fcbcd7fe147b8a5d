"""HTTP routes. Each only translates: wire request -> engine request -> wire response."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from engine.api import (
    EchoedPrompt,
    EngineUnavailableError,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
)
from engine.constraint import added_token_ids
from server import VERSION, anthropic_messages, ollama_context, ollama_messages, ollama_models, responses
from server import anthropic_protocol as anthropic
from server import ollama_protocol as ollama
from server import protocol as p
from server.anthropic_format import MessagesFormat
from server.errors import APIError, model_not_found
from server.json_body import StrictJSONRoute
from server.ollama_context import Render
from server.ollama_format import ChatFormat as OllamaChatFormat
from server.ollama_format import GenerateFormat as OllamaGenerateFormat
from server.ollama_format import OllamaFormat, loaded_reply
from server.ollama_models import ModelFacts, model_facts, served_name
from server.reasoning import BUDGET_IGNORED, ReasoningPlan, plan_reasoning
from server.responses_format import ResponsesFormat
from server.responses_protocol import DeletedResponse, ResponsesRequest
from server.responses_tools import response_tools
from server.serving import ChatFormat, CompletionFormat, Serving
from server.structured import with_response_format
from server.tools import WARNING_HEADER, ToolPlan, plan_tools

log = logging.getLogger(__name__)
router = APIRouter(route_class=StrictJSONRoute)  # duplicate keys and deep nesting: 400


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


def _accept(body: p.OpenAIBaseModel) -> None:
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

    def render(messages: list[p.ChatMessage]) -> list[int]:
        return engine.apply_chat_template(tools.messages([m.to_engine() for m in messages]), tools.tools,
                                          body.template_kwargs())

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
        response.headers[WARNING_HEADER] = warning
    return response


async def fill_in_the_middle(engine, prefix: str, suffix: str,
                             params: SamplingParams) -> tuple[list[int], SamplingParams]:
    """The fill-in-the-middle prompt for the code around the cursor, and `params` that also end at the format's
    tokens (they never belong in a middle); a model without FIM tokens: a 400 naming `suffix`."""
    prompt = await run_in_threadpool(engine.fim_prompt, prefix, suffix)
    return prompt, replace(params, stop_token_ids=engine.fim_stop_ids)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: p.ChatCompletionRequest, raw: Request) -> Response:
    _accept(body)
    engine = ready_engine(raw, body.model)
    plan = await plan_chat(body, raw, engine)
    fmt = ChatFormat(model_name(engine, body.model), raw.app.state.fingerprint, want_logprobs=bool(body.logprobs),
                     tool_plan=plan.tools, reasoning_plan=plan.reasoning)
    request = GenerationRequest(fmt.id, plan.prompt, plan.params)
    response = await serving(raw).run(raw, fmt, request, bool(body.stream), body.include_usage, body.num_choices)
    return with_tool_warning(response, plan, fmt.id)


@router.post("/v1/completions")
async def create_completion(body: p.CompletionRequest, raw: Request) -> Response:
    _accept(body)
    engine = ready_engine(raw, body.model)
    params = body.to_sampling_params(engine.sampling_defaults)
    prompt = body.single_prompt()
    if body.suffix is not None:  # a text prompt: the request's checks made sure
        prompt_ids, params = await fill_in_the_middle(engine, prompt, body.suffix, params)
    else:
        prompt_ids = await run_in_threadpool(engine.encode, prompt) if isinstance(prompt, str) else list(prompt)
    echo = await echoed_prompt(engine, prompt, prompt_ids) if body.echo else None
    fmt = CompletionFormat(model_name(engine, body.model), raw.app.state.fingerprint,
                           want_logprobs=body.logprobs is not None, echo=echo)
    request = GenerationRequest(fmt.id, prompt_ids, params)
    return await serving(raw).run(raw, fmt, request, bool(body.stream), body.include_usage, body.num_choices)


async def echoed_prompt(engine, prompt: str | list[int], prompt_ids: list[int]) -> EchoedPrompt:
    """The prompt as `echo` shows it: a text prompt as sent, token ids decoded."""
    echo = await run_in_threadpool(engine.echoed_prompt, prompt_ids)
    return replace(echo, text=prompt) if isinstance(prompt, str) else echo


def _card(raw: Request, engine, name: str) -> p.ModelCard:
    return p.ModelCard(id=name, created=raw.app.state.started, max_model_len=engine.max_model_len)


@router.get("/v1/models")
async def list_models(raw: Request) -> p.ModelList:
    engine = ready_engine(raw)
    return p.ModelList(data=[_card(raw, engine, name) for name in engine.model_names])


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, raw: Request) -> p.ModelCard:
    engine = ready_engine(raw, model_id)
    return _card(raw, engine, model_id)


@router.post("/tokenize")
async def tokenize(body: p.TokenizeRequest, raw: Request) -> JSONResponse:
    _accept(body)
    engine = ready_engine(raw, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("send either `prompt` or `messages`", param="prompt")
    if body.messages is not None:
        tokens = await run_in_threadpool(engine.apply_chat_template, [m.to_engine() for m in body.messages])
    else:
        tokens = await run_in_threadpool(engine.encode, body.prompt)
    response = p.TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens)
    return JSONResponse(response.model_dump())


@router.post("/detokenize")
async def detokenize(body: p.DetokenizeRequest, raw: Request) -> JSONResponse:
    _accept(body)
    engine = ready_engine(raw, body.model)
    if any(not 0 <= t < engine.vocab_size for t in body.tokens):
        raise InvalidRequestError(f"tokens must be ids in [0, {engine.vocab_size})", param="tokens")
    text = await run_in_threadpool(engine.decode, body.tokens)
    return JSONResponse(p.DetokenizeResponse(prompt=text).model_dump())


@router.get("/v1/expert-cache")
async def expert_cache(raw: Request) -> JSONResponse:
    return JSONResponse(ready_engine(raw).cache_info())


@router.get("/health")
async def health(raw: Request) -> JSONResponse:
    client = raw.app.state.client
    if client.ready:
        return JSONResponse({"status": "ok"})
    if client.error is not None:
        return JSONResponse({"status": "error", "error": client.error}, status_code=503)
    return JSONResponse({"status": "loading" if client.engine is None else "stopped"}, status_code=503)


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    body, content_type = raw.app.state.metrics.render()
    return Response(body, media_type=content_type)


# -- the Responses API (server/responses.py: translated into the chat pipeline) ----------------
@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, raw: Request) -> Response:
    _accept(body)
    engine = ready_engine(raw, body.model)
    store = raw.app.state.responses
    conversation = responses.conversation_of(body, store)
    tools = response_tools(body.tools)
    chat = responses.to_chat_request(body, conversation, tools)
    with responses.chat_errors():
        plan = await plan_chat(chat, raw, engine)
        shell = responses.response_shell(body, model_name(engine, body.model))
        fmt = ResponsesFormat(shell, plan.tools, plan.reasoning, tools, on_done=responses.keeper(body, store, conversation))
        request = GenerationRequest(fmt.id, plan.prompt, plan.params)
        response = await serving(raw).run(raw, fmt, request, bool(body.stream))
    return with_tool_warning(response, plan, fmt.id, tools.warning)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, raw: Request) -> JSONResponse:
    stored = raw.app.state.responses.get(response_id)
    if stored is None:
        raise responses.response_not_found(response_id)
    return JSONResponse(stored.response.model_dump(exclude_unset=True))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, raw: Request) -> JSONResponse:
    if not raw.app.state.responses.delete(response_id):
        raise responses.response_not_found(response_id)
    return JSONResponse(DeletedResponse(id=response_id).model_dump())


# -- Anthropic's Messages API: translated to the chat pipeline ------------------------------------
@router.post("/v1/messages")
async def create_message(body: anthropic.MessagesRequest, raw: Request) -> Response:
    _accept(body)
    engine = ready_engine(raw, body.model)
    plan = await plan_chat(anthropic_messages.to_chat_request(body), raw, engine)
    fmt = MessagesFormat(model_name(engine, body.model), len(plan.prompt), tool_plan=plan.tools,
                         reasoning_plan=plan.reasoning)
    params = plan.params_within(engine.max_model_len)
    request = GenerationRequest(fmt.id, plan.prompt, params)
    response = await serving(raw).run(raw, fmt, request, bool(body.stream))
    return with_tool_warning(response, plan, fmt.id)


@router.post("/v1/messages/count_tokens")
async def count_message_tokens(body: anthropic.CountTokensRequest, raw: Request) -> anthropic.CountTokensResponse:
    """The prompt's tokens as `/v1/messages` renders it (tools included); `max_tokens` is not needed."""
    _accept(body)
    engine = ready_engine(raw, body.model)
    plan = await plan_chat(anthropic_messages.to_chat_request(body), raw, engine)
    return anthropic.CountTokensResponse(input_tokens=len(plan.prompt))


# -- Ollama's native API: translated to the chat pipeline --------------------------------------
@router.post("/api/chat")
async def ollama_chat(body: ollama.ChatRequest, raw: Request) -> Response:
    started = time.monotonic_ns()
    _accept(body)
    engine = ready_engine(raw)
    served_name(engine, body.model)  # else a 404 (the response carries the name sent, `:latest` too)
    chat = ollama_messages.chat_request(body)
    if not body.messages:  # nothing to answer: a client loading the model
        return _loaded(OllamaChatFormat(body.model, started), chat, engine, body.unloads)
    fit = ollama_context.context_fit(body.options, body.truncate, engine.max_model_len)
    plan = await plan_chat(chat, raw, engine, fit.prompt)
    fmt = OllamaChatFormat(body.model, started, plan.tools, plan.reasoning)
    return await _run_ollama(raw, engine, fmt, plan, body.streams)


@router.post("/api/generate")
async def ollama_generate(body: ollama.GenerateRequest, raw: Request) -> Response:
    started = time.monotonic_ns()
    _accept(body)
    engine = ready_engine(raw)
    served_name(engine, body.model)  # else a 404
    chat = ollama_messages.generate_request(body)
    if not body.prompt and not body.suffix:  # nothing to answer: a client loading the model
        return _loaded(OllamaGenerateFormat(body.model, started), chat, engine, body.unloads)
    if body.suffix or body.raw:  # no template, so no tool calls or thinking to read
        params = with_response_format(chat.to_sampling_params(engine.sampling_defaults), chat.response_format)
        if body.suffix:  # insertion, also with `raw`: the prompt is the code before the cursor
            prompt, params = await fill_in_the_middle(engine, body.prompt or "", body.suffix, params)
        else:  # the prompt as it is
            prompt = await run_in_threadpool(engine.encode, body.prompt)
        params = replace(params, text_continues_prompt=True)  # its first word keeps its leading space
        plan = ChatPlan(prompt, params, ToolPlan(), ReasoningPlan())
    else:
        plan = await plan_chat(chat, raw, engine)
    fmt = OllamaGenerateFormat(body.model, started, plan.tools, plan.reasoning)
    return await _run_ollama(raw, engine, fmt, plan, body.streams)


def _loaded(fmt: OllamaFormat, chat: p.ChatCompletionRequest, engine, unload: bool) -> JSONResponse:
    """Ollama's answer to a request with nothing to generate, done at once; its options are still checked."""
    chat.to_sampling_params(engine.sampling_defaults)
    return JSONResponse(loaded_reply(fmt, unload).model_dump(exclude_unset=True))


async def _run_ollama(raw: Request, engine, fmt: OllamaFormat, plan: ChatPlan, stream: bool) -> Response:
    params = plan.params_within(engine.max_model_len)
    request = GenerationRequest(p.random_id("ollama"), plan.prompt, params)
    response = await serving(raw).run(raw, fmt, request, stream)
    return with_tool_warning(response, plan, request.request_id)


async def _model_facts(raw: Request, engine) -> ModelFacts:
    return await run_in_threadpool(model_facts, engine, raw.app.state.reasoning_parser, raw.app.state.started)


@router.get("/api/tags", response_model_exclude_unset=True)
async def ollama_tags(raw: Request) -> ollama.ModelList:
    engine = ready_engine(raw)
    facts = await _model_facts(raw, engine)
    return ollama.ModelList(models=[facts.entry(name) for name in engine.model_names])


@router.post("/api/show")
async def ollama_show(body: ollama.ShowRequest, raw: Request) -> ollama.ShowResponse:
    _accept(body)
    engine = ready_engine(raw)
    requested = body.model or body.name
    if not requested:
        raise InvalidRequestError("send the model's name in `model`", param="model")
    return ollama_models.show(await _model_facts(raw, engine), served_name(engine, requested))


@router.get("/api/ps", response_model_exclude_unset=True)
async def ollama_ps(raw: Request) -> ollama.ModelList:
    engine = ready_engine(raw)
    facts = await _model_facts(raw, engine)
    size_vram = ollama_models.device_bytes(engine)
    return ollama.ModelList(models=[facts.entry(engine.model_name, expires_at=ollama_models.NEVER_EXPIRES,
                                                size_vram=size_vram, context_length=engine.max_model_len)])


@router.get("/api/version")
async def ollama_version() -> ollama.VersionResponse:
    return ollama.VersionResponse(version=ollama_models.OLLAMA_API_VERSION, moe_serve_version=VERSION)


def _refuse_model_management(path: str) -> None:
    async def refuse() -> None:
        raise APIError(501, f"{path} is not supported: this server serves the one model it was started with "
                       "(moe-serve --model); it cannot pull, push, create, copy or delete models, nor embed",
                       "invalid_request_error", code="not_supported")

    router.add_api_route(path, refuse, methods=["POST", "DELETE"] if path == "/api/delete" else ["POST"],
                         include_in_schema=False)


for _path in ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete", "/api/embed", "/api/embeddings",
              "/api/blobs/{digest}"):
    _refuse_model_management(_path)


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def root() -> PlainTextResponse:
    """What Ollama's clients probe to see that a server is up."""
    return PlainTextResponse("moe-serve is running")
