"""The routes of Ollama's native API, translated into the chat pipeline (server/ollama_messages.py), its
embeddings (server/embeddings.py), and what its clients probe: the model list, the running model, the version, `/`."""

from __future__ import annotations

import time
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from engine.api import GenerationRequest, InvalidRequestError
from server import VERSION, ollama_context, ollama_messages, ollama_models
from server import embeddings as emb
from server import ollama_protocol as ollama
from server import protocol as p
from server.errors import APIError
from server.json_body import StrictJSONRoute
from server.ollama_format import ChatFormat as OllamaChatFormat
from server.ollama_format import GenerateFormat as OllamaGenerateFormat
from server.ollama_format import OllamaFormat, loaded_reply
from server.ollama_models import ModelFacts, model_facts, served_name
from server.pipeline import (
    ChatPlan,
    accept,
    fill_in_the_middle,
    plan_chat,
    ready_engine,
    serving,
    with_tool_warning,
)
from server.reasoning import ReasoningPlan
from server.structured import with_response_format
from server.tools import ToolPlan

router = APIRouter(route_class=StrictJSONRoute)  # duplicate keys and deep nesting: 400


# -- Ollama's native API: translated to the chat pipeline --------------------------------------
def _served_engine(body: ollama.EmbedRequest | ollama.EmbeddingsRequest | ollama.GeneratingRequest, raw: Request):
    """The engine, once the request's own checks pass and it names the served model (else a 404)."""
    accept(body)
    engine = ready_engine(raw)
    served_name(engine, body.model)
    return engine


@router.post("/api/chat")
async def ollama_chat(body: ollama.ChatRequest, raw: Request) -> Response:
    started = time.monotonic_ns()
    engine = _served_engine(body, raw)  # the response carries the name sent (`:latest` too)
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
    engine = _served_engine(body, raw)
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


@router.post("/api/embed")
async def ollama_embed(body: ollama.EmbedRequest, raw: Request) -> Response:
    started = time.monotonic_ns()
    engine = _served_engine(body, raw)
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:  # nothing to embed: a client loading the model
        return JSONResponse(ollama.EmbedReply(model=body.model, embeddings=[], total_duration=0,
                                              prompt_eval_count=0).model_dump())
    emb.check_inputs(texts, "input")
    emb.check_dimensions(body.dimensions, engine.hidden_size)
    inputs = [await run_in_threadpool(engine.encode, text) for text in texts]
    if body.truncate:  # Ollama's default: the start of a long input, as much as the context holds
        inputs = [ids[: engine.max_model_len] for ids in inputs]

    def reply(vectors: emb.Vectors, tokens: int) -> ollama.EmbedReply:
        return ollama.EmbedReply(
            model=body.model, embeddings=[emb.unit_vector(vector, body.dimensions) for vector in vectors],
            total_duration=time.monotonic_ns() - started, prompt_eval_count=tokens)

    return await emb.run_embeddings(raw, inputs, reply)


@router.post("/api/embeddings")
async def ollama_embeddings(body: ollama.EmbeddingsRequest, raw: Request) -> Response:
    engine = _served_engine(body, raw)
    if not body.prompt:  # nothing to embed: a client loading the model
        return JSONResponse(ollama.EmbeddingsReply(embedding=[]).model_dump())
    ids = (await run_in_threadpool(engine.encode, body.prompt))[: engine.max_model_len]

    def reply(vectors: emb.Vectors, tokens: int) -> ollama.EmbeddingsReply:
        return ollama.EmbeddingsReply(embedding=list(vectors[0]))

    return await emb.run_embeddings(raw, [ids], reply, prompt_param="prompt")


async def _model_facts(raw: Request, engine) -> ModelFacts:
    return await run_in_threadpool(model_facts, engine, raw.app.state.reasoning_parser, raw.app.state.started)


@router.get("/api/tags", response_model_exclude_unset=True)
async def ollama_tags(raw: Request) -> ollama.ModelList:
    engine = ready_engine(raw)
    facts = await _model_facts(raw, engine)
    return ollama.ModelList(models=[facts.entry(name) for name in engine.model_names])


@router.post("/api/show")
async def ollama_show(body: ollama.ShowRequest, raw: Request) -> ollama.ShowResponse:
    accept(body)
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
                       "(moe-serve --model); it cannot pull, push, create, copy or delete models",
                       "invalid_request_error", code="not_supported")

    router.add_api_route(path, refuse, methods=["POST", "DELETE"] if path == "/api/delete" else ["POST"],
                         include_in_schema=False)


for _path in ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete", "/api/blobs/{digest}"):
    _refuse_model_management(_path)


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def root() -> PlainTextResponse:
    """What Ollama's clients probe to see that a server is up."""
    return PlainTextResponse("moe-serve is running")
