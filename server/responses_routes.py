"""The routes of OpenAI's Responses API (server/responses.py translates it into the chat pipeline)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.api import GenerationRequest
from server import responses
from server.json_body import StrictJSONRoute
from server.pipeline import accept, model_name, plan_chat, ready_engine, serving, with_tool_warning
from server.responses_format import ResponsesFormat
from server.responses_protocol import DeletedResponse, ResponsesRequest
from server.responses_tools import response_tools

router = APIRouter(route_class=StrictJSONRoute)  # duplicate keys and deep nesting: 400


# -- the Responses API (server/responses.py: translated into the chat pipeline) ----------------
@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, raw: Request) -> Response:
    accept(body)
    engine = ready_engine(raw, body.model)
    store = raw.app.state.responses
    conversation = responses.conversation_of(body, store)
    tools = response_tools(body.tools)
    chat = responses.to_chat_request(body, conversation, tools)
    with responses.chat_errors():
        plan = await plan_chat(chat, raw, engine)
        shell = responses.response_shell(body, model_name(engine, body.model))
        fmt = ResponsesFormat(shell, plan.tools, plan.reasoning, tools, want_logprobs=body.wants_logprobs,
                              on_done=responses.keeper(body, store, conversation))
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
