"""The `sparsity-aware` replacement policy: evict the expert whose next use is expected last.

Belady's optimum evicts the expert whose next use lies farthest ahead; this policy
evicts the one whose next use it *expects* farthest ahead, in layer steps:

    distance(l, e) = layer distance to l's next pass  +  L × expected passes until e is used again

The first term is exact (passes run layers 0..L-1 in turn); it is what stops LRU's
thrashing when a token's experts across all layers do not fit: experts of layers just
run wait a whole pass, so they go first and the rest stay. The second term is a
learned estimate, conditioned on two signals:
- recency: passes since (l, e) was last used (its age);
- request-level prediction: the expected share of this request's tokens that use
  (l, e), from the request's own decode counts so far blended with a prior predicted
  by matching the request's rEAM against the EAMC (past requests of the same kind).
The estimate is a table of mean residual reuse distances per (prediction bucket, age
bin), learned online from every reuse the policy observes (so it calibrates itself to
the model and traffic at hand), smoothed toward a geometric model when data is thin.

Prefetch: after layer l, the experts of the next layer(s) with the highest predicted
use, weighted by layer proximity; a prefetch only displaces an expert expected later.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from cache.eam import RequestEAM
from cache.eamc import DEFAULT_CAPACITY, EAMC
from cache.policy import ExpertKey, Policy, register_policy

NEVER = -(1 << 40)  # last-use pass of an expert never used
AGE_EDGES = np.array(
    [*range(1, 17), 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 256, 320, 384, 512,
     640, 768, 1024, 1280, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384],
    dtype=np.int64,
)  # lower edges of the age bins, in passes
MAX_AGE = int(AGE_EDGES[-1])
AGE_BIN = np.searchsorted(AGE_EDGES, np.arange(MAX_AGE + 1), side="right") - 1  # age → bin
BUCKETS_PER_OCTAVE = 2
NUM_BUCKETS = 12 * BUCKETS_PER_OCTAVE  # prediction buckets: per-token use share, log-spaced


def proximity_weights(current: int, num_layers: int, horizon: int) -> list[tuple[int, float]]:
    """(layer, weight) for the `horizon` layers after `current` (wrapping into the next pass).

    The paper's layer-proximity weighting: layer current+j gets 1 - (j-1)/L, so the next
    layer counts fully and farther ones, which leave more time to fetch, count less.
    """
    return [((current + j) % num_layers, 1.0 - (j - 1) / num_layers) for j in range(1, horizon + 1)]


def bucket_of(share: float) -> int:
    """Prediction bucket of a per-token use share (0: at least one half)."""
    if share <= 0.0:
        return NUM_BUCKETS - 1
    return min(NUM_BUCKETS - 1, max(0, int(-math.log2(share) * BUCKETS_PER_OCTAVE)))


class ReuseModel:
    """Mean residual reuse distance (in passes) per (prediction bucket, age bin), learned online."""

    def __init__(self, prior_weight: float = 4.0) -> None:
        shape = (NUM_BUCKETS, len(AGE_EDGES))
        self.counts = np.zeros(shape)  # reuses observed with that bucket and gap bin
        self.gap_sums = np.zeros(shape)  # Σ gaps of those reuses
        self.prior_weight = prior_weight
        share = 2.0 ** -((np.arange(NUM_BUCKETS) + 0.5) / BUCKETS_PER_OCTAVE)
        self._prior = ((1.0 - share) / share)[:, None]  # [B, 1] geometric residual
        self.table = np.broadcast_to(self._prior, shape).copy()  # [B, A] expected residual passes

    def record(self, bucket: int, gap: int) -> None:
        b = AGE_BIN[min(gap, MAX_AGE)]
        self.counts[bucket, b] += 1.0
        self.gap_sums[bucket, b] += gap

    def refresh(self, horizon: float = float("inf")) -> None:
        """table[b, a] = E[min(gap - edge_a, horizon) | gap ≥ edge_a], smoothed toward the geometric prior.

        Reuses farther than `horizon` passes count as `horizon`: the cache will have
        evicted the expert by then anyway, so how much farther does not matter.
        """
        mean_gap = self.gap_sums / np.maximum(self.counts, 1e-12)  # [B, A]
        excess = mean_gap[:, None, :] - AGE_EDGES[None, :, None]  # [B, a, j] gap j beyond edge a
        clipped = np.clip(excess, 0.0, horizon)
        later = (np.arange(len(AGE_EDGES))[None, :] >= np.arange(len(AGE_EDGES))[:, None])[None]  # j ≥ a
        n = (self.counts[:, None, :] * later).sum(axis=2)
        s = (self.counts[:, None, :] * later * clipped).sum(axis=2)
        prior = np.minimum(self._prior, horizon)
        self.table = (s + self.prior_weight * prior) / (n + self.prior_weight)


class SparsityAwarePolicy(Policy):
    name = "sparsity-aware"

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        eamc: EAMC | None = None,
        *,
        eamc_capacity: int = DEFAULT_CAPACITY,
        match_top: int = 3,
        rematch_every: int = 16,
        prior_tokens: float = 8.0,
        first_layer_bonus: float = 0.0,
        prefetch_horizon: int = 1,
        prefetch_min_share: float = 0.3,
        refresh_every: int = 64,
        horizon_factor: float = 2.0,
    ) -> None:
        super().__init__(num_layers, num_experts)
        self.eamc = eamc if eamc is not None else EAMC(num_layers, num_experts, eamc_capacity)
        self.request = RequestEAM(num_layers, num_experts)
        self.reuse = ReuseModel()
        self.match_top = match_top
        self.rematch_every = rematch_every
        self.prior_tokens = prior_tokens  # weight of the predicted prior, in tokens of evidence
        self.prefetch_horizon = prefetch_horizon
        self.prefetch_min_share = prefetch_min_share
        self.refresh_every = refresh_every
        self.horizon_factor = horizon_factor
        self._num_resident = 0
        L, E = num_layers, num_experts
        self._layer_ids = np.arange(L)[:, None]  # [L, 1]
        # first layers gain least from prefetch: their expected distance is cut by up to `bonus` passes
        self._layer_bonus = first_layer_bonus * L * (L - 1 - np.arange(L)) / max(L - 1, 1)  # [L]
        self._last_use = np.full((L, E), NEVER, dtype=np.int64)  # [L, E] pass of last use
        self._last_bucket = np.full((L, E), NUM_BUCKETS - 1, dtype=np.int64)  # [L, E]
        self._resident = np.zeros((L, E), dtype=bool)  # [L, E]
        self._prior = np.full((L, E), 1.0 / E, dtype=np.float32)  # [L, E] predicted per-token share
        self._share = self._prior.copy()  # [L, E] current blended share
        self._top_k = 1  # largest decode routing seen
        self._pass = 0
        self._layer = num_layers  # forces a new pass on the first routing
        self._phase = ""
        self._values = np.zeros((L, E))  # [L, E] expected distance + current layer
        self._values_pass = -1  # pass the full values were computed in
        self._bucket_rows = np.zeros((L, E), dtype=np.int64)  # [L, E] buckets of that pass
        self._dirty: set[int] = set()  # layers whose rows changed since
        self._hint: tuple[int, set[int]] | None = None

    # -- EAMC access for persistence ---------------------------------------------------
    def get_eamc(self) -> EAMC:
        return self.eamc

    def set_eamc(self, eamc: EAMC) -> None:
        if (eamc.num_layers, eamc.num_experts) != (self.num_layers, self.num_experts):
            raise ValueError("EAMC shape does not match the model")
        self.eamc = eamc

    # -- hooks -------------------------------------------------------------------------
    def on_request_start(self, request_id: str) -> None:
        self.request.reset()
        self._prior = self._base_prior()
        self._share = self._prior.copy()
        self._layer = self.num_layers
        self._hint = None

    def on_request_end(self, request_id: str) -> None:
        if self.request.decode_tokens > 0:
            self.eamc.add_request(self.request)
        self.request.reset()

    def on_routing(self, layer: int, expert_ids: Sequence[int], tokens: int, phase: str) -> None:
        if layer <= self._layer or phase != self._phase:
            self._new_pass(phase)
        self._layer = layer
        self.request.add(layer, expert_ids, phase, tokens)
        if phase == "decode" and len(expert_ids) > self._top_k:
            self._top_k = len(expert_ids)
        self._note_uses(layer, expert_ids)
        self._dirty.add(layer)
        self._hint = None

    def on_lookahead(self, layer: int, expert_ids: Sequence[int]) -> None:
        """The engine's guess of `layer`'s experts (its router applied early); raises their priority."""
        self._hint = (layer, set(expert_ids))

    def on_insert(self, key: ExpertKey) -> None:
        self._resident[key] = True
        self._num_resident += 1

    def on_evict(self, key: ExpertKey) -> None:
        self._resident[key] = False
        self._num_resident -= 1

    def victim(self, resident: Iterable[ExpertKey], protected: set[ExpertKey]) -> ExpertKey:
        values = np.where(self._resident, self._fresh_values(), -np.inf)  # [L, E]
        E = self.num_experts
        while True:
            flat = int(np.argmax(values))
            if values.flat[flat] == -np.inf:
                raise LookupError("every resident expert is protected")
            key = (flat // E, flat % E)
            if key not in protected:
                return key
            values.flat[flat] = -np.inf

    def prefetch_candidates(self, layer: int) -> list[ExpertKey]:
        """Non-resident experts of the next layer(s) likely enough to be used, most wanted first."""
        scored = []
        for target, weight in proximity_weights(layer, self.num_layers, self.prefetch_horizon):
            share = self.predicted_share(target)  # [E]
            for e in np.flatnonzero((share >= self.prefetch_min_share) & ~self._resident[target]).tolist():
                scored.append((weight * float(share[e]), (target, e)))
        scored.sort(reverse=True)
        return [key for _, key in scored[: self._top_k * self.prefetch_horizon]]

    def prefetch_priority(self, key: ExpertKey) -> float:
        return -float(self._fresh_values()[key])

    # -- prediction --------------------------------------------------------------------
    def predicted_share(self, layer: int) -> np.ndarray:
        """Per expert of `layer`: expected chance the next token uses it (recency-aware)."""  # [E]
        c, p = self._layer, self._pass
        age = p + (layer <= c) - self._last_use[layer]
        bins = AGE_BIN[np.minimum(age, MAX_AGE)]
        buckets = self._buckets(layer)
        residual = self.reuse.table[buckets, bins]
        share = 1.0 / (1.0 + residual)
        if self._hint is not None and self._hint[0] == layer:
            share[list(self._hint[1])] = 1.0
        return share

    def _base_prior(self) -> np.ndarray:
        if len(self.eamc):
            return self.eamc.mean_decode_probability()
        return np.full((self.num_layers, self.num_experts), self._top_k / self.num_experts, dtype=np.float32)

    def _rematch(self) -> None:
        """Predict this request's per-token shares from the EAMC entries most like it."""
        if not len(self.eamc):
            return
        t = self.request.decode_tokens  # tokens before this pass
        weight = t / (t + self.rematch_every)
        idx, sims = self.eamc.match(self.request.prefill, self.request.decode, weight, top=self.match_top)
        matched = self.eamc.decode_probability(idx, sims)
        self._prior = 0.8 * matched + 0.2 * self.eamc.mean_decode_probability()

    def _new_pass(self, phase: str) -> None:
        self._pass += 1
        self._phase = phase
        if phase == "decode":
            t = self.request.decode_tokens  # tokens before this pass
            if t % self.rematch_every == 0:
                self._rematch()
            k = self.prior_tokens
            self._share = (self.request.decode + k * self._prior) / (t + k)
        if self._pass % self.refresh_every == 0:
            self.reuse.refresh(self._horizon())

    def _horizon(self) -> float:
        """Passes an expert can expect to stay: the cache holds that many passes' worth of experts."""
        per_pass = self.num_layers * self._top_k
        return self.horizon_factor * max(self._num_resident, per_pass) / per_pass

    def _buckets(self, layer: int | None = None) -> np.ndarray:
        share = self._share if layer is None else self._share[layer]
        octaves = -np.log2(np.maximum(share, 1e-9)) * BUCKETS_PER_OCTAVE
        return np.minimum(NUM_BUCKETS - 1, np.floor(octaves)).astype(np.int64).clip(0)

    # -- bookkeeping -------------------------------------------------------------------
    def _note_uses(self, layer: int, expert_ids: Sequence[int]) -> None:
        last, last_bucket, share, now = self._last_use[layer], self._last_bucket[layer], self._share[layer], self._pass
        for e in expert_ids:
            previous = int(last[e])
            if previous != NEVER:
                self.reuse.record(int(last_bucket[e]), now - previous)
            last[e] = now
            last_bucket[e] = bucket_of(float(share[e]))

    def _fresh_values(self) -> np.ndarray:
        """Expected distance (in layer steps, plus the current layer) of every expert's next use."""
        if self._values_pass != self._pass:
            self._bucket_rows = self._buckets()
            self._values = self._compute_values(np.arange(self.num_layers))
            self._values_pass = self._pass
        elif self._dirty:
            rows = np.fromiter(self._dirty, dtype=np.int64)
            self._values[rows] = self._compute_values(rows)
        self._dirty.clear()
        return self._values

    def _compute_values(self, layers: np.ndarray) -> np.ndarray:
        L, c = self.num_layers, self._layer
        behind = (layers <= c)[:, None]  # [n, 1] already run in this pass
        age = self._pass + behind - self._last_use[layers]  # [n, E] passes at its next chance
        residual = self.reuse.table[self._bucket_rows[layers], AGE_BIN[np.minimum(age, MAX_AGE)]]
        distance = layers[:, None] + L * behind + L * residual  # minus c: constant within a pass
        return distance - self._layer_bonus[layers][:, None]


def _factory(num_layers: int, num_experts: int) -> SparsityAwarePolicy:
    return SparsityAwarePolicy(num_layers, num_experts)


register_policy("sparsity-aware", _factory)
