"""Embeddings end to end: OpenAI's `/v1/embeddings` (through the openai SDK, which asks for base64, and as
float lists) and Ollama's `/api/embed` and `/api/embeddings`, on the real server of the fill-in-the-middle
tests (tiny random Qwen3-MoE, Qwen2.5-Coder's tokenizer). Each vector is checked against transformers' own
base model over the same tokens, mean-pooled (the server's default `--pooling`)."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct

import httpx
import pytest
import torch

from tests.conftest import QWEN_CODER_MODEL as MODEL
from tests.fixtures.models import load_reference

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n", "héllo wörld"]
TOLERANCE = 1e-4  # float32 on both sides, another order of sums (see tests/test_engine_embeddings.py)


@pytest.fixture(scope="module")
def server(qwen_coder_server):
    return qwen_coder_server


@pytest.fixture(scope="module")
def http(server):
    with server.http(timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def reference(qwen_coder_checkpoint):
    from transformers import AutoTokenizer

    return load_reference(qwen_coder_checkpoint), AutoTokenizer.from_pretrained(qwen_coder_checkpoint)


def pooled(reference, ids: list[int]) -> torch.Tensor:
    """[H]: the mean of transformers' last hidden states over `ids`."""
    model, _ = reference
    with torch.no_grad():
        return model.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0].float().mean(0)


def text_ids(reference, text: str) -> list[int]:
    return reference[1](text)["input_ids"]


def unit(vector: torch.Tensor) -> torch.Tensor:
    return vector / vector.norm()


def close(got, expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), expected, atol=TOLERANCE, rtol=0)


