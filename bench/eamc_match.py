"""EAMC matching time per query, which entry it ranks first, and the effect of EAMC capacity.

    python -m bench.eamc_match                               # timing at 256, 1,000 and 10,000 entries
    python -m bench.eamc_match --capacity-study TRACE        # miss rate vs --eamc-capacity (replay)

Timing runs on one thread (BLAS threads pinned to 1 before numpy loads). "cosine" is the
raw cosine to every entry plus the arg-max (what a full collection's replacement rule runs
once per add); "kernel" is the policy's guess (`kernel_decode_probability`: centred cosine
to every entry, pooled decode counts; once per 16 generated tokens); "after an add" is what
the centring recomputes once per version of the collection. The paper reports 21 µs for a
match at 1,000 entries (a sketched one, whose noise this project dropped: bench/RESULTS.md).
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from cache.eamc import EAMC  # noqa: E402

SHAPES = {"128x24 (top-1)": (24, 128), "64x26 (top-6)": (26, 64), "8x32 (top-2)": (32, 8)}


def make_kinds(rng: np.random.Generator, L: int, E: int, density: float = 0.2) -> np.ndarray:
    """20 request kinds: sparse non-negative [L, E] activation patterns."""  # [20, L, E]
    return rng.random((20, L, E)) * (rng.random((20, L, E)) < density)


def fake_reams(rng: np.random.Generator, kinds: np.ndarray, n: int, density: float = 0.2):
    """n rEAM-like matrices [n, L, E]: a kind's pattern plus the request's own experts; and their kinds."""
    kind_of = rng.integers(0, len(kinds), n)
    shape = (n, *kinds.shape[1:])
    own = rng.random(shape) * (rng.random(shape) < density)
    return (kinds[kind_of] + own).astype(np.float32), kind_of


def per_call_us(fn, repeat: int) -> float:
    for _ in range(min(20, repeat)):
        fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        samples.append((time.perf_counter() - start) / repeat * 1e6)
    return float(np.median(samples))


def time_shape(L: int, E: int, n: int, rng: np.random.Generator) -> dict:
    eamc = EAMC(L, E, capacity=n)
    kinds = make_kinds(rng, L, E)
    reams, kind_of = fake_reams(rng, kinds, n)
    for m in reams:
        eamc.add(m, m, 128)
    q = reams[0] * rng.random(reams[0].shape, dtype=np.float32)
    repeat = 200 if n <= 1000 else 20
    return {
        "cosine_us": per_call_us(lambda: int(np.argmax(eamc.similarities(q, q, 0.5))), repeat),
        "kernel_us": per_call_us(lambda: eamc.kernel_decode_probability(q, q, 0.5), repeat),
        "after_add_us": per_call_us(lambda: recentre(eamc), repeat),
        "same_kind": same_kind(eamc, kind_of, kinds, rng),
    }


def recentre(eamc: EAMC) -> None:
    eamc._centring = None  # as after an add
    eamc.centred_similarities(np.zeros(1), np.zeros(1), 0.5)


def same_kind(eamc: EAMC, kind_of: np.ndarray, kinds: np.ndarray, rng: np.random.Generator, queries: int = 100):
    """Share of new requests whose most similar entry (raw, centred cosine) is of the request's own kind."""
    reams, kind_of_query = fake_reams(rng, kinds, queries)
    hits = np.zeros(2)
    for q, kind in zip(reams, kind_of_query, strict=True):
        q = q * rng.random(q.shape, dtype=np.float32)
        for i, sims in enumerate((eamc.similarities(q, q, 0.5), eamc.centred_similarities(q, q, 0.5))):
            hits[i] += kind_of[int(np.argmax(sims))] == kind
    return tuple(hits / queries)


def timing_table(seed: int) -> str:
    rng = np.random.default_rng(seed)
    lines = [
        "| rEAM shape | entries | cosine (µs) | kernel (µs) | after an add (µs) | right kind: raw / centred |",
        "|---|---|---|---|---|---|",
    ]
    for name, (L, E) in SHAPES.items():
        for n in (256, 1000, 10000):
            r = time_shape(L, E, n, rng)
            lines.append(
                f"| {name} | {n:,} | {r['cosine_us']:.0f} | {r['kernel_us']:.0f} | {r['after_add_us']:.0f} "
                f"| {r['same_kind'][0]:.0%} / {r['same_kind'][1]:.0%} |"
            )
            print(lines[-1], flush=True)
    return "\n".join(lines)


def capacity_study(trace: str, capacities: list[int], fracs: list[float]) -> str:
    from cache.replay import replay
    from cache.sparsity_aware import SparsityAwarePolicy
    from cache.trace import load_trace

    header, requests = load_trace(trace)
    total = header.num_layers * header.num_experts
    lines = [
        "| EAMC capacity | " + " | ".join(f"miss rate at {f:.0%}" for f in fracs) + " |",
        "|---|" + "---|" * len(fracs),
    ]
    for cap in capacities:
        cells = []
        for frac in fracs:
            policy = SparsityAwarePolicy(header.num_layers, header.num_experts, eamc_capacity=cap)
            cells.append(f"{replay(header, requests, policy, round(frac * total))['decode_miss_rate']:.2%}")
        lines.append(f"| {cap} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--capacity-study", metavar="TRACE", help="replay TRACE with several EAMC capacities")
    parser.add_argument("--capacities", default="1,4,16,64,256,1024")
    parser.add_argument("--fracs", default="0.1,0.25")
    args = parser.parse_args()
    if args.capacity_study:
        caps = [int(c) for c in args.capacities.split(",")]
        print(capacity_study(args.capacity_study, caps, [float(f) for f in args.fracs.split(",")]))
    else:
        print(timing_table(args.seed))


if __name__ == "__main__":
    main()
