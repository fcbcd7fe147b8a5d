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


def buckets_of(share: np.ndarray) -> np.ndarray:
    """Prediction bucket of each per-token use share (0: at least one half; log-spaced below)."""
    octaves = -np.log2(np.maximum(share, 1e-9)) * BUCKETS_PER_OCTAVE
    return np.clip(np.floor(octaves), 0, NUM_BUCKETS - 1).astype(np.int64)


class ReuseModel:
    """Expected residual reuse distance (in passes) per (prediction bucket, age bin), learned online.

    Every reuse of an expert is one observation: the bucket its prediction was in when
    it was last used, and the gap in passes. `table[b, a]` is the expected number of
    further passes until the next use of an expert in bucket b that has gone unused
    for `AGE_EDGES[a]` passes, counting reuses beyond `horizon` as `horizon`.
    """

    def __init__(self, prior_weight: float = 4.0) -> None:
        shape = (NUM_BUCKETS, len(AGE_EDGES))
        self.counts = np.zeros(shape)  # [B, A] reuses seen per bucket and gap bin
        self.gap_sums = np.zeros(shape)  # [B, A] Σ gaps of those reuses
        self.prior_weight = prior_weight
        self._share = 2.0 ** -((np.arange(NUM_BUCKETS) + 0.5) / BUCKETS_PER_OCTAVE)  # [B] bucket centres
        self._pending_buckets: list[int] = []
        self._pending_gaps: list[int] = []
        self.table = np.empty(shape)  # [B, A] expected residual passes
        self.hazard = np.empty(shape)  # [B, A] chance of use at the next pass
        self.refresh()

    def record(self, bucket: int, gap: int) -> None:
        self._pending_buckets.append(bucket)
        self._pending_gaps.append(gap)

    def refresh(self, horizon: float = float("inf")) -> None:
        self._flush()
        edges = AGE_EDGES.astype(float)
        n_ge = np.cumsum(self.counts[:, ::-1], axis=1)[:, ::-1]  # [B, A] reuses with gap ≥ edge
        mean_gap = self.gap_sums / np.maximum(self.counts, 1e-12)  # [B, A]
        clipped = np.clip(mean_gap[:, None, :] - edges[None, :, None], 0.0, horizon)  # [B, a, j]
        later = np.triu(np.ones((len(edges), len(edges))))[None]  # [1, a, j]: j ≥ a
        excess = (self.counts[:, None, :] * later * clipped).sum(axis=2)  # [B, A]
        prior = np.minimum((1.0 - self._share) / self._share, horizon)[:, None]  # geometric residual
        w = self.prior_weight
        self.table = (excess + w * prior) / (n_ge + w)
        width = np.diff(np.append(edges, 2 * edges[-1]))  # [A] passes per bin
        self.hazard = (self.counts / width + w * self._share[:, None]) / (n_ge + w)

    def _flush(self) -> None:
        if not self._pending_gaps:
            return
        gaps = np.asarray(self._pending_gaps, dtype=np.int64)
        buckets = np.asarray(self._pending_buckets, dtype=np.int64)
        bins = AGE_BIN[np.minimum(gaps, MAX_AGE)]
        np.add.at(self.counts, (buckets, bins), 1.0)
        np.add.at(self.gap_sums, (buckets, bins), gaps.astype(float))
        self._pending_buckets.clear()
        self._pending_gaps.clear()


