"""Request bodies parsed as strict JSON before any model sees them.

Python's `json` takes the last of duplicate keys and recurses until the interpreter's stack
runs out; a request must not mean two things, nor make the server recurse without bound. So
a body with a duplicate key, or nested deeper than MAX_JSON_DEPTH, is invalid JSON (400).
NaN and Infinity still parse: every numeric field's range check refuses them with its name.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute

MAX_JSON_DEPTH = 64  # objects and arrays inside each other; a deep JSON schema needs ~10


def loads_strict(body: bytes) -> Any:
    """The parsed body; `json.JSONDecodeError` for invalid JSON, a duplicate key or too deep a nesting."""
    try:
        value = json.loads(body, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise _invalid(f"duplicate key {e.key!r}", body) from None
    except RecursionError:  # the parser's own guard, at the interpreter's recursion limit
        raise _invalid(f"nested too deeply; at most {MAX_JSON_DEPTH} levels are allowed", body) from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:  # an integer of more than 4,300 digits
        raise _invalid(str(e), body) from None
    if nested_deeper_than(value, MAX_JSON_DEPTH):
        raise _invalid(f"nested too deeply; at most {MAX_JSON_DEPTH} levels are allowed", body)
    return value


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether objects and arrays nest more than `limit` deep (an explicit stack, no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _invalid(reason: str, body: bytes) -> json.JSONDecodeError:
    return json.JSONDecodeError(reason, body.decode("utf-8", errors="replace"), 0)


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return result


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads_strict(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """A route whose JSON body is read with `loads_strict` (FastAPI answers its errors as invalid JSON).

    A body sent without a Content-Type is read as JSON, as Ollama, llama.cpp and older FastAPI read it
    (litellm's `ollama_chat/` and `ollama/` providers send none); FastAPI 0.165 and later would hand the
    model the raw bytes ("Input should be a valid dictionary")."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict_handler(request: Request):
            scope = request.scope
            if not any(name == b"content-type" for name, _ in scope["headers"]):
                scope["headers"] = [*scope["headers"], (b"content-type", b"application/json")]
            return await handler(StrictJSONRequest(scope, request.receive))

        return strict_handler
