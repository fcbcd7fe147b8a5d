"""Embedding requests that arrive while the engine is busy go to it together (`server.embeddings.EmbeddingGroups`):
one set of padded passes for the group, each request answered with its own vectors and token count. On the real
app and `EngineClient` over a scripted engine whose vectors tell which input they were computed from."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from engine.api import GenerationEvent, GenerationRequest, Usage
from tests.test_server_faults import InProcessServer, ScriptedEngine

WAIT_S = 30


class EmbeddingEngine(ScriptedEngine):
    """Embeds each input as [its length, its first id, its last id]; holds its first request until `release`."""

    hidden_size = 3
    max_model_len = 4096

    def __init__(self, fail_after: int | None = None, held: int = 1) -> None:
        super().__init__(fail=False)
        self.passes: list[list[list[int]] | str] = []  # each engine request's inputs ("chat" for a chat)
        self.busy, self.release = threading.Event(), threading.Event()
        self.fail_after = fail_after
        self.held = [(threading.Event(), threading.Event()) for _ in range(held)]  # (running, release) of passes 1..

    def encode(self, text: str) -> list[int]:
        return [int(word) for word in text.split()]

    def generate(self, request: GenerationRequest, should_abort: Callable[[], bool]) -> Iterator[GenerationEvent]:
        if request.pooling is None:
            self.passes.append("chat")
            yield from super().generate(request, should_abort)
            return
        inputs = list(request.inputs)
        self.passes.append(inputs)
        if len(self.passes) == 1:
            self.busy.set()
            assert self.release.wait(WAIT_S)
        if 1 < len(self.passes) <= len(self.held):  # as the real engine, an embedding pass is not cut short
            running, release = self.held[len(self.passes) - 1]
            running.set()
            assert release.wait(WAIT_S)
        if self.fail_after is not None and len(self.passes) > self.fail_after:
            raise RuntimeError("the device fell off the bus")
        vectors = tuple((float(len(ids)), float(ids[0]), float(ids[-1])) for ids in inputs)
        yield GenerationEvent("", finish_reason="stop", usage=Usage(sum(map(len, inputs)), 0), embeddings=vectors)


def text(first: int, length: int) -> str:
    return " ".join(str(first + i) for i in range(length))


def expected(first: int, length: int) -> list[float]:
    return [float(length), float(first), float(first + length - 1)]


def groups_of(server: InProcessServer):
    return server.server.config.app.state.embedding_groups


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def members_waiting(server: InProcessServer) -> int:
    group = groups_of(server)._open
    return 0 if group is None else len(group.members)


def embed(url: str, inputs: list[str], timeout: float = WAIT_S) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", timeout=timeout,
                      json={"model": "scripted", "input": inputs, "encoding_format": "float"})


@pytest.fixture
def busy_server():
    """A server whose engine is held by a first embedding request; `pool` sends the others meanwhile."""
    engine = EmbeddingEngine()
    with InProcessServer(lambda: engine) as server, concurrent.futures.ThreadPoolExecutor(8) as pool:
        first = pool.submit(embed, server.url, [text(1000, 4)])
        assert engine.busy.wait(WAIT_S)
        yield engine, server, pool, first


def test_requests_waiting_together_go_in_one_pass_each_answered_with_its_own(busy_server):
    engine, server, pool, first = busy_server
    asks = {100 * (i + 1): 3 + i % 3 for i in range(6)}  # first id → length: 3-5 tokens each
    answers = {start: pool.submit(embed, server.url, [text(start, length)]) for start, length in asks.items()}
    wait_until(lambda: members_waiting(server) == len(asks))
    engine.release.set()
    assert first.result().json()["data"][0]["embedding"] == pytest.approx(unit(expected(1000, 4)))
    for start, length in asks.items():
        answer = answers[start].result()
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert [d["index"] for d in body["data"]] == [0]
        assert body["data"][0]["embedding"] == pytest.approx(unit(expected(start, length)))
        assert body["usage"]["prompt_tokens"] == length
    assert len(engine.passes) == 2  # the first request alone, then the six together
    assert sorted(ids[0] for ids in engine.passes[1]) == sorted(asks)


def unit(vector: list[float]) -> list[float]:
    norm = sum(x * x for x in vector) ** 0.5
    return [x / norm for x in vector]


def test_a_request_of_several_inputs_keeps_its_order_in_a_group(busy_server):
    engine, server, pool, _ = busy_server
    many = pool.submit(embed, server.url, [text(500, 9), text(600, 2), text(700, 5)])
    one = pool.submit(embed, server.url, [text(800, 7)])
    wait_until(lambda: members_waiting(server) == 2)
    engine.release.set()
    body = many.result().json()
    for data, (start, length) in zip(body["data"], [(500, 9), (600, 2), (700, 5)], strict=True):
        assert data["embedding"] == pytest.approx(unit(expected(start, length)))
    assert body["usage"]["prompt_tokens"] == 16
    assert one.result().json()["data"][0]["embedding"] == pytest.approx(unit(expected(800, 7)))


def test_a_request_whose_client_left_is_not_computed(busy_server):
    engine, server, pool, _ = busy_server
    stays = pool.submit(embed, server.url, [text(100, 3)])
    with pytest.raises(httpx.ReadTimeout):  # gives up while the engine is held
        embed(server.url, [text(200, 3)], timeout=0.5)
    wait_until(lambda: members_waiting(server) == 2)
    time.sleep(0.3)  # the server sees the disconnect
    engine.release.set()
    assert stays.result().json()["data"][0]["embedding"] == pytest.approx(unit(expected(100, 3)))
    assert [ids[0] for ids in engine.passes[1]] == [100]


def test_every_request_of_a_failed_group_gets_the_error():
    engine = EmbeddingEngine(fail_after=1)
    with InProcessServer(lambda: engine) as server, concurrent.futures.ThreadPoolExecutor(8) as pool:
        first = pool.submit(embed, server.url, [text(1000, 4)])
        assert engine.busy.wait(WAIT_S)
        answers = [pool.submit(embed, server.url, [text(100 * i, 3)]) for i in (1, 2)]
        wait_until(lambda: members_waiting(server) == 2)
        engine.release.set()
        assert first.result().status_code == 200
        statuses = {answer.result().status_code for answer in answers}
        assert len(statuses) == 1 and statuses.pop() >= 500
        assert all("error" in answer.result().json() for answer in answers)


def test_a_streamed_chat_goes_first_between_two_passes_of_a_group():
    """A group of two passes (two long inputs) is running its first when a streamed chat arrives: the chat
    runs before the second pass, and each request still gets its own vectors."""
    engine = EmbeddingEngine(held=2)
    with InProcessServer(lambda: engine) as server, concurrent.futures.ThreadPoolExecutor(8) as pool:
        first = pool.submit(embed, server.url, [text(1000, 4)])
        assert engine.busy.wait(WAIT_S)
        long_ones = {start: pool.submit(embed, server.url, [text(start, 1500)]) for start in (10_000, 20_000)}
        wait_until(lambda: members_waiting(server) == 2)
        engine.release.set()
        running, release = engine.held[1]
        assert running.wait(WAIT_S)  # the group's first pass
        chat = pool.submit(httpx.post, f"{server.url}/v1/chat/completions", timeout=WAIT_S,
                           json={"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        wait_until(lambda: server.server.config.app.state.serving.scheduler._running.preempted)
        release.set()
        assert chat.result().status_code == 200 and "data: [DONE]" in chat.result().text
        for start, answer in long_ones.items():
            assert answer.result().json()["data"][0]["embedding"] == pytest.approx(unit(expected(start, 1500)))
        assert first.result().status_code == 200
    firsts = [p if p == "chat" else [ids[0] for ids in p] for p in engine.passes]
    assert firsts[1:] in ([[10_000], "chat", [20_000]], [[20_000], "chat", [10_000]])


def test_a_full_group_closes_and_the_next_requests_form_another(busy_server):
    """A group takes at most `max_inputs` inputs: the requests after it wait in the next group, each answered."""
    engine, server, pool, _ = busy_server
    groups_of(server).max_inputs = 4
    starts = [100 * (i + 1) for i in range(6)]  # the pool's other 7 threads send them all at once
    answers = {start: pool.submit(embed, server.url, [text(start, 3), text(start + 50, 2)]) for start in starts}
    wait_until(lambda: groups_count(server) == 3 and members_waiting(server) == 2)
    engine.release.set()
    for start, answer in answers.items():
        data = answer.result().json()["data"]
        assert data[0]["embedding"] == pytest.approx(unit(expected(start, 3)))
        assert data[1]["embedding"] == pytest.approx(unit(expected(start + 50, 2)))
    assert [len(p) for p in engine.passes[1:]] == [4] * 3  # two requests (four inputs) per group, one pass each


def groups_count(server: InProcessServer) -> int:
    """Groups still to run: each holds a place in the scheduler's queue."""
    return len(server.server.config.app.state.serving.scheduler._waiting)
