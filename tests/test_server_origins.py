"""Browser pages calling the server (CORS, `--allowed-origins`): local pages and apps by default,
preflights answered without the API key, other sites refused with 403 before anything runs.

The real app over the scripted stand-in engine of tests/test_server_faults.py.
"""

from __future__ import annotations

import json
import time

import pytest
from starlette.testclient import TestClient

from engine.config import EngineConfig
from server.app import create_app
from server.config import ConfigError, ServerConfig, load_config
from server.origins import OriginPolicy
from tests.test_server_faults import ScriptedEngine

KEY = "sk-origin-test"
CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
JSON = {"content-type": "application/json"}


class CountingEngine(ScriptedEngine):
    """Counts the generations it ran: a refused page must not start one."""

    generations = 0

    def generate(self, request, should_abort):
        CountingEngine.generations += 1
        return super().generate(request, should_abort)


def app_client(**server_fields) -> TestClient:
    app = create_app(ServerConfig(**server_fields), EngineConfig(), load_engine=lambda: CountingEngine(fail=False))
    return TestClient(app, base_url="http://localhost:8000")


@pytest.fixture(scope="module")
def client():
    with app_client(api_key=KEY) as test_client:
        for _ in range(500):
            if test_client.get("/health").status_code == 200:
                break
            time.sleep(0.01)
        yield test_client


def preflight(client: TestClient, origin: str):
    return client.options("/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def post_chat(client: TestClient, origin: str | None, key: str | None = KEY):
    headers = {**JSON, **({"Origin": origin} if origin else {}), **({"Authorization": f"Bearer {key}"} if key else {})}
    return client.post("/v1/chat/completions", content=CHAT, headers=headers)


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1:5173", "https://localhost",
                                    "http://[::1]:8080", "app://obsidian.md", "vscode-webview://1f2e3d",
                                    "tauri://localhost", "file://"])
def test_local_pages_and_apps_are_allowed_by_default(origin):
    assert OriginPolicy.from_setting(None).allows(origin)


@pytest.mark.parametrize("origin", ["https://attacker.example", "http://localhost.attacker.example",
                                    "http://127.0.0.1.nip.io", "null", "http://localhostx:3000",
                                    "chrome-extension://abcdef"])
def test_other_sites_are_refused_by_default(origin):
    assert not OriginPolicy.from_setting(None).allows(origin)


def test_patterns_match_whole_origins_ignoring_case():
    policy = OriginPolicy.from_setting("https://*.example.com, http://192.168.1.5:3000")
    assert policy.allows("https://chat.example.com") and policy.allows("HTTPS://Chat.Example.com")
    assert policy.allows("http://192.168.1.5:3000")
    assert not policy.allows("https://example.com.attacker.net")
    assert not policy.allows("http://192.168.1.5:30001") and not policy.allows("http://localhost:3000")
    assert OriginPolicy.from_setting("*").allows("https://anything.example")


def test_a_preflight_from_a_local_page_is_answered_without_the_key(client):
    response = preflight(client, "http://localhost:3000")
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "authorization" in response.headers["access-control-allow-headers"].lower()
    assert "POST" in response.headers["access-control-allow-methods"]


def test_a_local_page_reads_the_answer_and_the_warning_header(client):
    response = post_chat(client, "http://localhost:3000")
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "ab"
    assert response.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "x-moe-serve-warning" in response.headers["access-control-expose-headers"].lower()


def test_a_local_page_still_needs_the_key_and_can_read_the_401(client):
    response = post_chat(client, "http://localhost:3000", key=None)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_another_site_is_refused_before_the_model_runs(client):
    before = CountingEngine.generations
    assert preflight(client, "https://attacker.example").status_code == 400
    # a form or a text/plain POST skips the preflight: the server must refuse it itself
    response = client.post("/v1/chat/completions", content=CHAT, headers={
        "content-type": "text/plain", "Origin": "https://attacker.example", "Authorization": f"Bearer {KEY}"})
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "origin_not_allowed" and "--allowed-origins" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "access-control-allow-origin" not in response.headers
    assert CountingEngine.generations == before


def test_a_page_of_the_server_itself_is_same_origin(client):
    # /docs is served by the server: its requests carry the server's own origin, whatever the host name
    response = client.post("/v1/chat/completions", content=CHAT, headers={
        **JSON, "Host": "localhost:8000", "Origin": "http://localhost:8000", "Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200
    other_host = app_client(host="0.0.0.0", api_key=KEY)
    with other_host:
        response = other_host.get("/v1/models", headers={"Host": "gpu-box:8000", "Origin": "http://gpu-box:8000",
                                                          "Authorization": f"Bearer {KEY}"})
        assert response.status_code == 200
        assert other_host.get("/v1/models", headers={"Host": "gpu-box:8000", "Origin": "http://gpu-box:9000",
                                                     "Authorization": f"Bearer {KEY}"}).status_code == 403


def test_clients_without_an_origin_are_unaffected(client):
    assert post_chat(client, None).status_code == 200


def test_any_origin_when_asked():
    with app_client(allowed_origins="*") as open_client:
        response = open_client.get("/v1/models", headers={"Origin": "https://chat.example.org"})
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "*"
        assert preflight(open_client, "https://chat.example.org").status_code == 200


def test_the_setting_comes_from_flag_env_and_yaml(tmp_path):
    server, _ = load_config(["--allowed-origins", "https://*.example.com"], environ={})
    assert server.allowed_origins == "https://*.example.com"
    server, _ = load_config([], environ={"MOE_SERVE_ALLOWED_ORIGINS": "*"})
    assert server.allowed_origins == "*"
    config = tmp_path / "config.yaml"
    config.write_text("allowed_origins: http://localhost:3000,app://*\n")
    server, _ = load_config(["--config", str(config)], environ={})
    assert OriginPolicy.from_setting(server.allowed_origins).allows("app://obsidian.md")
    assert load_config([], environ={})[0].allowed_origins is None


@pytest.mark.parametrize("setting", ["localhost:3000", "http://localhost:3000,,app://*", "example.com"])
def test_a_pattern_that_is_not_an_origin_is_refused(setting):
    with pytest.raises(ConfigError, match="allowed-origins"):
        load_config(["--allowed-origins", setting], environ={})
