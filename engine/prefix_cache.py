"""KV caches of recent requests, kept for a later prompt that starts the same way.

A chat client sends the whole conversation each turn, so the next turn's prompt begins with
the last turn's prompt and answer. Reusing their KV cache skips that prefill, which with
offloaded experts is the slow part of a long conversation's first token (every expert the
prompt touches must be on the device). Entries are whole KV caches of finished requests,
matched by their token ids (llama.cpp's prompt cache and slots work the same way).

Memory: entries and the running request together hold at most `budget_tokens` of KV cache
(the context the server was sized for); the running request takes precedence, so entries are
dropped, least recently used first, as it grows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

MIN_REUSE_TOKENS = 16  # below this the prefill saved is less than the bookkeeping
TAKE_FRACTION = 0.5  # an entry whose prefix is reused by at least this share is moved, else copied


@dataclass
class Entry:
    tokens: list[int]  # the ids whose keys and values `kv` holds, in order
    kv: Cache
    shortest: int = 0  # the shortest prefix it can serve: all of it once a sliding window has dropped tokens


REUSABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer)


def reusable(kv: Cache | None) -> bool:
    """transformers' own cache and layer kinds, whose state after a prefix is known (a family's own
    cache class, such as MiniMax's, is not reused)."""
    return type(kv) is DynamicCache and bool(kv.layers) and all(type(layer) in REUSABLE_LAYERS for layer in kv.layers)


def shortest_prefix(kv: Cache, length: int) -> int:
    """The shortest prefix the cache can serve. A linear-attention (or state-space) state cannot be
    rewound, and a sliding-window layer past its window keeps only its last tokens: such a cache serves
    only its whole length (a chat's next turn), not a shorter prefix."""
    for layer in kv.layers:
        if type(layer) is LinearAttentionLayer:
            return length
        if type(layer) is DynamicSlidingWindowLayer and layer.cumulative_length >= layer.sliding_window:
            return length
    return 0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    def __init__(self, max_entries: int, budget_tokens: int) -> None:
        self.max_entries = max_entries
        self.budget_tokens = budget_tokens
        self._entries: list[Entry] = []  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_tokens(self) -> int:
        return sum(len(e.tokens) for e in self._entries)

    def take(self, prompt: list[int]) -> tuple[Cache | None, int]:
        """A KV cache holding the longest cached prefix of `prompt` (at most all but its last token,
        whose logits the step needs), and that prefix's length; (None, 0) when none is worth it.

        An entry mostly reused (a conversation's next turn) is moved out and cut to the prefix; one
        reused only in part (a shared system prompt, a regenerated long answer) is copied, so the
        conversation it holds stays for its own next turn."""
        best, reuse = None, 0
        for entry in self._entries:
            n = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            if n > reuse and n >= entry.shortest:
                best, reuse = entry, n
        if best is None or reuse < MIN_REUSE_TOKENS:
            return None, 0
        if reuse >= TAKE_FRACTION * len(best.tokens):
            self._entries.remove(best)
            if reuse < len(best.tokens):
                best.kv.crop(reuse - len(best.tokens))  # a negative count: the tokens to drop from the end
            return best.kv, reuse
        self._entries.remove(best)
        self._entries.append(best)  # used: the last to go
        return _prefix_copy(best.kv, reuse), reuse

    def put(self, tokens: list[int], kv: Cache | None) -> None:
        """Keep a finished request's KV cache (`tokens`: the ids it holds). An entry that is a
        prefix of it adds nothing and goes."""
        if not tokens or not reusable(kv) or kv.get_seq_length() != len(tokens):
            return
        self._entries = [e for e in self._entries if common_prefix(e.tokens, tokens) < len(e.tokens)]
        self._entries.append(Entry(list(tokens), kv, shortest_prefix(kv, len(tokens))))
        del self._entries[: max(0, len(self._entries) - self.max_entries)]
        self.make_room(0)

    def make_room(self, running_tokens: int) -> None:
        """Drop entries, least recently used first, until they fit beside a running request's
        `running_tokens` within the budget."""
        while self._entries and self.held_tokens + running_tokens > self.budget_tokens:
            self._entries.pop(0)

    def clear(self) -> None:
        self._entries.clear()


def _prefix_copy(kv: Cache, tokens: int) -> Cache:
    """A new cache with the first `tokens` positions of `kv`, whose layers hold every position
    (a shorter prefix than all of it is served only then)."""
    out = copy.copy(kv)
    out.layers = []
    for layer in kv.layers:
        part = copy.copy(layer)
        part.keys = layer.keys[..., :tokens, :].clone()  # [B, heads, T, D]
        part.values = layer.values[..., :tokens, :].clone()
        if type(layer) is DynamicSlidingWindowLayer:
            part.cumulative_length = tokens
        out.layers.append(part)
    return out
