"""A conversation longer than the context on `/api/chat`, as Ollama treats it: the oldest messages are
dropped until the prompt fits, instead of the 400 that `/v1/chat/completions` answers (as vLLM does).

- What must fit: the prompt as the model's chat template renders it, with the request's tools and the
  generation prompt's tail, leaving room for at least one answer token. The answer is not counted (Ollama
  checks the prompt only); its `max_tokens` is then cut to the room left (`ChatPlan.params_within`).
- The limit is the server's context (`--max-model-len`), or `options.num_ctx` where that is smaller (a
  user who set 2048 expects the history cut at 2048 tokens). A larger `num_ctx` is capped to the server's
  context (logged once). The answer may still run to the server's context, as Ollama's runs past
  `num_ctx` by shifting its context.
- What is dropped: whole messages, from the oldest non-system one onward; system messages stay. The kept
  history starts at a user message, so an assistant turn goes together with the tool answers that follow
  it (no tool answer is left without its call), and templates that demand user/assistant alternation
  (Mixtral's) still render it. The latest user message, and what follows it, always stays.
- If even that does not fit, or the request sent `truncate: false` and the whole prompt does not, the
  request is refused with a 400 that says the input exceeds the context length.
- The cut point is found by a binary search over where the kept history may start (the prompt only
  shrinks as more is dropped), so a long chat is rendered about log2(turns) times, not once per message;
  a prompt that fits is rendered once, as on every other route.
- `/api/generate` (one prompt) is not truncated.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine.api import InvalidRequestError
from server import protocol as p
from server.ollama_protocol import Options

log = logging.getLogger(__name__)

Render = Callable[[list[p.ChatMessage]], list[int]]  # messages -> the prompt's tokens


@dataclass(frozen=True)
class ContextFit:
    """How `/api/chat` makes its prompt fit: `limit` tokens, from the server's context or `options.num_ctx`."""

    limit: int
    truncate: bool = True
    by_num_ctx: bool = False

    def prompt(self, messages: list[p.ChatMessage], render: Render) -> list[int]:
        """The prompt of `messages`, with the oldest dropped where it does not fit otherwise; blocking
        (it renders the template), so call it in a worker thread."""
        whole = render(messages)
        if self._fits(whole):
            return whole
        if not self.truncate:
            raise self._too_long(f"the prompt is {len(whole)} tokens (truncate is false)")
        starts = _history_starts(messages)
        shortest = render(kept_messages(messages, starts[-1]))
        if not self._fits(shortest):
            raise self._too_long(f"the system message(s) and the latest message alone are {len(shortest)} tokens")
        prompt, start = self._longest_fitting(messages, starts, shortest, render)
        log.info("/api/chat: dropped %d of %d messages to fit the context of %d tokens: the prompt is %d tokens, "
                 "was %d", len(messages) - len(kept_messages(messages, start)), len(messages), self.limit,
                 len(prompt), len(whole))
        return prompt

    def _longest_fitting(self, messages: list[p.ChatMessage], starts: list[int], shortest: list[int],
                         render: Render) -> tuple[list[int], int]:
        """The prompt (and where its history starts) that keeps the most history and fits, given that
        the history from `starts[0]` does not fit and the one from `starts[-1]` (`shortest`) does."""
        too_long, fitting, prompt = 0, len(starts) - 1, shortest
        while fitting - too_long > 1:
            middle = (too_long + fitting) // 2
            candidate = render(kept_messages(messages, starts[middle]))
            if self._fits(candidate):
                fitting, prompt = middle, candidate
            else:
                too_long = middle
        return prompt, starts[fitting]

    def _fits(self, prompt: list[int]) -> bool:
        return len(prompt) < self.limit  # room for at least one answer token

    def _too_long(self, detail: str) -> InvalidRequestError:
        limit = f"{self.limit} tokens" + (" (options.num_ctx)" if self.by_num_ctx else "")
        return InvalidRequestError(f"the input length exceeds the context length ({limit}): {detail}",
                                   param="messages", code="context_length_exceeded")


def context_fit(options: Options | None, truncate: bool | None, max_model_len: int) -> ContextFit:
    """The fit a request asks for: `truncate` (unless false) within the server's context or a smaller
    positive `num_ctx`."""
    num_ctx = options.num_ctx if options is not None else None
    truncates = truncate is not False
    if num_ctx is None or num_ctx < 1:
        return ContextFit(max_model_len, truncates)
    if num_ctx >= max_model_len:
        if num_ctx > max_model_len:
            _log_capped(num_ctx, max_model_len)
        return ContextFit(max_model_len, truncates)
    return ContextFit(num_ctx, truncates, by_num_ctx=True)


# once per value (a few kept): clients such as Open WebUI send num_ctx with every request
@functools.lru_cache(maxsize=8)
def _log_capped(num_ctx: int, max_model_len: int) -> None:
    log.info("options.num_ctx %d is larger than the server's context: capped to %d tokens (--max-model-len)",
             num_ctx, max_model_len)


def kept_messages(messages: list[p.ChatMessage], start: int) -> list[p.ChatMessage]:
    """The history from `start` on, after the system messages before it."""
    return [m for m in messages[:start] if m.role == "system"] + messages[start:]


def _history_starts(messages: list[p.ChatMessage]) -> list[int]:
    """Where the kept history may start, from the most kept to the least: the first non-system message
    (nothing dropped), then each later user message."""
    first = next((k for k, m in enumerate(messages) if m.role != "system"), len(messages))
    return [first] + [k for k in range(first + 1, len(messages)) if messages[k].role == "user"]
