"""The `sparsity-aware` replacement policy: evict the expert whose next use is expected last.

Belady's optimum evicts the expert whose next use lies farthest ahead; this policy
evicts the one whose next use it *expects* farthest ahead, in layer steps:

    distance(l, e) = layer distance to l's next pass  +  L × expected passes until e is used again

The first term is exact (a pass runs layers 0..L-1 in turn); it is what stops LRU's
thrashing when a token's experts across all layers do not fit: experts of layers just
run wait a whole pass, so they go first and the rest stay. The second term is a
learned estimate, conditioned on two signals:
- recency: passes since (l, e) was last used (its age);
- request-level prediction: the expected share of this request's tokens that use
  (l, e), from the request's own decode counts so far blended with a prior that mixes
  the EAMC's entries pooled by their similarity to the request's rEAM (past requests of
  the same kind count most), the traffic's global popularity and the request's own
  prompt routing (`SharePredictor`).
It comes from a hazard table per (prediction bucket, age bin) — the chance of use per
pass — learned online from every use and every pass an expert waits (so it calibrates
itself to the model and traffic at hand), and counts only reuses within a horizon of
about one turnover of the cache (a later reuse is no better than none).

Prefetch: after layer l, the experts of the next layer(s) with the highest predicted
use, weighted by layer proximity; a prefetch only displaces an expert expected later.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import numpy as np

from cache.eam import RequestEAM
from cache.eamc import DEFAULT_CAPACITY, EAMC
from cache.policy import NO_LOOKAHEAD, ExpertKey, Policy, register_policy

NEVER = -(1 << 40)  # last-use pass of an expert never used
AGE_EDGES = np.array(
    [*range(1, 17), 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 256, 320, 384, 512,
     640, 768, 1024, 1280, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384],
    dtype=np.int64,
)  # lower edges of the age bins, in passes
MAX_AGE = int(AGE_EDGES[-1])
AGE_BIN = np.searchsorted(AGE_EDGES, np.arange(MAX_AGE + 1), side="right") - 1  # age → bin
_AGE_BIN_LIST = AGE_BIN.tolist()  # the same, for fast scalar lookups
AGE_TIEBREAK = 1e-3  # layer steps per pass of age: orders experts whose estimates tie
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
    """Reuse statistics per (prediction bucket, age bin), learned online as a discrete-time hazard.

    An expert's bucket is the one its prediction was in when it was last used; its age
    is the number of passes since. Every pass, each expert at risk adds one exposure to
    its (bucket, age bin); every reuse adds one event. The hazard events / exposures is
    the chance of use per pass; counting exposures (not only reuses) keeps experts that
    are never used again in the statistics, which a mean of observed gaps would miss.
    `table[b, a]`: expected passes after the next chance until the next use of an expert
    of bucket b that has been unused for `AGE_EDGES[a]` passes, truncated at `horizon`
    (reuses later than that are as good as none: the cache will have evicted it anyway).
    The policy looks it up with each expert's current bucket, which carries the newest
    prediction (measured: better than the bucket at last use).
    """

    def __init__(self, prior_weight: float = 4.0) -> None:
        shape = (NUM_BUCKETS, len(AGE_EDGES))
        self.events = np.zeros(shape)  # [B, A] reuses
        self.exposure = np.zeros(shape)  # [B, A] passes spent at risk
        self.prior_weight = prior_weight  # in passes of exposure
        share = 2.0 ** -((np.arange(NUM_BUCKETS) + 0.5) / BUCKETS_PER_OCTAVE)  # [B] bucket centres
        # before data: the bucket's share, raised for the recently used (bursty, as LRU assumes)
        self._prior = np.minimum(share[:, None] + 1.0 / (AGE_EDGES[None, :] + 1.0), 0.9)  # [B, A]
        self._width = np.diff(np.append(AGE_EDGES, 1 << 30)).astype(float)  # [A] passes per bin
        self._pending: list[int] = []  # flat (bucket, gap bin) of reuses since the last refresh
        self._pending_arrays: list[np.ndarray] = []  # the same, recorded in bulk
        self.hazard = self._prior.copy()  # [B, A] chance of use per pass
        self.table = np.empty(shape)  # [B, A] expected residual passes
        self.refresh()

    def record(self, bucket: int, gap: int) -> None:
        self._pending.append(bucket * len(AGE_EDGES) + _AGE_BIN_LIST[min(gap, MAX_AGE)])

    def record_many(self, buckets: np.ndarray, gaps: np.ndarray) -> None:
        self._pending_arrays.append(buckets * len(AGE_EDGES) + AGE_BIN[np.minimum(gaps, MAX_AGE)])

    def expose(self, buckets: np.ndarray, ages: np.ndarray) -> None:
        """Experts at risk this pass: their buckets at last use and their ages (flat arrays)."""
        idx = buckets * len(AGE_EDGES) + AGE_BIN[np.minimum(ages, MAX_AGE)]
        self.exposure += np.bincount(idx, minlength=self.exposure.size).reshape(self.exposure.shape)

    def refresh(self, horizon: float = float("inf")) -> None:
        if self._pending or self._pending_arrays:
            flat = np.concatenate([np.asarray(self._pending, dtype=np.int64), *self._pending_arrays])
            self.events += np.bincount(flat, minlength=self.events.size).reshape(self.events.shape)
            self._pending.clear()
            self._pending_arrays.clear()
        w = self.prior_weight
        seen = self.exposure + w
        hazard = np.where(seen > 0, (self.events + w * self._prior) / np.maximum(seen, 1e-12), self._prior)
        self.hazard = np.clip(hazard, 1e-9, 1.0 - 1e-9)
        self.table = self._residual(horizon)

    def _residual(self, horizon: float) -> np.ndarray:
        """Σ over passes k = 1..horizon after the next chance of P(still unused after k chances)."""
        h, width, edges = self.hazard, self._width, AGE_EDGES.astype(float)
        log_stay = np.log1p(-h)  # [B, A] per pass
        start = np.concatenate([np.zeros((h.shape[0], 1)), np.cumsum(log_stay * width, axis=1)], axis=1)  # [B, A+1]
        # from the lower edge of bin a to the start of bin j ≥ a
        rel = start[:, None, :-1] - start[:, :-1, None]  # [B, a, j]
        offset = edges[None, :] - edges[:, None]  # [a, j] passes from edge a to edge j
        n = np.clip(np.minimum(width[None, :], horizon - offset), 0.0, None)  # passes of bin j within reach
        # Σ_{m=1..n} (1-h)^m = (1-h) (1 - (1-h)^n) / h
        within = (1.0 - h)[:, None, :] * -np.expm1(n[None] * log_stay[:, None, :]) / h[:, None, :]
        later = np.triu(np.ones_like(offset))[None]  # j ≥ a
        return (later * np.exp(np.minimum(rel, 0.0)) * within).sum(axis=2)  # [B, A]


def simplex_grid(parts: int, steps: int) -> np.ndarray:
    """Every mix of `parts` weights in multiples of 1/steps that sum to 1."""  # [M, parts]
    grid = np.stack(np.meshgrid(*[np.arange(steps + 1)] * parts, indexing="ij"), axis=-1).reshape(-1, parts)
    return grid[grid.sum(axis=1) == steps] / steps


class SharePredictor:
    """Request-level prediction: each (layer, expert)'s expected share of the request's tokens.

    share = (decode counts so far + w × prior) / (decode tokens so far + w). The prior mixes
    three guesses of the request's routing, each normalised to top_k per layer:
    - the EAMC's entries pooled by their similarity to the request (re-matched every
      `rematch_every` tokens);
    - global popularity: all past requests' decode uses, decayed per request (the EAMC keeps
      one entry per kind of request, so its mean is not the traffic's popularity);
    - the request's own prompt: the share of its prompt tokens routed to each expert.
    The weight w (in tokens of evidence) and the mix are the pair of `PRIOR_WEIGHTS` ×
    `MIXES` that has predicted past tokens best (decayed log-likelihood), so whichever
    guess the model and traffic at hand reward counts most, and a poor one counts little.
    """

    PRIOR_WEIGHTS = (1.0, 4.0, 16.0, 64.0, 256.0)
    MIXES = simplex_grid(3, 4)  # [M, 3] weights of (EAMC match, popularity, prompt)
    POPULARITY_DECAY = 0.98  # per request

    def __init__(self, eamc: EAMC, rematch_every: int = 16) -> None:
        self.eamc = eamc
        self.rematch_every = rematch_every
        shape = (eamc.num_layers, eamc.num_experts)
        self.prior = np.full(shape, 1.0 / eamc.num_experts, dtype=np.float32)  # [L, E]
        self.scores = np.zeros((len(self.PRIOR_WEIGHTS), len(self.MIXES)))  # decayed log-likelihood
        # (prior weight, mix) indices; before any evidence: weight 16, mix (0.75, 0.25, 0)
        self._choice = (self.PRIOR_WEIGHTS.index(16.0), int(np.flatnonzero((self.MIXES == [0.75, 0.25, 0.0]).all(axis=1))[0]))
        self._popularity = np.zeros(shape)  # [L, E] decayed decode uses
        self._top_k = 1
        self._components = np.zeros((3, *shape))  # [3, L, E] the guesses the prior mixes
        self._checkpoint: tuple[np.ndarray, int, np.ndarray] | None = None

    @property
    def weight(self) -> float:
        """The prior's weight, in tokens of evidence."""
        return self.PRIOR_WEIGHTS[self._choice[0]]

    @property
    def mix(self) -> np.ndarray:
        """The prior's weights of (EAMC match, popularity, prompt)."""  # [3]
        return self.MIXES[self._choice[1]]

    def start(self, top_k: int) -> np.ndarray:
        """A new request: the prior is the traffic's popularity."""
        self._top_k = top_k
        self.prior = self._normalised(self._popularity)
        self._checkpoint = None
        return self.prior

    def _normalised(self, counts: np.ndarray) -> np.ndarray:
        """Rows scaled to sum to top_k (uniform where a row is empty)."""  # [L, E]
        sums = counts.sum(axis=-1, keepdims=True)
        uniform = self._top_k / counts.shape[-1]
        return np.where(sums > 0, counts * (self._top_k / np.maximum(sums, 1e-12)), uniform)

    def update(self, request: RequestEAM) -> np.ndarray:
        """The share at the start of a decode pass (re-matching on schedule)."""  # [L, E]
        t = request.decode_tokens
        if t % self.rematch_every == 0:
            self._score(request)
            self._rematch(request)
            self._checkpoint = (request.decode.copy(), t, self._components.copy())
        return (request.decode + self.weight * self.prior) / (t + self.weight)

    def end(self, request: RequestEAM) -> None:
        self._score(request)
        if request.decode_tokens > 0:
            self.eamc.add_request(request)
            self._popularity = self.POPULARITY_DECAY * self._popularity + request.decode

    def _rematch(self, request: RequestEAM) -> None:
        popularity = self._normalised(self._popularity)
        matched = popularity
        if len(self.eamc):
            t = request.decode_tokens
            decode_weight = t / (t + self.rematch_every)  # the prompt first, then the request's own tokens
            matched = self._normalised(self.eamc.kernel_decode_probability(request.prefill, request.decode, decode_weight))
        prompt = self._normalised(request.prefill) if request.prefill_tokens else popularity
        self._components = np.stack([matched, popularity, prompt])  # [3, L, E]
        self.prior = np.tensordot(self.mix, self._components, axes=1)

    def _score(self, request: RequestEAM) -> None:
        """Credit each (prior weight, mix) with the log-likelihood of the tokens since the last checkpoint."""
        if self._checkpoint is None:
            return
        counts, t, components = self._checkpoint
        new = request.decode - counts  # [L, E]
        used = np.flatnonzero(new > 0)
        if used.size == 0:
            return
        priors = self.MIXES @ components.reshape(3, -1)[:, used]  # [M, U]
        weights = np.asarray(self.PRIOR_WEIGHTS)[:, None, None]  # [W, 1, 1]
        share = (counts.ravel()[used] + weights * priors) / (t + weights)  # [W, M, U], rows sum to top_k
        self.scores = 0.98 * self.scores + (np.log(np.maximum(share, 1e-9)) * new.ravel()[used]).sum(axis=2)
        w, m = np.unravel_index(int(np.argmax(self.scores)), self.scores.shape)
        # ties keep the weight: a checkpoint with no counts yet scores every weight alike (up to rounding)
        if self.scores[self._choice[0], m] >= self.scores[w, m] - 1e-6 * (1.0 + abs(self.scores[w, m])):
            w = self._choice[0]
        self._choice = (int(w), int(m))


