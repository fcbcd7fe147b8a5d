"""The routes of Anthropic's Messages API, translated into the chat pipeline (server/anthropic_messages.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.api import GenerationRequest
from server import anthropic_messages
from server import anthropic_protocol as anthropic
from server.anthropic_format import MessagesFormat
from server.json_body import StrictJSONRoute
from server.pipeline import accept, model_name, plan_chat, ready_engine, serving, with_tool_warning

router = APIRouter(route_class=StrictJSONRoute)  # duplicate keys and deep nesting: 400


# -- Anthropic's Messages API: translated to the chat pipeline ------------------------------------
@router.post("/v1/messages")
async def create_message(body: anthropic.MessagesRequest, raw: Request) -> Response:
    accept(body)
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
    accept(body)
    engine = ready_engine(raw, body.model)
    plan = await plan_chat(anthropic_messages.to_chat_request(body), raw, engine)
    return anthropic.CountTokensResponse(input_tokens=len(plan.prompt))
