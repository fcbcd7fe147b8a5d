"""The expert activation matrix collection (EAMC): a fixed-size memory of past requests' rEAMs.

The predictor's guess of a new request's experts (`kernel_decode_probability`) pools every
entry's decode counts, weighted by a sharp kernel of the centred similarity of routing
profiles: nearer kinds of request count more, long requests (less noisy counts) count more,
and no single neighbour's noise decides. It costs one matrix–vector product with the stored
counts per part (prefill, decode) and one for the pooling: about 0.2 ms at 256 entries of
24 × 128 (`bench.eamc_match`). When the collection is full, a new entry replaces the most
similar stored one (cosine), which keeps the collection diverse (one entry per kind of
request) and fresh (the newest of its kind).
"""

from __future__ import annotations

import threading

import numpy as np

from cache.eam import RequestEAM

DEFAULT_CAPACITY = 256  # bench/RESULTS_cache.md: within 0.05 points of unbounded over 1,000 requests
# of the centred cosine (−1..1): an entry 0.1 less similar weighs e⁻¹ as much; 0.05 to 0.2 give
# the same miss rates within 0.1 points (bench/RESULTS.md, issue 12)
MATCH_TEMPERATURE = 0.1
ARRAY_NAMES = ("prefill", "decode", "decode_tokens")