class SparsityAwarePolicy(Policy):
    name = "sparsity-aware"

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        eamc: EAMC | None = None,
        *,
        eamc_capacity: int = DEFAULT_CAPACITY,
        rematch_every: int = 16,
        horizon_factor: float = 1.0,
        first_layer_bonus: float = 0.0,
        prefetch_horizon: int = 1,
        prefetch_min_share: float = 0.5,
        refresh_every: int = 64,
    ) -> None:
        super().__init__(num_layers, num_experts)
        eamc = eamc if eamc is not None else EAMC(num_layers, num_experts, eamc_capacity)
        self.predictor = SharePredictor(eamc, rematch_every)
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
        # expected distance of each expert's next use, in layer steps, plus the current layer
        self._ahead = np.zeros((L, E))  # [L, E] if its layer is still to run in this pass
        self._behind = np.zeros((L, E))  # [L, E] if its layer has run
        self._current = np.zeros((L, E))  # [L, E] rows ≤ current layer from behind, others ahead
        self._masked = np.full((L, E), -np.inf)  # [L, E] _current where resident, else -inf
        self._values_pass = -1  # the pass those were computed for
        self._flipped = -1  # rows 0..flipped of _current hold behind values
        # the running step's experts: protected while it runs, so hidden (-inf) in _masked, and
        # their values (now one pass to wait) are brought up to date when the next step starts
        self._step_keys: set[ExpertKey] = set()
        self._step_ids: Sequence[int] = []
        self._step_layer = 0
        self._age1: list[float] = []  # per bucket: L × residual at age 1 (kept as floats for scalar use)
        self._refresh_reuse()
        self._step_hidden = False
        self._lock = threading.RLock()  # the engine's prefetch thread calls victim/priority concurrently

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
        with self._lock:
            self.request.reset()
            self._buckets = buckets_of(self.predictor.start(self._top_k))
            self._layer = self.num_layers
            self._lookahead = NO_LOOKAHEAD

    def on_request_end(self, request_id: str) -> None:
        with self._lock:
            self.predictor.end(self.request)
            self.request.reset()

    def on_routing(
        self, layer: int, expert_ids: Sequence[int], tokens: int, phase: str, counts: Sequence[int] | None = None
    ) -> None:
        with self._lock:
            if layer <= self._layer or phase != self._phase:
                self._new_pass(phase)
            self._layer = layer
            self._lookahead = NO_LOOKAHEAD  # a guess is for the layer after the one that made it
            self.request.add(layer, expert_ids, phase, tokens, counts)
            if phase == "decode" and len(expert_ids) > self._top_k:
                self._top_k = len(expert_ids)
            self._end_step()
            self._note_uses(layer, expert_ids)
            self._step_keys = {(layer, e) for e in expert_ids}
            self._step_ids = expert_ids
            self._step_layer = layer

    def on_lookahead(self, layer: int, expert_ids: Sequence[int]) -> None:
        """The engine's guess of `layer`'s experts (the next router applied early): prefetch them first."""
        with self._lock:
            super().on_lookahead(layer, expert_ids)

    def on_insert(self, key: ExpertKey) -> None:
        with self._lock:
            self._resident[key] = True
            if self._step_hidden and key in self._step_keys:
                self._masked[key] = -np.inf
            else:
                self._masked[key] = self._current[key] if not self._guessed(key) else self._next_chance(key[0])
            self._num_resident += 1

    def on_evict(self, key: ExpertKey) -> None:
        with self._lock:
            self._resident[key] = False
            self._masked[key] = -np.inf
            self._num_resident -= 1
            self._evictions += 1

    def victim(self, resident: Iterable[ExpertKey], protected: set[ExpertKey]) -> ExpertKey:
        with self._lock:
            values = self._values()  # [L, E], -inf where not resident or in the running step
            if protected != self._step_keys:  # not the step's own acquire (a prefetch, a prefill turn)
                self._end_step()
                return self._victim_hiding(values, protected)
            flat = int(values.argmax())
            if values.flat[flat] == -np.inf:
                raise LookupError("every resident expert is protected")
            return divmod(flat, self.num_experts)

    def _victim_hiding(self, values: np.ndarray, protected: set[ExpertKey]) -> ExpertKey:
        hidden = [layer * self.num_experts + e for layer, e in protected]
        saved = values.flat[hidden]
        values.flat[hidden] = -np.inf
        try:
            flat = int(values.argmax())
            if values.flat[flat] == -np.inf:
                raise LookupError("every resident expert is protected")
            return divmod(flat, self.num_experts)
        finally:
            values.flat[hidden] = saved

    def prefetch_candidates(self, layer: int) -> list[ExpertKey]:
        """Non-resident experts of the next layer(s) likely to be used, most wanted first."""
        with self._lock:
            scored = []
            for target, weight in proximity_weights(layer, self.num_layers, self.prefetch_horizon):
                chance = weight * self.use_chance(target)  # [E]
                for e in np.flatnonzero((chance >= self.prefetch_min_share) & ~self._resident[target]).tolist():
                    scored.append((float(chance[e]), (target, e)))
            scored.sort(reverse=True)
            return [key for _, key in scored[: self._top_k * self.prefetch_horizon]]

    def prefetch_priority(self, key: ExpertKey) -> float:
        with self._lock:
            self._values()
            if self._guessed(key):
                return -self._next_chance(key[0])  # as if its use were certain
            return -float(self._current[key])

    def next_use_chance(self, key: ExpertKey) -> float | None:
        with self._lock:
            return float(self.use_chance(key[0])[key[1]])

    def _next_chance(self, layer: int) -> float:
        """Layer steps (plus the current layer) until `layer` runs next."""
        return float(layer + self.num_layers * (layer <= self._layer) - self._bonus[layer, 0])

    # -- prediction --------------------------------------------------------------------
    def use_chance(self, layer: int) -> np.ndarray:
        """Per expert of `layer`: the chance that its next run uses it."""  # [E]
        age = self._pass + (layer <= self._layer) - self._last_use[layer]
        chance = self.reuse.hazard[self._buckets[layer], AGE_BIN[np.minimum(age, MAX_AGE)]]
        guess_layer, guess = self._lookahead
        if guess_layer == layer:
            chance[list(guess)] = 1.0
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
        self._expose()
        if self._pass % self.refresh_every == 0:
            self._refresh_reuse()

    def _expose(self) -> None:
        """Count this pass's exposure of every expert used before (the reuse model's denominator)."""
        seen = self._last_use != NEVER
        self.reuse.expose(self._last_bucket[seen], self._pass - self._last_use[seen])

    def _note_uses(self, layer: int, expert_ids: Sequence[int]) -> None:
        last, last_bucket, buckets, now = self._last_use[layer], self._last_bucket[layer], self._buckets[layer], self._pass
        if len(expert_ids) > 2:  # top-k models and prefill: in bulk
            ids = np.asarray(expert_ids, dtype=np.int64)
            previous = last.take(ids)
            seen = previous != NEVER
            self.reuse.record_many(last_bucket.take(ids[seen]), now - previous[seen])
            last.put(ids, now)
            last_bucket.put(ids, buckets.take(ids))
            return
        record = self.reuse.record
        for e in expert_ids:
            previous = int(last[e])
            if previous != NEVER:
                record(int(last_bucket[e]), now - previous)
            last[e] = now
            last_bucket[e] = buckets[e]

    def _values(self) -> np.ndarray:
        """Expected distance of each resident expert's next use (plus the current layer), up to date."""  # [L, E]
        c = self._layer
        if self._values_pass == self._pass and c <= self._flipped and self._step_hidden:
            return self._masked  # the common case: nothing changed
        if self._values_pass != self._pass:
            self._compute_values()
        elif c > self._flipped:
            rows = slice(self._flipped + 1, c + 1)
            self._current[rows] = self._behind[rows]
            self._masked[rows] = np.where(self._resident[rows], self._behind[rows], -np.inf)
            self._flipped = c
        self._masked[self._step_layer, self._step_ids] = -np.inf
        self._step_hidden = True
        return self._masked

    def _end_step(self) -> None:
        """The last step's experts were used: their next chance is one pass on; show them again."""
        self._step_hidden = False
        if self._values_pass != self._pass:
            return  # the next full computation sees their new last use
        layer, ids = self._step_layer, self._step_ids
        base = layer + self.num_layers - self._bonus[layer, 0] + AGE_TIEBREAK
        if len(ids) > 8:  # a prefill step: in bulk
            value = base + np.take(self._age1, self._buckets[layer, ids])
            self._behind[layer, ids] = self._current[layer, ids] = value
            self._masked[layer, ids] = np.where(self._resident[layer, ids], value, -np.inf)
            return
        buckets, resident, age1 = self._buckets[layer], self._resident[layer], self._age1
        behind, current, masked = self._behind[layer], self._current[layer], self._masked[layer]
        for e in ids:
            value = base + age1[buckets[e]]
            behind[e] = current[e] = value
            masked[e] = value if resident[e] else -np.inf

    def _compute_values(self) -> None:
        L, c, table = self.num_layers, self._layer, self.reuse.table
        for behind, out in ((0, self._ahead), (1, self._behind)):
            age = np.minimum(self._pass + behind - self._last_use, MAX_AGE)  # [L, E] at the next chance
            out[:] = self._rows + L * behind + L * table[self._buckets, AGE_BIN[age]] - self._bonus
            out += AGE_TIEBREAK * age  # within an age bin, the longer unused goes first (as in LRU)
        self._current = np.where(self._rows <= c, self._behind, self._ahead)
        self._masked = np.where(self._resident, self._current, -np.inf)
        self._values_pass, self._flipped = self._pass, c

    def _refresh_reuse(self) -> None:
        self.reuse.refresh(self._horizon())
        self._age1 = (self.num_layers * self.reuse.table[:, 0]).tolist()


def _factory(num_layers: int, num_experts: int) -> SparsityAwarePolicy:
    return SparsityAwarePolicy(num_layers, num_experts)


register_policy("sparsity-aware", _factory)
