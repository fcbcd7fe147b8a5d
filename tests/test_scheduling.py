"""The server's choice of the next request: streams first, preemption of non-streamed work for a
stream, first come first served otherwise, no starvation, a bounded queue."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from engine.api import GenerationEvent, GenerationRequest, QueueFullError, Usage
from server.scheduling import MAX_OVERTAKEN, Scheduler
from server.testing import sse_json
from tests.test_server_faults import CHAT, InProcessServer, ScriptedEngine, wait_for_health


async def started(scheduler: Scheduler, streams: bool, name: str, order: list[str]) -> asyncio.Task:
    """A request that records when its turn comes, then holds it until released."""
    async def run():
        ticket = await scheduler.acquire(streams)
        order.append(name)
        return ticket
    task = asyncio.ensure_future(run())
    await asyncio.sleep(0)
    return task


def run(coro):
    return asyncio.run(coro)


def test_a_stream_goes_before_waiting_background_requests_and_fifo_holds_otherwise():
    async def scenario():
        scheduler, order = Scheduler(max_queue=10), []
        first = await started(scheduler, False, "title", order)
        waiting = [await started(scheduler, s, n, order) for s, n in
                   [(False, "tags"), (False, "follow-ups"), (True, "chat"), (True, "chat-2")]]
        scheduler.release(await first)
        for _ in waiting:  # each in its turn ends, and the next one's turn comes
            await asyncio.sleep(0)
            scheduler.release(scheduler._running)
        return order
    assert run(scenario()) == ["title", "chat", "chat-2", "tags", "follow-ups"]


def test_a_running_background_request_is_preempted_for_a_stream_and_goes_first_after_it():
    async def scenario():
        scheduler, order, stopped = Scheduler(max_queue=10), [], []
        title = await (await started(scheduler, False, "title", order))
        title.preempt = lambda: stopped.append("title")
        tags = await started(scheduler, False, "tags", order)
        chat = await started(scheduler, True, "chat", order)
        assert stopped == ["title"] and title.preempted
        again = asyncio.ensure_future(scheduler.requeue(title))  # its engine request has ended
        await asyncio.sleep(0)
        scheduler.release(await chat)
        await again
        order.append("title again")
        scheduler.release(title)
        scheduler.release(await tags)
        return order
    assert run(scenario()) == ["title", "chat", "title again", "tags"]


def test_a_stream_does_not_preempt_a_stream():
    async def scenario():
        scheduler, order, stopped = Scheduler(max_queue=10), [], []
        chat = await (await started(scheduler, True, "chat", order))
        chat.preempt = lambda: stopped.append("chat")
        await started(scheduler, True, "chat-2", order)
        return stopped
    assert run(scenario()) == []


def test_background_requests_are_not_starved_by_a_flow_of_streams():
    async def scenario():
        scheduler, order = Scheduler(max_queue=100), []
        running = await (await started(scheduler, True, "s", order))
        await started(scheduler, False, "batch", order)
        for i in range(MAX_OVERTAKEN + 3):
            await started(scheduler, True, f"s{i}", order)
            scheduler.release(running)
            await asyncio.sleep(0)
            running = scheduler._running
        return order
    order = run(scenario())
    assert order.index("batch") == MAX_OVERTAKEN + 1  # after the first stream and MAX_OVERTAKEN later ones


def test_the_queue_is_bounded_and_a_client_that_leaves_frees_its_place():
    async def scenario():
        scheduler, order = Scheduler(max_queue=2), []
        running = await (await started(scheduler, False, "a", order))
        waiting = await started(scheduler, False, "b", order)
        with pytest.raises(QueueFullError):
            await scheduler.acquire(False)
        waiting.cancel()
        await asyncio.sleep(0)
        assert scheduler.depth == 1
        await started(scheduler, True, "c", order)
        scheduler.release(running)
        await asyncio.sleep(0)
        return order
    assert run(scenario()) == ["a", "c"]


# -- through the server: Open WebUI's title request and the user's chat ----------------------
class CountingEngine(ScriptedEngine):
    """Writes `max_tokens` words, one per step; a step waits until the test lets it (`steps`)."""

    def __init__(self) -> None:
        super().__init__(fail=False)
        self.steps = threading.Semaphore(0)
        self.started: list[int] = []  # max_tokens of each run begun
        self.written = 0  # words written, over all runs

    def generate(self, request: GenerationRequest, should_abort: Callable[[], bool]) -> Iterator[GenerationEvent]:
        count = request.params.max_tokens
        self.started.append(count)
        for i in range(count):
            while not self.steps.acquire(timeout=0.01):
                if should_abort():
                    yield GenerationEvent("", (), finish_reason="abort", usage=Usage(3, i))
                    return
            self.written += 1
            yield GenerationEvent(f"w{i} ", (5,))
        yield GenerationEvent("", (7,), finish_reason="stop", usage=Usage(3, count))


def test_a_chat_stream_preempts_a_running_title_request_which_then_completes_whole():
    engine = CountingEngine()
    with InProcessServer(lambda: engine) as srv:
        wait_for_health(srv.url, 200)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            title = pool.submit(httpx.post, f"{srv.url}/v1/chat/completions", json={**CHAT, "max_tokens": 6},
                                timeout=30)
            engine.steps.release(2)  # the title request is under way
            while engine.written < 2:
                time.sleep(0.01)
            with httpx.stream("POST", f"{srv.url}/v1/chat/completions", timeout=30,
                              json={**CHAT, "max_tokens": 3, "stream": True}) as chat:
                engine.steps.release(3)  # the chat's words
                text = "".join(e["choices"][0]["delta"].get("content") or "" for e in sse_json(chat.iter_lines())
                               if isinstance(e, dict) and e["choices"])
            assert not title.done()  # the chat finished first
            engine.steps.release(6)  # a whole new title run
            answer = title.result()
    assert text == "w0 w1 w2 "
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "w0 w1 w2 w3 w4 w5 "
    assert engine.started == [6, 3, 6]  # the title ran, gave way, and ran again from its start


def test_a_stream_preempts_the_running_choice_of_an_n_request_and_its_finished_choices_are_kept():
    engine = CountingEngine()
    with InProcessServer(lambda: engine) as srv:
        wait_for_health(srv.url, 200)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            title = pool.submit(httpx.post, f"{srv.url}/v1/chat/completions",
                                json={**CHAT, "max_tokens": 4, "n": 2}, timeout=30)
            engine.steps.release(5)  # choice 0 whole, choice 1 under way
            while engine.written < 5:
                time.sleep(0.01)
            with httpx.stream("POST", f"{srv.url}/v1/chat/completions", timeout=30,
                              json={**CHAT, "max_tokens": 3, "stream": True}) as chat:
                engine.steps.release(3)
                events = list(sse_json(chat.iter_lines()))
            assert not title.done() and events[-1] == "[DONE]"
            engine.steps.release(4)  # choice 1 again, from its start
            answer = title.result()
    assert answer.status_code == 200
    assert [c["message"]["content"] for c in answer.json()["choices"]] == ["w0 w1 w2 w3 "] * 2
    assert answer.json()["usage"]["completion_tokens"] == 8
    assert engine.started == [4, 4, 3, 4]  # choice 0, choice 1 (gave way), the chat, choice 1 again
