"""Engine events as Ollama's `/api/chat` and `/api/generate` answers: one whole object, or a stream
of NDJSON lines (`"done": false` with each piece, then a `"done": true` line with the counts).

The output is read as chat's is (`output_reader`): thinking, text and tool calls come back as
`thinking`, `content` (`response`) and `tool_calls` (arguments an object, not a JSON string).

Durations are nanoseconds, measured in the server (the engine reports no timings): `total_duration`
from the request's arrival to its end; `prompt_eval_duration` from its hand-over to the engine to the
first token (so the prompt and the first decode step); `eval_duration` from the first token to the
last; `load_duration` 0 (the model is loaded when the server starts). `prompt_eval_count` is the whole
prompt, the part read from the prefix cache too.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import ClassVar

from pydantic import BaseModel

from engine.api import GenerationEvent, Usage
from server import ollama_protocol as o
from server.reasoning import Reasoning, ReasoningPlan
from server.serving import JSONLines, Outcome, TimedOutcome, output_reader
from server.tool_parsers import ToolCall
from server.tools import ToolPlan


def created_at() -> str:
    """Now, in RFC 3339 (as Ollama writes it: UTC, `Z`)."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass
class Answer:
    """Pieces of an output, gathered: its text, its thinking and its tool calls."""

    content: str = ""
    thinking: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def of(cls, pieces: list) -> Answer:
        answer = cls()
        for piece in pieces:
            if isinstance(piece, Reasoning):
                answer.thinking += piece.text
            elif isinstance(piece, str):
                answer.content += piece
            else:
                answer.calls.append(piece)
        return answer

    def __bool__(self) -> bool:
        return bool(self.content or self.thinking or self.calls)


def tool_calls(calls: list[ToolCall]) -> list[o.ToolCallOut]:
    # the parsers pass on only calls whose arguments are a JSON object
    return [o.ToolCallOut(function=o.FunctionCallOut(name=c.name, arguments=json.loads(c.arguments))) for c in calls]


@dataclass
class OllamaFormat(JSONLines):
    """The `Format` (server/serving.py) both generating endpoints share: one choice, NDJSON lines."""

    model: str
    started_ns: int  # when the request arrived (time.monotonic_ns)
    tool_plan: ToolPlan = field(default_factory=ToolPlan)
    reasoning_plan: ReasoningPlan = field(default_factory=ReasoningPlan)

    def __post_init__(self) -> None:
        self._reader = output_reader(self.tool_plan, self.reasoning_plan)

    def choice(self, index: int) -> OllamaFormat:
        return replace(self)  # its own reader

    def outcome(self) -> Outcome:
        return TimedOutcome()

    def opening(self) -> list[BaseModel]:
        return []

    def delta(self, event: GenerationEvent, offset: int) -> list[BaseModel]:
        answer = Answer.of(self._reader.feed(event.text) if self._reader else [event.text])
        return [self.reply(answer, done=False)] if answer else []

    def finish(self, outcome: Outcome) -> list[BaseModel]:
        rest = Answer.of(self._reader.finish()) if self._reader else Answer()
        return ([self.reply(rest, done=False)] if rest else []) + [self.reply(Answer(), **self._ending(outcome))]

    def usage(self, outcomes: list[Outcome]) -> BaseModel:
        return self.reply(Answer(), **self._ending(outcomes[0]))  # not asked for: the last line carries it

    def response(self, outcomes: list[Outcome]) -> BaseModel:
        (outcome,) = outcomes
        reader = output_reader(self.tool_plan, self.reasoning_plan)
        answer = Answer.of(reader.feed(outcome.text) + reader.finish() if reader else [outcome.text])
        return self.reply(answer, **self._ending(outcome))

    def _ending(self, outcome: TimedOutcome) -> dict:
        """The last object's fields: done, why, and the counts and durations (`outcome`: one of `outcome()`'s)."""
        now = time.monotonic_ns()
        first, last = outcome.first_ns or now, outcome.last_ns or now
        usage = outcome.usage or Usage(0, 0)
        return {"done": True, "done_reason": outcome.finish_reason, "total_duration": now - self.started_ns,
                "load_duration": 0, "prompt_eval_count": usage.prompt_tokens,
                "prompt_eval_duration": first - outcome.started_ns, "eval_count": usage.completion_tokens,
                "eval_duration": last - first}

    def reply(self, answer: Answer, **fields) -> BaseModel:
        raise NotImplementedError


@dataclass
class ChatFormat(OllamaFormat):
    prompt_param: ClassVar[str] = "messages"

    def reply(self, answer: Answer, **fields) -> o.ChatReply:
        message: dict = {"content": answer.content}
        if answer.thinking:
            message["thinking"] = answer.thinking
        if answer.calls:
            message["tool_calls"] = tool_calls(answer.calls)
        return o.ChatReply(model=self.model, created_at=created_at(), message=o.MessageOut(**message), **fields)


@dataclass
class GenerateFormat(OllamaFormat):
    prompt_param: ClassVar[str] = "prompt"

    def reply(self, answer: Answer, **fields) -> o.GenerateReply:
        if answer.thinking:
            fields["thinking"] = answer.thinking
        return o.GenerateReply(model=self.model, created_at=created_at(), response=answer.content, **fields)


def loaded_reply(fmt: OllamaFormat, unload: bool) -> BaseModel:
    """Ollama's answer to a request with nothing to generate (a client loading the model, or with
    `keep_alive` 0 unloading it): done at once."""
    return fmt.reply(Answer(), done=True, done_reason="unload" if unload else "load")
