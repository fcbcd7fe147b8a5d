"""The statistics of a trace's decode routing that decide how a cache policy fares on it.

    python -m cache.trace_stats TRACE [--json]

Prints one row of issue 12's table for any `moe-trace/1` file. Only decode steps count
(the table describes the decode miss rate); a *use* is one (token, layer, expert) of a
generated token, and every statistic is about uses per (layer, expert) *within a request*:

- `tokens_median`: median over requests of the generated tokens per request.
- `first_use_share`: of all uses, the share that are the first use of that (layer,
  expert) in its request (pooled over the trace, so long requests weigh more).
- `reuse_p50`, `reuse_p90`: over all uses that are not first uses, the percentiles of
  the reuse distance: tokens since the previous use of the same (layer, expert) in the
  request (1: the previous token used it too).
- `same_as_previous`: of the uses by tokens after a request's first, the share whose
  (layer, expert) the previous token also used (reuse distance 1).
- `distinct_median`: median over (request, layer) of the distinct experts the request's
  tokens used at that layer (printed "27 of 128").
- `top10_share`: of all uses in the trace, the share taken by the 10% most used
  (layer, expert) keys (ceil(0.1 × L × E) keys; 0.1 when usage is uniform).
- `nearest_cosine`: median over requests of the cosine similarity of the request's EAM
  (uses per (layer, expert), flattened) to the most similar other request's EAM.

Requests without generated tokens are left out of every statistic.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

import numpy as np

from cache.trace import TraceHeader, TraceRequest, load_trace

COLUMNS = (  # (key, column title as in issue 12)
    ("tokens_median", "tokens per request (median)"),
    ("first_use_share", "first uses in a request"),
    ("reuse_p50", "reuse distance p50 / p90 (tokens)"),
    ("same_as_previous", "same expert as the previous token"),
    ("distinct_median", "distinct experts per layer per request"),
    ("top10_share", "top 10% of experts' share of uses"),
    ("nearest_cosine", "cosine of a request's EAM to its nearest other request"),
)


def request_uses(decode: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The uses of one request's decode `[T, L, K]`: flat keys `layer * E + expert` and tokens,
    sorted by key, then token."""
    T, L, K = decode.shape
    keys = np.arange(L)[None, :, None] * num_experts + decode  # [T, L, K]
    tokens = np.broadcast_to(np.arange(T)[:, None, None], decode.shape)
    valid = decode >= 0
    keys, tokens = keys[valid].astype(np.int64), tokens[valid].astype(np.int64)
    order = np.lexsort((tokens, keys))
    return keys[order], tokens[order]


def reuse_distances(keys: np.ndarray, tokens: np.ndarray) -> tuple[int, np.ndarray, int]:
    """From `request_uses`: (first uses, reuse distances of the other uses, uses after token 0)."""
    same_key = keys[1:] == keys[:-1]
    distances = (tokens[1:] - tokens[:-1])[same_key]
    first_uses = len(keys) - int(same_key.sum())
    return first_uses, distances, int((tokens > 0).sum())


def trace_stats(header: TraceHeader, requests: Sequence[TraceRequest]) -> dict:
    """The statistics of the module docstring, as a dict (shares in 0..1)."""
    L, E = header.num_layers, header.num_experts
    lengths, distinct, eams, gaps = [], [], [], []
    uses = firsts = later_uses = 0
    for req in requests:
        if len(req.decode) == 0:
            continue
        keys, tokens = request_uses(req.decode, E)
        first, distances, later = reuse_distances(keys, tokens)
        lengths.append(len(req.decode))
        uses, firsts, later_uses = uses + len(keys), firsts + first, later_uses + later
        gaps.append(distances)
        eam = np.bincount(keys, minlength=L * E).astype(np.float64)  # [L*E]
        distinct.extend((eam.reshape(L, E) > 0).sum(axis=1).tolist())
        eams.append(eam)
    if not eams:
        raise ValueError("the trace has no generated tokens")
    gaps = np.concatenate(gaps)
    eam_matrix = np.stack(eams)  # [R, L*E]
    return {
        "requests": len(eams),
        "num_experts": E,
        "tokens_median": float(np.median(lengths)),
        "first_use_share": firsts / uses,
        "reuse_p50": float(np.percentile(gaps, 50)) if len(gaps) else math.nan,
        "reuse_p90": float(np.percentile(gaps, 90)) if len(gaps) else math.nan,
        "same_as_previous": float((gaps == 1).sum()) / max(later_uses, 1),
        "distinct_median": float(np.median(distinct)),
        "top10_share": top_share(eam_matrix.sum(axis=0), 0.1),
        "nearest_cosine": nearest_cosine(eam_matrix),
    }


def top_share(totals: np.ndarray, fraction: float) -> float:
    """Share of the sum held by the ceil(fraction × n) largest entries."""
    n = math.ceil(fraction * len(totals))
    return float(np.sort(totals)[::-1][:n].sum() / max(totals.sum(), 1e-12))


def nearest_cosine(eams: np.ndarray) -> float:
    """Median over rows of the cosine to the most similar other row (nan for one row)."""  # eams [R, D]
    if len(eams) < 2:
        return math.nan
    unit = eams / np.maximum(np.linalg.norm(eams, axis=1, keepdims=True), 1e-12)
    sims = unit @ unit.T  # [R, R]
    np.fill_diagonal(sims, -np.inf)
    return float(np.median(sims.max(axis=1)))


def table_row(name: str, stats: dict) -> str:
    """The issue's table row: `| name | 128 | 21% | 2 / 26 | 33% | 27 of 128 | 54% | 0.83 |`."""
    cells = [
        name,
        f"{stats['tokens_median']:g}",
        f"{stats['first_use_share']:.0%}",
        f"{stats['reuse_p50']:g} / {stats['reuse_p90']:g}",
        f"{stats['same_as_previous']:.0%}",
        f"{stats['distinct_median']:g} of {stats['num_experts']}",
        f"{stats['top10_share']:.0%}",
        f"{stats['nearest_cosine']:.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


def table_head() -> str:
    titles = ["trace", *(title for _, title in COLUMNS)]
    return "| " + " | ".join(titles) + " |\n|" + "---|" * len(titles)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cache.trace_stats", description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a moe-trace/1 file")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table row")
    args = parser.parse_args(argv)
    header, requests = load_trace(args.trace)
    stats = trace_stats(header, requests)
    if args.json:
        print(json.dumps(stats))
    else:
        print(table_head())
        print(table_row(header.model or args.trace, stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
