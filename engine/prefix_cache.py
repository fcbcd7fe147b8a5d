"""KV caches of recent requests, kept for a later prompt that starts the same way.

A chat client sends the whole conversation each turn, so the next turn's prompt begins with
the last turn's prompt and answer. Reusing their KV cache skips that prefill, which with
offloaded experts is the slow part of a long conversation's first token (every expert the
prompt touches must be on the device). Entries are whole KV caches of finished requests,
matched by their token ids (llama.cpp's prompt cache and slots work the same way).

Memory: entries on the device and the running request together hold at most `budget_tokens` of KV
cache (the context the server was sized for); the running request takes precedence, so entries
leave the device, least recently used first, as it grows. With a host tier (`--prefix-cache-host-gb`)
an entry that leaves the device moves to host RAM instead of being dropped, and is copied back when a
prompt reuses it: a chat's earlier turns survive the background requests a chat client sends between
them (a title, tags, follow-up suggestions, each holding the whole chat), which on a device sized for
one context would otherwise push them out. Copying a few thousand tokens' keys and values back takes
milliseconds; computing them again, a prefill through every expert the prompt touches. On the CPU the
tier moves nothing: the entry only counts against the host tier's bytes instead of the device budget.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

MIN_REUSE_TOKENS = 16  # below this the prefill saved is less than the bookkeeping
TAKE_FRACTION = 0.5  # an entry whose prefix is reused by at least this share is moved, else copied
MAX_HOST_ENTRIES = 64  # every prompt is compared with every entry: bounds that work


@dataclass
class Entry:
    tokens: list[int]  # the ids whose keys and values `kv` holds, in order
    kv: Cache
    shortest: int = 0  # the shortest prefix it can serve: all of it once a sliding window has dropped tokens
    on_host: bool = False  # moved to the host tier: not counted in the device budget


REUSABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer)
MOVABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)  # all their state is `keys` and `values`


def kv_bytes(kv: Cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in kv.layers)


class HostTier:
    """Host RAM for kept KV caches the device budget no longer holds, at most `capacity_bytes`."""

    def __init__(self, capacity_bytes: int, device: torch.device) -> None:
        self.capacity_bytes, self.device = capacity_bytes, device

    def can_hold(self, kv: Cache) -> bool:
        return all(type(layer) in MOVABLE_LAYERS for layer in kv.layers) and kv_bytes(kv) <= self.capacity_bytes

    def to_host(self, kv: Cache) -> None:
        if self.device.type != "cpu":
            self._move(kv, _pinned_copy)

    def to_device(self, kv: Cache) -> None:
        if self.device.type != "cpu":
            self._move(kv, lambda tensor: tensor.to(self.device))

    @staticmethod
    def _move(kv: Cache, move) -> None:
        for layer in kv.layers:
            layer.keys, layer.values = move(layer.keys), move(layer.values)


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    # pinned: the copy back runs at the link's full speed
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)


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
    def __init__(self, max_entries: int, budget_tokens: int, host: HostTier | None = None) -> None:
        self.max_entries = max_entries  # on the device; the host tier is bounded by its bytes
        self.budget_tokens = budget_tokens
        self.host = host
        self._entries: list[Entry] = []  # least recently used first, both tiers

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_tokens(self) -> int:
        """The tokens of the entries on the device."""
        return sum(len(e.tokens) for e in self._device_entries())

    @property
    def host_bytes(self) -> int:
        return sum(kv_bytes(e.kv) for e in self._host_entries())

    def summary(self) -> dict[str, int]:
        return {"entries_on_device": len(self._device_entries()), "tokens_on_device": self.held_tokens,
                "entries_in_host_ram": len(self._host_entries()), "host_ram_bytes": self.host_bytes,
                "host_ram_capacity_bytes": self.host.capacity_bytes if self.host else 0}

    def take(self, prompt: list[int]) -> tuple[Cache | None, int]:
        """A KV cache on the device holding the longest kept prefix of `prompt` (at most all but its
        last token, whose logits the step needs), and that prefix's length; (None, 0) when none is
        worth it.

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
        self._entries.remove(best)
        if reuse >= TAKE_FRACTION * len(best.tokens):
            if best.on_host:
                self.host.to_device(best.kv)
            if reuse < len(best.tokens):
                best.kv.crop(reuse - len(best.tokens))  # a negative count: the tokens to drop from the end
            return best.kv, reuse
        self._entries.append(best)  # used: the last to go
        part = _prefix_copy(best.kv, reuse)
        if best.on_host:
            self.host.to_device(part)
        return part, reuse

    def put(self, tokens: list[int], kv: Cache | None) -> None:
        """Keep a finished request's KV cache (`tokens`: the ids it holds). An entry that is a
        prefix of it adds nothing and goes."""
        if not tokens or not reusable(kv) or kv.get_seq_length() != len(tokens):
            return
        self._entries = [e for e in self._entries if common_prefix(e.tokens, tokens) < len(e.tokens)]
        self._entries.append(Entry(list(tokens), kv, shortest_prefix(kv, len(tokens))))
        while len(self._device_entries()) > self.max_entries:
            self._leave_device(self._device_entries()[0])
        self.make_room(0)

    def make_room(self, running_tokens: int) -> None:
        """Move entries off the device (to the host tier, else away), least recently used first,
        until those left fit beside a running request's `running_tokens` within the budget."""
        while (on_device := self._device_entries()) and self.held_tokens + running_tokens > self.budget_tokens:
            self._leave_device(on_device[0])

    def clear(self) -> None:
        self._entries.clear()

    def _device_entries(self) -> list[Entry]:
        return [e for e in self._entries if not e.on_host]

    def _host_entries(self) -> list[Entry]:
        return [e for e in self._entries if e.on_host]

    def _leave_device(self, entry: Entry) -> None:
        if self.host is None or not self.host.can_hold(entry.kv):
            self._entries.remove(entry)
            return
        self.host.to_host(entry.kv)
        entry.on_host = True
        hosted = self._host_entries()
        while sum(kv_bytes(e.kv) for e in hosted) > self.host.capacity_bytes or len(hosted) > MAX_HOST_ENTRIES:
            self._entries.remove(hosted.pop(0))


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