class EAMC:
    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        if capacity < 1:
            raise ValueError("EAMC capacity must be at least 1")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.capacity = capacity
        dim = num_layers * num_experts
        self._prefill = np.zeros((capacity, dim), dtype=np.float32)  # [N, L*E] raw counts
        self._decode = np.zeros((capacity, dim), dtype=np.float32)  # [N, L*E] raw counts
        self._tokens = np.zeros(capacity, dtype=np.float32)  # [N] decode tokens per entry
        self._norms = np.zeros((capacity, 2), dtype=np.float32)  # [N, 2] prefill/decode L2 norms
        self._prob_sum = np.zeros(dim, dtype=np.float64)  # Σ entries' decode probabilities
        self._sums = np.zeros((capacity, 2), dtype=np.float32)  # [N, 2] prefill/decode count totals
        self._profile_sum = np.zeros((2, dim), dtype=np.float64)  # [2, L*E] Σ entries' profiles (counts / total)
        self._centring: tuple[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] | None = None  # (version, parts)
        self._size = 0
        self.version = 0  # bumped by every add (the autosaver saves only when it changed)
        self._lock = threading.Lock()  # add vs arrays() from a saving thread

    def __len__(self) -> int:
        return self._size

    # -- adding --------------------------------------------------------------------
    def add(self, prefill: np.ndarray, decode: np.ndarray, decode_tokens: float) -> int:
        """Store one request's rEAM parts `[L, E]`; returns its slot."""
        p = np.asarray(prefill, dtype=np.float32).ravel()
        d = np.asarray(decode, dtype=np.float32).ravel()
        with self._lock:
            if self._size < self.capacity:
                slot = self._size
                self._size += 1
            else:
                slot = int(np.argmax(self.similarities(p, d, 0.5)))
                self._prob_sum -= self._decode[slot] / max(self._tokens[slot], 1.0)
                self._profile_sum -= np.stack([self._prefill[slot], self._decode[slot]]) / _safe(self._sums[slot])[:, None]
            self._store(slot, p, d, float(decode_tokens))
            self.version += 1
        return slot

    def add_request(self, ream: RequestEAM) -> int:
        return self.add(ream.prefill, ream.decode, ream.decode_tokens)

    def _store(self, slot: int, p: np.ndarray, d: np.ndarray, tokens: float) -> None:
        self._prefill[slot] = p
        self._decode[slot] = d
        self._tokens[slot] = tokens
        self._norms[slot] = (np.linalg.norm(p), np.linalg.norm(d))
        self._sums[slot] = (p.sum(), d.sum())
        self._profile_sum += np.stack([p, d]) / _safe(self._sums[slot])[:, None]
        self._prob_sum += d / max(tokens, 1.0)

    # -- matching ------------------------------------------------------------------
    def similarities(self, prefill: np.ndarray, decode: np.ndarray, decode_weight: float) -> np.ndarray:
        """Cosine similarity of the query to every entry: (1-w)·cos(prefill) + w·cos(decode)."""  # [N]
        p = np.asarray(prefill, dtype=np.float32).ravel()
        d = np.asarray(decode, dtype=np.float32).ravel()
        n = self._size
        sims = np.zeros(n, dtype=np.float32)
        for part, q, w, col in ((self._prefill, p, 1.0 - decode_weight, 0), (self._decode, d, decode_weight, 1)):
            qn = float(np.linalg.norm(q))
            if w > 0 and qn > 0:
                sims += w * (part[:n] @ q) / (np.maximum(self._norms[:n, col], 1e-12) * qn)
        return sims

    def centred_similarities(self, prefill: np.ndarray, decode: np.ndarray, decode_weight: float) -> np.ndarray:
        """(1-w)·cos(prefill) + w·cos(decode) of routing profiles centred on the entries' mean profile.

        A part's profile f is its counts over their total. Every request shares the model's common
        routing, which raw cosines mostly measure; centred ones compare what sets a kind of request
        apart. With g the mean profile, (f - g)·(q - g) = f·q - f·g - g·q + g·g: one product of the
        stored counts with the query per part, the rest kept per version of the collection.
        """  # [N]
        n = self._size
        sims = np.zeros(n, dtype=np.float32)
        parts = zip(self._centring_terms(), (prefill, decode), (1.0 - decode_weight, decode_weight), strict=True)
        for col, ((mean, f_dot_g, f_norm), query, w) in enumerate(parts):
            q = np.asarray(query, dtype=np.float32).ravel()
            if w <= 0 or q.sum() <= 0:
                continue
            q = q / q.sum()
            g_dot_q, g_dot_g = float(mean @ q), float(mean @ mean)
            q_norm = np.sqrt(max(float(q @ q) - 2 * g_dot_q + g_dot_g, 0.0))
            counts = (self._prefill, self._decode)[col]
            f_dot_q = (counts[:n] @ q) / _safe(self._sums[:n, col])
            centred = f_dot_q - f_dot_g - g_dot_q + g_dot_g  # [N]
            sims += w * centred / np.maximum(f_norm * q_norm, 1e-12)
        return sims

    def _centring_terms(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per part: the mean profile g [L*E], each entry's f·g [N] and |f - g| [N] (recomputed after an add)."""
        if self._centring is None or self._centring[0] != self.version:
            n, terms = self._size, []
            for col, counts in enumerate((self._prefill, self._decode)):
                mean = (self._profile_sum[col] / max(n, 1)).astype(np.float32)
                total = _safe(self._sums[:n, col])
                f_dot_g = (counts[:n] @ mean) / total
                f_sq = (self._norms[:n, col] / total) ** 2
                f_norm = np.sqrt(np.maximum(f_sq - 2 * f_dot_g + float(mean @ mean), 0.0))
                terms.append((mean, f_dot_g, f_norm))
            self._centring = (self.version, terms)
        return self._centring[1]

    # -- prediction ----------------------------------------------------------------
    def kernel_decode_probability(
        self, prefill: np.ndarray, decode: np.ndarray, decode_weight: float, temperature: float = MATCH_TEMPERATURE
    ) -> np.ndarray:
        """Every entry's decode counts pooled, each weighted exp(centred similarity / temperature)."""  # [L, E]
        if self._size == 0:
            return self.mean_decode_probability()
        sims = self.centred_similarities(prefill, decode, decode_weight)
        return self.pooled_decode_probability(np.exp((sims - sims.max()) / temperature))

    def pooled_decode_probability(self, weights: np.ndarray) -> np.ndarray:
        """Σ weight × decode counts over Σ weight × decode tokens: a long request weighs more."""  # [L, E]
        w = np.asarray(weights, dtype=np.float32)
        tokens = float(w @ self._tokens[: self._size])
        if tokens <= 0:
            return self.mean_decode_probability()
        pooled = w @ self._decode[: self._size] / tokens
        return pooled.reshape(self.num_layers, self.num_experts).astype(np.float32)

    def mean_decode_probability(self) -> np.ndarray:
        """The average over all entries (what a request of an unknown kind looks like)."""  # [L, E]
        mean = self._prob_sum / max(self._size, 1)
        return mean.reshape(self.num_layers, self.num_experts).astype(np.float32)

    # -- persistence ---------------------------------------------------------------
    def arrays(self) -> dict[str, np.ndarray]:
        """The stored entries as plain float32 arrays (what the EAMC file holds)."""
        with self._lock:
            n, shape = self._size, (self._size, self.num_layers, self.num_experts)
            return {
                "prefill": self._prefill[:n].reshape(shape).copy(),
                "decode": self._decode[:n].reshape(shape).copy(),
                "decode_tokens": self._tokens[:n].copy(),
            }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], capacity: int = DEFAULT_CAPACITY) -> EAMC:
        """Rebuild from `arrays()`; with fewer slots than entries the replacement rule merges the rest."""
        prefill, decode, tokens = (np.asarray(arrays[k], dtype=np.float32) for k in ARRAY_NAMES)
        if prefill.ndim != 3 or decode.shape != prefill.shape or tokens.shape != prefill.shape[:1]:
            raise ValueError("EAMC arrays must be prefill [N, L, E], decode [N, L, E], decode_tokens [N]")
        eamc = cls(prefill.shape[1], prefill.shape[2], capacity)
        for p, d, t in zip(prefill, decode, tokens, strict=True):
            eamc.add(p, d, t)
        return eamc


def _safe(totals: np.ndarray) -> np.ndarray:
    """Count totals to divide by: an empty part (total 0) divides by 1 and keeps its zeros."""
    return np.where(totals > 0, totals, 1.0)
