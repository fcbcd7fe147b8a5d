"""`response_format`: JSON output, enforced by decoding under a grammar (as forced tool calls are)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from engine.api import InvalidRequestError, SamplingParams
from server import protocol as p
from server.json_schemas import as_llama_cpp_reads
from server.tool_parsers.base import JSON_OPTIONS


def with_response_format(params: SamplingParams, response_format: p.ResponseFormat | None) -> SamplingParams:
    """`params` constrained to the JSON the format asks for; unchanged for text."""
    schema = _schema(response_format)
    if schema is None:
        return params
    if params.grammar is not None:
        raise InvalidRequestError("response_format cannot be combined with a forced tool call (tool_choice)",
                                  param="response_format")
    return replace(params, grammar=f"start: %json {json.dumps(schema)}\n")


def _schema(response_format: p.ResponseFormat | None) -> dict[str, Any] | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object", "x-guidance": JSON_OPTIONS}
    if response_format.type != "json_schema":
        raise InvalidRequestError(f"response_format type {response_format.type!r} is not supported; use text, "
                                  "json_object or json_schema", param="response_format")
    schema = (response_format.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError("response_format json_schema needs a `schema` object",
                                  param="response_format.json_schema.schema")
    return {"x-guidance": JSON_OPTIONS, **as_llama_cpp_reads(schema)}
