"""The API as a property-based client sees it (issue 11, item 11): schemathesis generates requests
from the server's own OpenAPI schema, valid and invalid, for a bounded number of examples per
operation. No 500, no 422, every error in OpenAI's shape (on Anthropic's `/v1/messages` paths, in
Anthropic's around OpenAI's keys; on Ollama's `/api/` paths, Ollama's `{"error": "<message>"}`).

The real app and a real (tiny, random) engine in this process, with a 48-token context so that a
generated `max_tokens` never makes one example run long.
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from engine.config import EngineConfig
from engine.engine import Engine
from server.app import create_app
from server.config import ServerConfig
from server.errors import error_dialect
from tests.fixtures.models import build_checkpoint
from tests.test_server_faults import InProcessServer, wait_for_health

ERROR_KEYS = {"message", "type", "param", "code"}
EXAMPLES = 60  # per operation and generation mode; ~1-2 min in all on 2 cores


# the schema as the app publishes it at /openapi.json (building it needs no engine)
schema = schemathesis.openapi.from_dict(create_app(ServerConfig(), EngineConfig()).openapi())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = build_checkpoint("mixtral", tmp_path_factory.mktemp("tiny"), num_layers=2)
    config = EngineConfig(model=str(folder), served_model_name="tiny", device="cpu", policy="lru", prefetch=False,
                          max_model_len=48)
    with InProcessServer(lambda: Engine.load(config)) as srv:
        wait_for_health(srv.url, 200, timeout=120)
        yield srv


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_no_500_no_422_and_every_error_in_its_apis_shape(case, server):
    response = case.call(base_url=server.url)
    assert response.status_code not in (422, 500), f"{case.method} {case.path}: {response.text[:500]}"
    assert response.status_code < 500 or response.status_code == 503, response.text[:500]
    if response.status_code >= 400 and case.path != "/health":  # /health answers {"status": ...}
        body = json.loads(response.content)
        if error_dialect(case.path) == "ollama":
            assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], response.text[:500]
            return
        outer = {"type", "error"} if error_dialect(case.path) == "anthropic" else {"error"}
        assert set(body) == outer and set(body["error"]) == ERROR_KEYS, response.text[:500]
        assert body.get("type", "error") == "error", response.text[:500]
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