class SharePredictor:
    """Request-level prediction: each (layer, expert)'s expected share of the request's tokens.

    share = (decode counts so far + w × prior) / (decode tokens so far + w), where the
    prior comes from the EAMC entries most similar to the request (re-matched every
    `rematch_every` tokens) and w, the weight of the prior in tokens of evidence, is the
    one of `PRIOR_WEIGHTS` that has predicted past tokens best (so a poor EAMC, or
    traffic without request kinds, automatically counts for little).
    """

    PRIOR_WEIGHTS = (1.0, 4.0, 16.0, 64.0, 256.0)

    def __init__(self, eamc: EAMC, match_top: int = 3, rematch_every: int = 16) -> None:
        self.eamc = eamc
        self.match_top = match_top
        self.rematch_every = rematch_every
        shape = (eamc.num_layers, eamc.num_experts)
        self.prior = np.full(shape, 1.0 / eamc.num_experts, dtype=np.float32)  # [L, E]
        self.scores = np.zeros(len(self.PRIOR_WEIGHTS))  # decayed log-likelihood per weight
        self.weight = 16.0
        self._checkpoint: tuple[np.ndarray, int, np.ndarray] | None = None

    def start(self, top_k: int) -> np.ndarray:
        """A new request: the prior is what an average past request looked like."""
        if len(self.eamc):
            self.prior = self.eamc.mean_decode_probability()
        else:
            self.prior = np.full_like(self.prior, top_k / self.eamc.num_experts)
        self._checkpoint = None
        return self.prior

    def update(self, request: RequestEAM) -> np.ndarray:
        """The share at the start of a decode pass (re-matching on schedule)."""  # [L, E]
        t = request.decode_tokens
        if t % self.rematch_every == 0:
            self._score(request)
            self._rematch(request)
            self._checkpoint = (request.decode.copy(), t, self.prior)
        return (request.decode + self.weight * self.prior) / (t + self.weight)

    def end(self, request: RequestEAM) -> None:
        self._score(request)
        if request.decode_tokens > 0:
            self.eamc.add_request(request)

    def _rematch(self, request: RequestEAM) -> None:
        if not len(self.eamc):
            return
        t = request.decode_tokens
        decode_weight = t / (t + self.rematch_every)  # the prompt first, then the request's own tokens
        idx, sims = self.eamc.match(request.prefill, request.decode, decode_weight, top=self.match_top)
        self.prior = 0.8 * self.eamc.decode_probability(idx, sims) + 0.2 * self.eamc.mean_decode_probability()

    def _score(self, request: RequestEAM) -> None:
        """Credit each prior weight with the log-likelihood of the tokens since the last checkpoint."""
        if self._checkpoint is None:
            return
        counts, t, prior = self._checkpoint
        new = request.decode - counts  # [L, E]
        if new.sum() <= 0:
            return
        for i, w in enumerate(self.PRIOR_WEIGHTS):
            share = (counts + w * prior) / (t + w)
            share = share / share.sum(axis=1, keepdims=True)
            self.scores[i] = 0.98 * self.scores[i] + float((new * np.log(np.maximum(share, 1e-9))).sum())
        self.weight = self.PRIOR_WEIGHTS[int(np.argmax(self.scores))]


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
        horizon_factor: float = 1.0,
        first_layer_bonus: float = 0.0,
        prefetch_horizon: int = 1,
        prefetch_min_share: float = 0.3,
        refresh_every: int = 64,
    ) -> None:
        super().__init__(num_layers, num_experts)
        eamc = eamc if eamc is not None else EAMC(num_layers, num_experts, eamc_capacity)
        self.predictor = SharePredictor(eamc, match_top, rematch_every)
        self.request = RequestEAM(num_layers, num_experts)
        self.reuse = ReuseModel()
        self.horizon_factor = horizon_factor
        self.prefetch_horizon = prefetch_horizon
        self.prefetch_min_share = prefetch_min_share
        self.refresh_every = refresh_every
        L, E = num_layers, num_experts
        self._rows = np.arange(L)[:, None]  # [L, 1]
        # the first layers gain least from prefetch: their expected distance is cut by up to `bonus` passes
        self._bonus = (first_layer_bonus * L * (L - 1 - np.arange(L)) / max(L - 1, 1))[:, None]  # [L, 1]
        self._last_use = np.full((L, E), NEVER, dtype=np.int64)  # [L, E] pass of last use
        self._last_bucket = np.full((L, E), NUM_BUCKETS - 1, dtype=np.int64)  # [L, E] bucket then
        self._buckets = np.full((L, E), NUM_BUCKETS - 1, dtype=np.int64)  # [L, E] buckets this pass
        self._resident = np.zeros((L, E), dtype=bool)  # [L, E]
        self._num_resident = 0
        self._evictions = 0
        self._evictions_since = (0, 0)  # (pass, evictions) at the last horizon update
        self._eviction_rate = 0.0  # evictions per pass, smoothed
        self._top_k = 1  # largest decode routing seen
        self._pass = 0
        self._layer = L  # > any layer: the first routing starts a pass
        self._phase = ""
        self._hint: tuple[int, list[int]] | None = None
        # expected distance of each expert's next use, in layer steps, plus the current layer
        self._ahead = np.zeros((L, E))  # [L, E] if its layer is still to run in this pass
        self._behind = np.zeros((L, E))  # [L, E] if its layer has run
        self._current = np.zeros((L, E))  # [L, E] rows ≤ current layer from behind, others ahead
        self._values_pass = -1  # the pass those were computed for
        self._flipped = -1  # rows 0..flipped of _current hold behind values
        self._pending: list[tuple[int, int]] = []  # uses since, whose behind value is stale

    # -- EAMC access (the engine persists it) -------------------------------------------
    @property
    def eamc(self) -> EAMC:
        return self.predictor.eamc

    @eamc.setter
    def eamc(self, eamc: EAMC) -> None:
        if (eamc.num_layers, eamc.num_experts) != (self.num_layers, self.num_experts):
            raise ValueError(f"an EAMC of {eamc.num_layers}×{eamc.num_experts} does not fit this model")
        self.predictor.eamc = eamc

    # -- hooks -------------------------------------------------------------------------
    def on_request_start(self, request_id: str) -> None:
        self.request.reset()
        self._buckets = buckets_of(self.predictor.start(self._top_k))
        self._layer = self.num_layers
        self._hint = None

    def on_request_end(self, request_id: str) -> None:
        self.predictor.end(self.request)
        self.request.reset()

    def on_routing(self, layer: int, expert_ids: Sequence[int], tokens: int, phase: str) -> None:
        if layer <= self._layer or phase != self._phase:
            self._new_pass(phase)
        self._layer = layer
        self._hint = None
        self.request.add(layer, expert_ids, phase, tokens)
        if phase == "decode" and len(expert_ids) > self._top_k:
            self._top_k = len(expert_ids)
        self._note_uses(layer, expert_ids)

    def on_lookahead(self, layer: int, expert_ids: Sequence[int]) -> None:
        """The engine's guess of `layer`'s experts (the next router applied early): prefetch them first."""
        self._hint = (layer, list(expert_ids))

    def on_insert(self, key: ExpertKey) -> None:
        self._resident[key] = True
        self._num_resident += 1

    def on_evict(self, key: ExpertKey) -> None:
        self._resident[key] = False
        self._num_resident -= 1
        self._evictions += 1

    def victim(self, resident: Iterable[ExpertKey], protected: set[ExpertKey]) -> ExpertKey:
        values = np.where(self._resident, self._values(), -np.inf)  # [L, E]
        E = self.num_experts
        if len(protected) > 4:  # a prefill step: mask them all at once
            values.flat[[layer * E + e for layer, e in protected]] = -np.inf
        while True:
            flat = int(np.argmax(values))
            if values.flat[flat] == -np.inf:
                raise LookupError("every resident expert is protected")
            key = (flat // E, flat % E)
            if key not in protected:
                return key
            values.flat[flat] = -np.inf

    def prefetch_candidates(self, layer: int) -> list[ExpertKey]:
        """Non-resident experts of the next layer(s) likely to be used, most wanted first."""
        scored = []
        for target, weight in proximity_weights(layer, self.num_layers, self.prefetch_horizon):
            chance = weight * self.use_chance(target)  # [E]
            for e in np.flatnonzero((chance >= self.prefetch_min_share) & ~self._resident[target]).tolist():
                scored.append((float(chance[e]), (target, e)))
        scored.sort(reverse=True)
        return [key for _, key in scored[: self._top_k * self.prefetch_horizon]]

    def prefetch_priority(self, key: ExpertKey) -> float:
        return -float(self._values()[key])

    # -- prediction --------------------------------------------------------------------
    def use_chance(self, layer: int) -> np.ndarray:
        """Per expert of `layer`: the chance that its next run uses it."""  # [E]
        age = self._pass + (layer <= self._layer) - self._last_use[layer]
        chance = self.reuse.hazard[self._buckets[layer], AGE_BIN[np.minimum(age, MAX_AGE)]]
        if self._hint is not None and self._hint[0] == layer:
            chance[self._hint[1]] = 1.0
        return chance

    def _horizon(self) -> float:
        """Passes an expert can expect to stay: slots over evictions per pass (recent average)."""
        passes = self._pass - self._evictions_since[0]
        if passes > 0:
            rate = (self._evictions - self._evictions_since[1]) / passes
            self._eviction_rate = 0.5 * self._eviction_rate + 0.5 * rate if self._eviction_rate else rate
            self._evictions_since = (self._pass, self._evictions)
        per_pass = max(self._eviction_rate, 1e-3)
        return self.horizon_factor * max(self._num_resident, 1) / per_pass

    # -- bookkeeping -------------------------------------------------------------------
    def _new_pass(self, phase: str) -> None:
        self._pass += 1
        self._phase = phase
        if phase == "decode":
            self._buckets = buckets_of(self.predictor.update(self.request))
        if self._pass % self.refresh_every == 0:
            self.reuse.refresh(self._horizon())

    def _note_uses(self, layer: int, expert_ids: Sequence[int]) -> None:
        last, last_bucket, buckets, now = self._last_use[layer], self._last_bucket[layer], self._buckets[layer], self._pass
        for e in expert_ids:
            previous = int(last[e])
            if previous != NEVER:
                self.reuse.record(int(last_bucket[e]), now - previous)
            last[e] = now
            last_bucket[e] = buckets[e]
        if self._values_pass == now:
            self._pending.extend((layer, e) for e in expert_ids)

    def _values(self) -> np.ndarray:
        """Expected distance of every expert's next use (plus the current layer), up to date."""  # [L, E]
        c = self._layer
        if self._values_pass != self._pass:
            self._compute_values()
        elif c > self._flipped:
            self._current[self._flipped + 1 : c + 1] = self._behind[self._flipped + 1 : c + 1]
            self._flipped = c
        if self._pending:
            self._patch_used()
        return self._current

    def _compute_values(self) -> None:
        L, c, table = self.num_layers, self._layer, self.reuse.table
        for behind, out in ((0, self._ahead), (1, self._behind)):
            age = np.minimum(self._pass + behind - self._last_use, MAX_AGE)  # [L, E] at the next chance
            out[:] = self._rows + L * behind + L * table[self._buckets, AGE_BIN[age]] - self._bonus
        self._current = np.where(self._rows <= c, self._behind, self._ahead)
        self._values_pass, self._flipped = self._pass, c
        self._pending.clear()

    def _patch_used(self) -> None:
        """Experts used in this pass since the values were computed: next chance one pass on."""
        L, table, one = self.num_layers, self.reuse.table, AGE_BIN[1]
        for layer, e in self._pending:
            value = layer + L + L * table[self._last_bucket[layer, e], one] - self._bonus[layer, 0]
            self._behind[layer, e] = self._current[layer, e] = value
        self._pending.clear()


def _factory(num_layers: int, num_experts: int) -> SparsityAwarePolicy:
    return SparsityAwarePolicy(num_layers, num_experts)


register_policy("sparsity-aware", _factory)
