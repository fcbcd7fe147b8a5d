"""Seeded synthetic `moe-trace/1` traces whose decode behaves like real routing traffic.

`python -m cache.tracegen --shape many-small --requests 300 --seed 0 --out trace.jsonl`

The model of a request: it belongs to one of a few activation groups (request kinds,
Zipf-popular); each group has, per layer, a distribution over experts drawn around a
global popularity; the request's own distribution is drawn around its group's. A
decoded token, at each layer, either repeats an expert of the previous token, reuses
one of the last 8 tokens' experts, or draws a fresh one from the request's distribution;
these choices are correlated across the layers of a token (repetitive stretches of text
repeat at every layer). Prompt tokens draw from a mix of the request's and the global
distribution. The parameters of each shape are calibrated with `trace_stats` to the
statistics of real decode traces (DESIGN.md; see `REAL_DECODE_STATS`); the presets
`llama4-like`, `deepseek-v2-lite-like` and `mixtral-like` are fitted with
`cache.trace_stats` to issue 12's three real traces (`REAL_TRACE_STATS`). Generated tokens
per request are fixed, or log-normal around a median (`decode_sigma`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from cache.trace import TraceHeader, TraceRequest, load_trace, write_trace

# Real decode traces of a 128-expert, 24-layer, top-1 model, 128 tokens per request.
REAL_DECODE_STATS = {
    "distinct_median": 27.0,
    "distinct_p90": 40.0,
    "top_share_median": 0.27,
    "same_as_previous": 0.33,
    "in_last_8": 0.59,
    "entropy": 0.79,
}


@dataclass(frozen=True)
class ShapeParams:
    num_layers: int
    num_experts: int
    top_k: int
    base_zipf: float  # Zipf exponent of the global popularity of a layer's experts (higher: more skewed)
    group_sigma: float  # spread of a group's log-popularity around the global one
    request_sigma: float  # spread of a request's log-popularity around its group's
    sharpness: float  # exponent applied to a request's popularity (higher: fewer distinct experts)
    sharpness_sigma: float  # log-normal spread of the sharpness across requests
    p_same: float  # a slot repeats an expert of the previous token
    p_recent: float  # a slot reuses an expert of tokens t-2..t-8
    layer_corr: float  # correlation of those choices across the layers of one token
    groups: int = 20
    group_zipf: float = 1.0
    decode_tokens: int = 128  # generated tokens per request (the median when decode_sigma > 0)
    decode_sigma: float = 0.0  # log-normal spread of the generated tokens per request (0: all alike)
    decode_max: int = 512
    prompt_median: float = 48.0
    prompt_sigma: float = 0.8
    prompt_max: int = 512
    prompt_request_weight: float = 0.6  # prompt tokens: share drawn from the request's distribution


SHAPES: dict[str, ShapeParams] = {
    # 128 experts, top-1, 24 layers (the shape of the real traces the statistics come from)
    "many-small": ShapeParams(
        24, 128, 1, base_zipf=0.70, group_sigma=1.10, request_sigma=0.37, sharpness=1.49,
        sharpness_sigma=0.2, p_same=0.196, p_recent=0.075, layer_corr=0.5,
    ),
    # 64 experts, top-6, 26 layers (DeepSeek-V2-Lite-like)
    "many-small-64": ShapeParams(
        26, 64, 6, base_zipf=0.70, group_sigma=1.10, request_sigma=0.37, sharpness=1.0,
        sharpness_sigma=0.2, p_same=0.196, p_recent=0.075, layer_corr=0.5,
    ),
    # 8 experts, top-2, 32 layers (Mixtral-like)
    "few-large": ShapeParams(
        32, 8, 2, base_zipf=0.5, group_sigma=0.33, request_sigma=0.15, sharpness=0.69,
        sharpness_sigma=0.17, p_same=0.12, p_recent=0.15, layer_corr=0.5,
    ),
    # Presets fitted with `cache.trace_stats` to issue 12's statistics of three real decode
    # traces (bench/RESULTS.md has the two tables side by side).
    "llama4-like": ShapeParams(  # Llama-4-Maverick: 24 L × 128 E, top-1, 128 tokens (MMLU)
        24, 128, 1, base_zipf=0.62, group_sigma=1.10, request_sigma=0.30, sharpness=1.62,
        sharpness_sigma=0.2, p_same=0.20, p_recent=0.075, layer_corr=0.5,
    ),
    "deepseek-v2-lite-like": ShapeParams(  # 26 L × 64 E, top-6; short requests with a long tail
        26, 64, 6, base_zipf=0.15, group_sigma=1.10, request_sigma=0.37, sharpness=0.8,
        sharpness_sigma=0.2, p_same=0.11, p_recent=0.05, layer_corr=0.5,
        decode_tokens=27, decode_sigma=1.6,
    ),
    "mixtral-like": ShapeParams(  # Mixtral-8x7B: 32 L × 8 E, top-2, ~123 tokens per request
        32, 8, 2, base_zipf=0.7, group_sigma=0.33, request_sigma=0.25, sharpness=0.69,
        sharpness_sigma=0.17, p_same=0.14, p_recent=0.15, layer_corr=0.5, decode_tokens=123,
    ),
}

# Issue 12's statistics of the real decode traces the presets stand in for (`cache.trace_stats`).
REAL_TRACE_STATS = {
    "llama4-like": {"tokens_median": 128, "first_use_share": 0.21, "reuse_p50": 2, "reuse_p90": 26,
                    "same_as_previous": 0.33, "distinct_median": 27, "top10_share": 0.54, "nearest_cosine": 0.83},
    "deepseek-v2-lite-like": {"tokens_median": 27, "first_use_share": 0.09, "reuse_p50": 4, "reuse_p90": 21,
                              "same_as_previous": 0.26, "distinct_median": 47, "top10_share": 0.15,
                              "nearest_cosine": 0.84},
    "mixtral-like": {"tokens_median": 123, "first_use_share": 0.03, "reuse_p50": 2, "reuse_p90": 9,
                     "same_as_previous": 0.37, "distinct_median": 8, "top10_share": 0.17, "nearest_cosine": 0.94},
}


# -- generation ------------------------------------------------------------------------


def generate(params: ShapeParams, num_requests: int, seed: int, model: str = "") -> tuple[TraceHeader, list]:
    """A reproducible synthetic trace: its header and requests."""
    header, requests, _ = generate_with_truth(params, num_requests, seed, model)
    return header, requests


def generate_with_truth(params: ShapeParams, num_requests: int, seed: int, model: str = ""):
    """`generate`, plus each request's true per-layer expert distribution `[R, L, E]` (for oracles)."""
    rng = np.random.default_rng(seed)
    L, E = params.num_layers, params.num_experts
    base = _zipf_layers(rng, L, E, params.base_zipf)  # [L, E]
    group_logits = np.log(base)[None] + params.group_sigma * rng.standard_normal((params.groups, L, E))
    group_of = rng.choice(params.groups, size=num_requests, p=_zipf(params.groups, params.group_zipf))
    logits = group_logits[group_of] + params.request_sigma * rng.standard_normal((num_requests, L, E))
    sharp = params.sharpness * np.exp(params.sharpness_sigma * rng.standard_normal((num_requests, L, 1)))
    request_dist = _softmax(sharp * logits)  # [R, L, E]
    lengths = _decode_lengths(seed, params, num_requests)  # [R]
    decode = _decode_tokens(rng, replace(params, decode_tokens=int(lengths.max())), request_dist)  # [R, T, L, K]
    requests = []
    for r in range(num_requests):
        prompt = _prompt_tokens(rng, params, request_dist[r], base)
        requests.append(TraceRequest(f"req-{r:05d}-g{group_of[r]:02d}", prompt, decode[r, : lengths[r]].copy()))
    header = TraceHeader(model or f"synthetic-{E}x{L}-top{params.top_k}", L, E, params.top_k)
    return header, requests, request_dist


