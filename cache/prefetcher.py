"""Loading experts of the next layer ahead of need.

After layer l's router runs, two signals name experts that layer l+1 will probably use:
- look-ahead (decode steps only): layer l+1's router applied to layer l's expert input.
  Consecutive hidden states are close, so this guesses l+1's top-k before l+1 runs;
  only the engine has this signal. Its hit rate is counted (`lookahead_*`).
- the policy's own prediction (`Policy.prefetch_candidates`), e.g. from the EAMC.
Loads go through `ExpertCache.prefetch`, which refuses to displace anything the policy
values more, so a prefetch never evicts an expert needed sooner. On CUDA the copy is
already asynchronous (side stream); on CPU a background thread does the copying. Newer
predictions replace older ones that have not started yet.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from cache.expert_cache import ExpertCache
from cache.policy import ExpertKey

log = logging.getLogger(__name__)

PREFETCH_LIMIT_PER_TOP_K = 2  # most prefetches issued after one layer, in units of top_k
Router = Callable[[torch.Tensor], torch.Tensor]  # hidden [T, H] → top-k expert ids [T, k]


class Prefetcher:
    def __init__(self, cache: ExpertCache, routers: list[Router | None], background: bool, limit: int) -> None:
        self.cache = cache
        self.routers = routers  # routers[l]: MoE layer l's router, for look-ahead from layer l-1
        self.limit = limit  # most prefetches issued after one layer
        self.lookahead_predicted = 0
        self.lookahead_correct = 0
        self.failures = 0  # prefetches that raised (e.g. a failed disk read); the engine carries on
        self._guess: tuple[int, set[int]] | None = None  # (layer, experts) guessed for that layer
        self._pending: list[ExpertKey] = []
        self._wake = threading.Condition()
        self._closed = False
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._work, name="expert-prefetch", daemon=True)
            self._thread.start()

    def after_routing(self, layer: int, hidden: torch.Tensor | None, needed: list[int], phase: str) -> None:
        self._score_guess(layer, needed)
        keys: list[ExpertKey] = []
        if phase == "decode" and layer + 1 < len(self.routers) and self.routers[layer + 1] is not None:
            guess = sorted(set(self.routers[layer + 1](hidden).flatten().tolist()))
            self._guess = (layer + 1, set(guess))
            self.cache.policy.on_lookahead(layer + 1, guess)  # so the cache admits them
            keys += [(layer + 1, e) for e in guess]
        keys += [k for k in self.cache.policy.prefetch_candidates(layer) if k not in keys]
        self._submit(keys[: self.limit])

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def lookahead_accuracy(self) -> float | None:
        return self.lookahead_correct / self.lookahead_predicted if self.lookahead_predicted else None

    def _score_guess(self, layer: int, needed: list[int]) -> None:
        if self._guess is not None and self._guess[0] == layer:
            self.lookahead_predicted += len(self._guess[1])
            self.lookahead_correct += len(self._guess[1].intersection(needed))
            self._guess = None

    def _submit(self, keys: list[ExpertKey]) -> None:
        if self._thread is None:
            for key in keys:
                self._prefetch(key)
            return
        with self._wake:
            self._pending = keys  # supersedes what the last layer asked for
            self._wake.notify()

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                key = self._pending.pop(0)
            self._prefetch(key)

    def _prefetch(self, key: ExpertKey) -> None:
        """One prefetch; a failure is counted and logged, never fatal: a prefetch is only a guess."""
        try:
            self.cache.prefetch(key)
        except Exception as exc:
            self.failures += 1
            if self.failures == 1:
                log.warning("prefetching expert %s failed; counting further failures quietly", key, exc_info=True)
            else:
                log.debug("prefetching expert %s failed: %s", key, exc)