def embeddings(http: httpx.Client, **body) -> dict:
    answer = http.post("/v1/embeddings", json={"model": MODEL, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_openai_sdk_gets_normalized_mean_pooled_vectors(server, reference):
    with server.openai() as client:
        answer = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks base64 and decodes it
    assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == MODEL
    for text, data in zip(TEXTS, answer.data):
        close(data.embedding, unit(pooled(reference, text_ids(reference, text))))
    tokens = sum(len(text_ids(reference, text)) for text in TEXTS)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == tokens


def test_float_lists_are_the_base64_vectors(http):
    as_floats = embeddings(http, input=TEXTS[0], encoding_format="float")
    as_base64 = embeddings(http, input=TEXTS[0], encoding_format="base64")["data"][0]["embedding"]
    raw = base64.b64decode(as_base64)
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert as_floats["object"] == "list" and as_floats["data"][0]["object"] == "embedding"
    close(as_floats["data"][0]["embedding"], torch.tensor(decoded))
    assert math.isclose(sum(x * x for x in decoded), 1.0, rel_tol=1e-5)


def test_token_ids_are_the_text(http, reference):
    ids = text_ids(reference, TEXTS[1])
    by_ids = embeddings(http, input=ids)["data"][0]["embedding"]
    by_batch = embeddings(http, input=[ids, text_ids(reference, TEXTS[0])])["data"]
    by_text = embeddings(http, input=TEXTS[1])["data"][0]["embedding"]
    close(by_ids, torch.tensor(by_text))
    close(by_batch[0]["embedding"], torch.tensor(by_text))


def test_dimensions_keep_the_first_components_normalized_again(http, reference):
    full = torch.tensor(embeddings(http, input=TEXTS[0])["data"][0]["embedding"])
    short = embeddings(http, input=TEXTS[0], dimensions=8)["data"][0]["embedding"]
    assert len(short) == 8
    close(short, unit(full[:8]))


@pytest.mark.parametrize("body, param, words", [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty list"),
    ({"input": ["ok", ""]}, "input", "input[1] is empty"),
    ({"input": [1, 2, 10**9]}, "input", "token ids must be in"),
    ({"input": "x", "dimensions": 0}, "dimensions", "dimensions must be in"),
    ({"input": "x", "dimensions": 10**6}, "dimensions", "dimensions must be in"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": ["x"] * 2049}, "input", "at most 2048"),
])
def test_bad_input_is_a_400_naming_the_field(http, body, param, words):
    answer = http.post("/v1/embeddings", json={"model": MODEL, **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"


def test_an_input_longer_than_the_context_is_a_400_and_ollama_cuts_it(server, http, reference):
    limit = http.get("/v1/models").json()["data"][0]["max_model_len"]
    ids = (text_ids(reference, TEXTS[0]) * (limit // 5 + 2))[: limit + 3]
    answer = http.post("/v1/embeddings", json={"model": MODEL, "input": ids})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"
    assert answer.json()["error"]["param"] == "input"
    long_text = TEXTS[0] * (limit // 5 + 2)
    cut = http.post("/api/embed", json={"model": MODEL, "input": long_text})
    assert cut.status_code == 200 and cut.json()["prompt_eval_count"] == limit
    refused = http.post("/api/embed", json={"model": MODEL, "input": long_text, "truncate": False})
    assert refused.status_code == 400 and "maximum context length" in refused.json()["error"]


def test_many_inputs_of_mixed_lengths_come_back_in_their_order(http, reference):
    """The server groups inputs by length into padded passes (and reorders them so): each vector is still
    its own input's, at its index, for OpenAI's route and Ollama's."""
    texts = [TEXTS[i % 3] * (1 + i % 4) for i in range(10)]  # lengths out of order, some equal
    expected = [unit(pooled(reference, text_ids(reference, text))) for text in texts]
    data = embeddings(http, input=texts, encoding_format="float")["data"]
    assert [d["index"] for d in data] == list(range(len(texts)))
    for got, want in zip(data, expected, strict=True):
        close(got["embedding"], want)
    ollama = http.post("/api/embed", json={"model": MODEL, "input": texts}).json()
    for got, want in zip(ollama["embeddings"], expected, strict=True):
        close(got, want)
    assert ollama["prompt_eval_count"] == sum(len(text_ids(reference, text)) for text in texts)


def test_a_too_long_input_among_others_is_named_by_its_index(http, reference):
    limit = http.get("/v1/models").json()["data"][0]["max_model_len"]
    short = text_ids(reference, TEXTS[0])
    answer = http.post("/v1/embeddings", json={"model": MODEL, "input": [short, short, (short * limit)[: limit + 1]]})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"
    assert answer.json()["error"]["message"].startswith("input[2]: ")


def test_ollama_embed_is_normalized_and_embeddings_is_not(http, reference):
    answer = http.post("/api/embed", json={"model": MODEL, "input": TEXTS[:2], "keep_alive": "5m"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["model"] == MODEL and body["total_duration"] > 0 and body["load_duration"] == 0
    assert body["prompt_eval_count"] == sum(len(text_ids(reference, text)) for text in TEXTS[:2])
    for text, vector in zip(TEXTS, body["embeddings"]):
        close(vector, unit(pooled(reference, text_ids(reference, text))))
    one = http.post("/api/embed", json={"model": MODEL, "input": TEXTS[0], "dimensions": 4}).json()
    close(one["embeddings"][0], unit(torch.tensor(body["embeddings"][0][:4])))
    legacy = http.post("/api/embeddings", json={"model": MODEL, "prompt": TEXTS[0]})
    assert legacy.status_code == 200, legacy.text
    close(legacy.json()["embedding"], pooled(reference, text_ids(reference, TEXTS[0])))


def test_ollama_clients_loading_the_model_get_empty_answers(http):
    """Ollama answers an empty input list (or prompt) at once: clients send one to load the model."""
    embed = http.post("/api/embed", json={"model": MODEL, "input": []})
    assert embed.status_code == 200 and embed.json()["embeddings"] == []
    legacy = http.post("/api/embeddings", json={"model": MODEL, "prompt": ""})
    assert legacy.status_code == 200 and legacy.json() == {"embedding": []}
    unknown = http.post("/api/embed", json={"model": "no-such-model", "input": "x"})
    assert unknown.status_code == 404 and "no-such-model" in unknown.json()["error"]


def test_a_body_sent_as_curl_d_sends_it_is_read_as_json(http):
    """Ollama's docs call it `curl URL -d '{...}'`: form-encoded, or no Content-Type at all from scripts."""
    body = json.dumps({"model": MODEL, "input": "hello"})
    for content_type in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {"Content-Type": content_type} if content_type else {}
        request = http.build_request("POST", "/api/embed", content=body.encode(), headers=headers)
        assert request.headers.get("Content-Type") == content_type  # httpx adds none to raw bytes
        answer = http.send(request)
        assert answer.status_code == 200, (content_type, answer.text)
        assert len(answer.json()["embeddings"]) == 1
    chat_body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    chat = http.post("/v1/chat/completions", content=json.dumps(chat_body).encode(),
                     headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    broken = http.post("/api/embed", content=b"model=x&input=y", headers={"Content-Type":
                                                                           "application/x-www-form-urlencoded"})
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]


# Open WebUI 0.12.4's bodies, as its document upload sent them (bench/open_webui_browser.py --rag): one chunk
# per request (RAG_EMBEDDING_BATCH_SIZE 1), no encoding_format; the query with its <attached_files> block.
OPEN_WEBUI_QUERY = ('<attached_files>\n<file type="file" id="33c619e4-8c6e-491b-ac2e-2d4cb626ce8f" '
                    'url="33c619e4-8c6e-491b-ac2e-2d4cb626ce8f" content_type="text/plain" name="project_heron.txt"/>\n'
                    "</attached_files>\n\nWhat is the secret launch code of Project Heron?")
OPEN_WEBUI_CHUNK = ("Among its records one line matters more than the rest. The secret launch code of Project Heron "
                    "is 4417. Nobody outside the team is supposed to know it.")


@pytest.mark.parametrize("route, extra, read", [
    ("/v1/embeddings", {}, lambda body: [item["embedding"] for item in body["data"]]),  # its OpenAI engine
    ("/api/embed", {"truncate": True}, lambda body: body["embeddings"]),  # its Ollama engine
])
def test_open_webui_document_bodies(http, reference, route, extra, read):
    for text in (OPEN_WEBUI_CHUNK, OPEN_WEBUI_QUERY):
        answer = http.post(route, json={"input": [text], "model": MODEL, **extra})
        assert answer.status_code == 200, answer.text
        (vector,) = read(answer.json())
        assert all(isinstance(x, float) for x in vector)
        close(vector, unit(pooled(reference, text_ids(reference, text))))


def test_a_document_embedded_one_chunk_per_request_all_at_once_is_served(server):
    """Open WebUI's default (a batch size of 1, no limit on concurrent requests): a 100 KB document's ~120 chunks
    arrive at once. The default --max-queue (Ollama's 512) takes them all; at the former 64, half were 503s."""
    chunks = [f"Chunk {i} of the document: the quick brown fox jumps over the lazy dog." for i in range(120)]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return await asyncio.gather(*(client.post("/v1/embeddings", json={"model": MODEL, "input": [chunk]})
                                          for chunk in chunks))

    answers = asyncio.run(burst())
    assert [a.status_code for a in answers] == [200] * len(chunks), {a.status_code for a in answers}
    vectors = [tuple(a.json()["data"][0]["embedding"]) for a in answers]
    assert len(set(vectors)) == len(chunks)  # each its own chunk's


def llama_embedding(http: httpx.Client, path: str = "/embedding", **body) -> list:
    answer = http.post(path, json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_llama_cpp_embedding_answers_a_list_of_pooled_vectors(http, reference):
    """llama.cpp's `/embedding`: a bare list, one `{"index", "embedding": [[vector]]}` per prompt, L2-normalized
    by default; `/embeddings` and `input` are the same as `/embedding` and `content`."""
    one = llama_embedding(http, content=TEXTS[0])
    assert [sorted(item) for item in one] == [["embedding", "index"]] and one[0]["index"] == 0
    (vector,) = one[0]["embedding"]
    close(vector, unit(pooled(reference, text_ids(reference, TEXTS[0]))))
    several = llama_embedding(http, "/embeddings", input=TEXTS)
    assert [item["index"] for item in several] == [0, 1, 2]
    for text, item in zip(TEXTS, several, strict=True):
        close(item["embedding"][0], unit(pooled(reference, text_ids(reference, text))))


def test_llama_cpp_prompts_of_ids_and_texts(http, reference):
    """A list of ids, texts among them or not, is one prompt (the texts tokenized in place); a list of lists is
    several."""
    ids = text_ids(reference, TEXTS[0])
    by_text = torch.tensor(llama_embedding(http, content=TEXTS[0])[0]["embedding"][0])
    close(llama_embedding(http, content=ids)[0]["embedding"][0], by_text)
    mixed = llama_embedding(http, content=[*ids, TEXTS[1]])
    assert len(mixed) == 1
    close(mixed[0]["embedding"][0], unit(pooled(reference, ids + text_ids(reference, TEXTS[1]))))
    two = llama_embedding(http, content=[ids, TEXTS[0]])
    assert len(two) == 2
    close(two[0]["embedding"][0], by_text)
    close(two[1]["embedding"][0], by_text)


@pytest.mark.parametrize("norm", [-1, 0, 1, 2, 3, 5000])
def test_llama_cpp_embd_normalize(http, reference, norm):
    raw = pooled(reference, text_ids(reference, TEXTS[2]))
    expected = {-1: raw, 0: raw * 32760 / raw.abs().max(), 1: raw / raw.abs().sum(), 2: unit(raw),
                3: raw / raw.abs().pow(3).sum().pow(1 / 3),
                5000: raw / raw.abs().max()}[norm]  # a large p: the p-norm tends to the largest component
    (item,) = llama_embedding(http, content=TEXTS[2], embd_normalize=norm)
    got = torch.tensor(item["embedding"][0])
    torch.testing.assert_close(got, expected, atol=TOLERANCE * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("body, param, words", [
    ({}, "content", '"input" or "content" must be provided'),
    ({"content": ""}, "content", "empty"),
    ({"input": []}, "input", "empty list"),
    ({"content": ["ok", ""]}, "content", "content[1] is empty"),
    ({"content": [1, 2, 10**9]}, "content", "token ids must be in"),
    ({"content": [[1, 2], [3, "x", -1]]}, "content", "content[1]: token ids must be in"),
    ({"content": "x", "embd_normalize": "2"}, "embd_normalize", ""),
])
def test_llama_cpp_bad_input_is_a_400_naming_the_field(http, body, param, words):
    answer = http.post("/embedding", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"