def _decode_lengths(seed: int, params: ShapeParams, num_requests: int) -> np.ndarray:
    """Generated tokens per request; drawn from their own stream so that fixed lengths leave
    the routing of a seed unchanged."""
    if params.decode_sigma <= 0:
        return np.full(num_requests, params.decode_tokens, dtype=np.int64)
    rng = np.random.default_rng([seed, 1])
    draws = rng.lognormal(math.log(params.decode_tokens), params.decode_sigma, num_requests)
    return np.clip(np.round(draws), 1, params.decode_max).astype(np.int64)


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _zipf_layers(rng: np.random.Generator, num_layers: int, num_experts: int, s: float) -> np.ndarray:
    """Per layer, Zipf popularity over a random order of the experts."""
    ranks = np.argsort(rng.random((num_layers, num_experts)), axis=1)
    return _zipf(num_experts, s)[ranks]


def _zipf(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


def _sample(rng: np.random.Generator, probs: np.ndarray) -> np.ndarray:
    """One categorical draw per row of `probs` [N, E] (rows need not be normalised)."""
    cdf = np.cumsum(probs, axis=1)
    u = rng.random(cdf.shape[0]) * cdf[:, -1]
    return np.minimum((cdf < u[:, None]).sum(axis=1), cdf.shape[1] - 1)


def _decode_tokens(rng: np.random.Generator, params: ShapeParams, dist: np.ndarray) -> np.ndarray:
    """Decode routing `[R, T, L, K]`, generated for all requests and layers at once."""
    R, L, E = dist.shape
    T, K = params.decode_tokens, params.top_k
    probs = dist.reshape(R * L, E)
    out = np.empty((T, R * L, K), dtype=np.int32)
    for t in range(T):
        u = _correlated_uniforms(rng, R, L, K, params.layer_corr)  # [R*L, K]
        for j in range(K):
            out[t, :, j] = _pick_slot(rng, out, t, j, u[:, j], probs, params)
    return out.reshape(T, R, L, K).transpose(1, 0, 2, 3).copy()


def _correlated_uniforms(rng: np.random.Generator, R: int, L: int, K: int, corr: float) -> np.ndarray:
    """Uniforms `[R*L, K]`; with probability `corr` a slot shares its token's draw across layers."""
    shared = np.repeat(rng.random((R, 1, K)), L, axis=1)
    own = rng.random((R, L, K))
    return np.where(rng.random((R, L, K)) < corr, shared, own).reshape(R * L, K)


def _pick_slot(rng, out: np.ndarray, t: int, j: int, u: np.ndarray, probs: np.ndarray, params: ShapeParams):
    """Slot j of token t for every (request, layer) row: repeat, reuse recent, or draw fresh."""
    n = probs.shape[0]
    rows = np.arange(n)
    choice = _sample(rng, probs)
    if t >= 1:
        prev = out[t - 1, rows, rng.integers(0, params.top_k, n)]
        choice = np.where(u < params.p_same, prev, choice)
        if t >= 2:
            recent = (u >= params.p_same) & (u < params.p_same + params.p_recent)
            back = t - rng.integers(2, min(8, t) + 1, n)
            choice = np.where(recent, out[back, rows, rng.integers(0, params.top_k, n)], choice)
    return _dedupe(rng, out[t, :, :j], choice, probs)


def _dedupe(rng, taken: np.ndarray, choice: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Where `choice` repeats an expert this token already took, draw fresh among the others."""
    if taken.shape[1] == 0:
        return choice
    dup = np.flatnonzero((taken == choice[:, None]).any(axis=1))
    if dup.size:
        p = probs[dup] + 1e-12  # every free expert stays possible
        p[np.arange(dup.size)[:, None], taken[dup]] = 0.0
        choice[dup] = _sample(rng, p)
    return choice


def _prompt_tokens(rng, params: ShapeParams, dist: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Prompt routing `[P, L, K]`: i.i.d. draws from a mix of the request's and the global mix."""
    P = int(np.clip(rng.lognormal(math.log(params.prompt_median), params.prompt_sigma), 1, params.prompt_max))
    w = params.prompt_request_weight
    rows = np.tile(w * dist + (1 - w) * base, (P, 1))  # [P*L, E]
    out = np.empty((P * params.num_layers, params.top_k), dtype=np.int32)
    for j in range(params.top_k):
        out[:, j] = _dedupe(rng, out[:, :j], _sample(rng, rows), rows)
    return out.reshape(P, params.num_layers, params.top_k)


# -- measurement -----------------------------------------------------------------------


def trace_stats(header: TraceHeader, requests: Sequence[TraceRequest], group_threshold: float = 0.6) -> dict:
    """The decode statistics the generator is calibrated to (names as in `REAL_DECODE_STATS`).

    distinct: distinct experts a request uses at one layer; top_share: share of a
    request's tokens at one layer that the most used expert takes; same_as_previous /
    in_last_8: share of a token's experts also chosen by the previous token / one of
    the last 8 tokens at that layer; entropy: normalised entropy of all requests' usage
    per layer (mean over layers); groups: clusters of the requests' decode usage.
    """
    L, E = header.num_layers, header.num_experts
    distinct, top_share, same, recent, slots = [], [], 0, 0, 0
    usage = np.zeros((L, E))
    for req in requests:
        dec = req.decode  # [T, L, K]
        if len(dec) < 2:
            continue
        counts = _layer_counts(dec, E)  # [L, E]
        usage += counts
        distinct.extend((counts > 0).sum(axis=1).tolist())
        top_share.extend((counts.max(axis=1) / len(dec)).tolist())
        s, r, n = _reuse_counts(dec)
        same, recent, slots = same + s, recent + r, slots + n
    p = usage / np.maximum(usage.sum(axis=1, keepdims=True), 1)
    entropy = -(p * np.log(np.where(p > 0, p, 1))).sum(axis=1) / math.log(E)
    return {
        "distinct_median": float(np.median(distinct)),
        "distinct_p90": float(np.percentile(distinct, 90)),
        "top_share_median": float(np.median(top_share)),
        "same_as_previous": same / max(slots, 1),
        "in_last_8": recent / max(slots, 1),
        "entropy": float(entropy.mean()),
        "groups": count_groups(header, requests, group_threshold),
    }


def _layer_counts(dec: np.ndarray, num_experts: int) -> np.ndarray:
    T, L, K = dec.shape
    flat = (np.arange(L)[None, :, None] * num_experts + dec)[dec >= 0]
    return np.bincount(flat, minlength=L * num_experts).reshape(L, num_experts).astype(float)


def _reuse_counts(dec: np.ndarray, window: int = 8) -> tuple[int, int, int]:
    """Slots (t ≥ 1) whose expert was chosen by token t-1 / one of tokens t-8..t-1."""
    T = len(dec)
    cur = dec[1:]  # [T-1, L, K]
    valid = cur >= 0
    same = (cur[..., :, None] == dec[:-1, :, None, :]).any(-1)
    recent = same.copy()
    for back in range(2, min(window, T - 1) + 1):
        hit = (cur[back - 1 :, ..., None] == dec[: T - back, :, None, :]).any(-1)
        recent[back - 1 :] |= hit
    return int((same & valid).sum()), int((recent & valid).sum()), int(valid.sum())


def count_groups(header: TraceHeader, requests: Sequence[TraceRequest], threshold: float = 0.6) -> int:
    """Leader clustering of requests' decode usage by cosine similarity (a rough group count)."""
    leaders: list[np.ndarray] = []
    for req in requests:
        if len(req.decode) == 0:
            continue
        v = _layer_counts(req.decode, header.num_experts).ravel()
        v /= np.linalg.norm(v) or 1.0
        if not leaders or float(np.max(np.stack(leaders) @ v)) < threshold:
            leaders.append(v)
    return len(leaders)


# -- CLI -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cache.tracegen", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="many-small")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-tokens", type=int, default=None, help="generated tokens of every request (default: the shape's)")
    parser.add_argument("--groups", type=int, default=None, help="activation groups (request kinds)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--stats", action="store_true", help="print the trace's decode statistics")
    args = parser.parse_args(argv)
    params = SHAPES[args.shape]
    if args.decode_tokens is not None:
        params = replace(params, decode_tokens=args.decode_tokens, decode_sigma=0.0)
    if args.groups is not None:
        params = replace(params, groups=args.groups)
    header, requests = generate(params, args.requests, args.seed, model=f"synthetic-{args.shape}")
    write_trace(args.out, header, requests)
    if args.stats:
        header, requests = load_trace(args.out)
        for name, value in trace_stats(header, requests).items():
            print(f"{name:>18}: {value:.3f}")


if __name__ == "__main__":
    main()
