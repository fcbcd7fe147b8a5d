"""HTTP routes of OpenAI's API and the server's own (models, tokenize, health, metrics, the expert cache).
Each only translates: wire request -> engine request -> wire response. The other APIs' routes are in
server/responses_routes.py, server/anthropic_routes.py and server/ollama_routes.py."""

from __future__ import annotations

from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from engine.api import EchoedPrompt, GenerationRequest, InvalidRequestError
from server import embeddings as emb
from server import protocol as p
from server.json_body import StrictJSONRoute
from server.llamacpp_protocol import DetokenizeResponse
from server.llamacpp_routes import tokenized
from server.pipeline import (
    accept,
    fill_in_the_middle,
    model_name,
    plan_chat,
    ready_engine,
    serving,
    with_tool_warning,
)
from server.serving import ChatFormat, CompletionFormat

router = APIRouter(route_class=StrictJSONRoute)  # duplicate keys and deep nesting: 400


@router.post("/v1/chat/completions")
async def create_chat_completion(body: p.ChatCompletionRequest, raw: Request) -> Response:
    accept(body)
    engine = ready_engine(raw, body.model)
    plan = await plan_chat(body, raw, engine)
    fmt = ChatFormat(model_name(engine, body.model), raw.app.state.fingerprint, want_logprobs=bool(body.logprobs),
                     tool_plan=plan.tools, reasoning_plan=plan.reasoning)
    request = GenerationRequest(fmt.id, plan.prompt, plan.params)
    response = await serving(raw).run(raw, fmt, request, bool(body.stream), body.include_usage, body.num_choices)
    return with_tool_warning(response, plan, fmt.id)


@router.post("/v1/completions")
async def create_completion(body: p.CompletionRequest, raw: Request) -> Response:
    accept(body)
    engine = ready_engine(raw, body.model)
    params = body.to_sampling_params(engine.sampling_defaults)
    prompts = body.prompts()
    if body.suffix is not None:  # one text prompt: the request's checks made sure
        prompt_ids, params = await fill_in_the_middle(engine, prompts[0], body.suffix, params)
        batch_ids = [prompt_ids]
    else:
        batch_ids = [await prompt_token_ids(engine, prompt) for prompt in prompts]
    echoes = [await echoed_prompt(engine, prompt, ids) for prompt, ids in zip(prompts, batch_ids)] if body.echo else []
    fmt = CompletionFormat(model_name(engine, body.model), raw.app.state.fingerprint,
                           want_logprobs=body.logprobs is not None, choices_per_prompt=body.num_choices,
                           echoes=tuple(echoes))
    requests = [GenerationRequest(fmt.id, ids, params) for ids in batch_ids]
    request = requests[0] if len(requests) == 1 else requests
    return await serving(raw).run(raw, fmt, request, bool(body.stream), body.include_usage, body.num_choices)


@router.post("/v1/embeddings")
async def create_embeddings(body: emb.EmbeddingRequest, raw: Request) -> Response:
    accept(body)
    engine = ready_engine(raw, body.model)
    emb.check_dimensions(body.dimensions, engine.hidden_size)
    given = body.inputs()
    emb.check_token_ids(given, engine.vocab_size, "input")
    inputs = [await prompt_token_ids(engine, item) for item in given]
    build = emb.openai_response(body, model_name(engine, body.model))
    return await emb.run_embeddings(raw, inputs, build)


async def prompt_token_ids(engine, prompt: str | list[int]) -> list[int]:
    return await run_in_threadpool(engine.encode, prompt) if isinstance(prompt, str) else list(prompt)


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
    accept(body)
    engine = ready_engine(raw, body.model)
    if body.content is not None:  # llama.cpp's request
        if body.prompt is not None or body.messages is not None:
            raise InvalidRequestError("send `content` (llama.cpp's) or `prompt`/`messages`, not both", param="content")
        answer = await run_in_threadpool(tokenized, engine, body.content, body.add_special, body.with_pieces)
        return JSONResponse(answer.model_dump())
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("send either `prompt` or `messages`", param="prompt")
    if body.messages is not None:
        continued = p.continues_final_message(body.messages, body.continue_final_message)
        tokens = await run_in_threadpool(lambda: engine.apply_chat_template([m.to_engine() for m in body.messages],
                                                                            continue_final=continued))
    else:
        tokens = await run_in_threadpool(engine.encode, body.prompt)
    response = p.TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens)
    return JSONResponse(response.model_dump())


@router.post("/detokenize")
async def detokenize(body: p.DetokenizeRequest, raw: Request) -> JSONResponse:
    accept(body)
    engine = ready_engine(raw, body.model)
    if any(not 0 <= t < engine.vocab_size for t in body.tokens):
        raise InvalidRequestError(f"tokens must be ids in [0, {engine.vocab_size})", param="tokens")
    text = await run_in_threadpool(engine.decode, body.tokens)
    return JSONResponse(DetokenizeResponse(prompt=text, content=text).model_dump())  # vLLM's name and llama.cpp's


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
