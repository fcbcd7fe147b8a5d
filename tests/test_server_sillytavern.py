"""SillyTavern's Text Completion backends Ollama, vLLM and Generic (OpenAI-compatible), replayed: the streamed
bodies SillyTavern 1.19.0 sent them (recorded by bench/sillytavern_browser.py, the prompt shortened, the model
renamed), on the real server test_server_infill.py uses. Its llama.cpp backend is test_server_llamacpp.py's.

Ollama: SillyTavern posts `/api/generate` with `raw`, `keep_alive: -1` and its samplers in `options` (some this
server does not use: `typical_p`, `repeat_last_n`, `num_ctx`), and reads the stream object by object, each
`response` a piece. vLLM: `/v1/completions` with vLLM's extra samplers (`top_k: -1`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `skip_special_tokens`, `spaces_between_special_tokens`);
Generic: the same route, OpenAI's fields only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.testing import sse_json
from tests import test_server_infill as infill
from tests.test_server_fim import MODEL

CLIENTS = Path(__file__).parent / "fixtures" / "clients"
server, http = infill.server, infill.http  # the same fixtures, the same server
TOKENS = 4


def recorded(name: str, **changes) -> dict:
    return {**json.loads((CLIENTS / f"sillytavern_{name}.json").read_text()), "model": MODEL, **changes}


def test_sillytavern_s_ollama_generate_is_answered(http):
    body = recorded("ollama_generate")
    assert body["raw"] is True and body["keep_alive"] == -1 and body["stream"] is True  # as SillyTavern sends it
    body["options"]["num_predict"] = TOKENS
    with http.stream("POST", "/api/generate", json=body) as stream:
        assert stream.status_code == 200, stream.read()
        assert stream.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in stream.iter_lines() if line]  # one object a line, as it parses them
    *pieces, last = lines
    assert all(isinstance(piece["response"], str) and piece["done"] is False for piece in pieces)
    assert last["done"] is True and last["eval_count"] <= TOKENS and last["done_reason"] in ("stop", "length")
    assert "error" not in last


@pytest.mark.parametrize("name", ["vllm_completion", "generic_completion"])
def test_sillytavern_s_v1_completions_are_answered(http, name):
    body = recorded(name, max_tokens=TOKENS)
    if name == "vllm_completion":
        assert body["top_k"] == -1 and body["spaces_between_special_tokens"] is True  # vLLM's extra samplers
    with http.stream("POST", "/v1/completions", json=body) as stream:
        assert stream.status_code == 200, stream.read()
        *chunks, done = list(sse_json(stream.iter_lines()))
    assert done == "[DONE]"
    assert all(isinstance(chunk["choices"][0]["text"], str) for chunk in chunks if chunk["choices"])
    finished = [chunk["choices"][0]["finish_reason"] for chunk in chunks if chunk["choices"]]
    assert finished[-1] in ("stop", "length")
