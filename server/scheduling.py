"""Which request the engine runs next.

The engine runs one request at a time. The server hands it one at a time and picks the next:
a request that streams (someone is watching its answer arrive, as in a chat UI) goes before
waiting requests that do not (a chat UI's background tasks: Open WebUI's title, tags and
follow-up suggestions are all non-streamed), and a running non-streamed request is preempted
for it: aborted, and queued again ahead of the other non-streamed ones to run again from its
start (vLLM's priority scheduling also preempts by recomputing). Otherwise first come, first
served; a non-streamed request is passed over or preempted at most `MAX_OVERTAKEN` times, so a
steady flow of streams cannot starve it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.api import QueueFullError

MAX_OVERTAKEN = 8


@dataclass(eq=False)
class Ticket:
    streams: bool
    order: int  # arrival: first come, first served within a class
    granted: asyncio.Event = field(default_factory=asyncio.Event)
    overtaken: int = 0  # times a later request went first
    preempt: Callable[[], None] | None = None  # stops it while it runs; set by a non-streamed request
    preempted: bool = False


class Scheduler:
    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._waiting: list[Ticket] = []
        self._running: Ticket | None = None
        self._arrivals = itertools.count()

    @property
    def depth(self) -> int:
        """Requests waiting or running."""
        return len(self._waiting) + (self._running is not None)

    async def acquire(self, streams: bool) -> Ticket:
        """Waits for this request's turn; raises QueueFullError at `max_queue` requests."""
        if self.depth >= self.max_queue:
            raise QueueFullError(f"the engine queue is full ({self.max_queue} requests); retry later")
        ticket = Ticket(streams, next(self._arrivals))
        await self._wait_turn(ticket)
        return ticket

    async def requeue(self, ticket: Ticket) -> None:
        """A preempted request waits for its turn again, keeping its place of arrival."""
        ticket.granted.clear()
        ticket.preempted, ticket.preempt = False, None
        self.release(ticket)
        await self._wait_turn(ticket)

    def release(self, ticket: Ticket) -> None:
        """Its turn is over (or it stopped waiting); the next one goes."""
        if self._running is ticket:
            self._running = None
        elif ticket in self._waiting:
            self._waiting.remove(ticket)
        self._dispatch()

    async def _wait_turn(self, ticket: Ticket) -> None:
        self._waiting.append(ticket)
        self._preempt_for(ticket)
        self._dispatch()
        try:
            await ticket.granted.wait()
        except asyncio.CancelledError:  # the client left while waiting
            self.release(ticket)
            raise

    def _preempt_for(self, ticket: Ticket) -> None:
        running = self._running
        if (ticket.streams and running is not None and not running.streams and running.preempt is not None
                and not running.preempted and running.overtaken < MAX_OVERTAKEN):
            running.preempted = True
            running.overtaken += 1
            running.preempt()

    def _dispatch(self) -> None:
        if self._running is not None or not self._waiting:
            return
        chosen = self._next()
        self._waiting.remove(chosen)
        for ticket in self._waiting:
            ticket.overtaken += ticket.order < chosen.order
        self._running = chosen
        chosen.granted.set()

    def _next(self) -> Ticket:
        starved = [t for t in self._waiting if t.overtaken >= MAX_OVERTAKEN]
        if starved:
            return min(starved, key=lambda t: t.order)
        return min(self._waiting, key=lambda t: (not t.streams, t.order))
