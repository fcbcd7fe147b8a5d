"""Replay a `moe-trace/1` routing trace through the expert cache and a policy, moving no bytes.

    python -m cache.replay TRACE --policy P (--capacity N | --capacity-frac F) [--json]
    python -m cache.replay TRACE --sweep [--out DIR] [--fracs 0.05,0.1,0.25,0.5]
    python -m cache.replay TRACE --policy P --capacity N --timed [--prefetch --lookahead-accuracy 0.8]
        [--expert-mb 352 --link-gbps 24 --compute-ms 1.6 --token-ms 0 --chunk-mb 0]

The same `ExpertCache` and policy objects the engine uses run with `DryRunBackend`.
Semantics (DESIGN.md): requests in file order, cache and EAMC carried over; a prefill
step at layer l needs the union of all prompt tokens' experts at l (acquired in turns of
at most `capacity` when it needs more); a decode step needs that token's experts at l;
a miss is a needed expert not resident when its step runs; a transfer is any load,
demand or prefetch. `belady` is the offline optimum, built from the trace's own future.
`--timed` adds a model of the host→device link and the compute (`cache.timed`) and
reports the simulated time per decode token.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import sys
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

import cache.sparsity_aware  # noqa: F401  (registers "sparsity-aware")
from cache.expert_cache import DryRunBackend, ExpertCache
from cache.miss_planner import MissCosts, MissPlanner
from cache.policy import POLICIES, ExpertKey, Policy, first_unprotected, make_policy
from cache.prefetcher import PREFETCH_LIMIT_PER_TOP_K, PrefetchCost, Prefetcher
from cache.runtime import ExpertRuntime, chunks
from cache.stats import CacheStats
from cache.timed import Link, LinkSpec, TimedBackend
from cache.trace import TraceHeader, TraceRequest, load_trace, read_trace

REPLAY_POLICIES = ("lru", "lfu", "sparsity-aware", "belady")
DEFAULT_FRACS = (0.05, 0.10, 0.25, 0.50)
START, STEP, END = "start", "step", "end"


# -- the offline optimum -----------------------------------------------------------------


def next_use_positions(accesses: np.ndarray) -> np.ndarray:
    """For each position i, the next position holding the same key (len(accesses) if none)."""
    n = len(accesses)
    order = np.argsort(accesses, kind="stable")  # positions grouped by key, in time order
    nxt = np.full(n, n, dtype=np.int64)
    same = accesses[order[1:]] == accesses[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


class BeladyPolicy(Policy):
    """Evict the resident expert whose next use lies farthest ahead; never prefetches.

    Fed the exact sequence of accesses `on_access` will see (flat keys `layer * E +
    expert`), it is still driven through `ExpertCache` like every other policy.
    """

    name = "belady"

    def __init__(self, num_layers: int, num_experts: int, accesses: np.ndarray) -> None:
        super().__init__(num_layers, num_experts)
        accesses = np.asarray(accesses, dtype=np.int64)
        self._keys = array("q", accesses.tobytes())  # compact, and indexing yields Python ints
        self._next = array("q", next_use_positions(accesses).tobytes())
        self._pos = 0
        self._next_of: dict[ExpertKey, int] = {}  # resident key → position of its next use
        self._heap: list[tuple[int, ExpertKey]] = []  # (-next use, key); stale entries are skipped

    def on_access(self, key: ExpertKey) -> None:
        pos = self._pos
        if pos >= len(self._keys) or self._keys[pos] != key[0] * self.num_experts + key[1]:
            raise RuntimeError(f"access {pos} is {key}, not the one the precomputed sequence holds")
        self._pos = pos + 1
        nxt = self._next[pos]
        self._next_of[key] = nxt
        heapq.heappush(self._heap, (-nxt, key))

    def on_insert(self, key: ExpertKey) -> None:
        self._next_of.setdefault(key, self._pos)  # the access that follows sets the true value

    def on_evict(self, key: ExpertKey) -> None:
        self._next_of.pop(key, None)

    def victim(self, resident: Iterable[ExpertKey], protected: set[ExpertKey]) -> ExpertKey:
        # an entry is stale once its key was evicted or used again
        return first_unprotected(self._heap, lambda e: self._next_of.get(e[1]) == -e[0], protected)


# -- the steps of a trace --------------------------------------------------------------


def iter_steps(header: TraceHeader, requests: Iterable[TraceRequest]) -> Iterator[tuple]:
    """(START, id) · (STEP, phase, layer, sorted experts, tokens, counts) per layer per step · (END, id).

    `counts`: tokens per expert of a prefill step; None for a decode step (one token each).
    """
    for req in requests:
        yield START, req.id
        if len(req.prefill):
            for layer in range(header.num_layers):
                experts, counts = _union(req.prefill[:, layer])
                yield STEP, "prefill", layer, experts, len(req.prefill), counts
        for token in _decode_rows(req.decode):
            for layer, experts in enumerate(token):
                yield STEP, "decode", layer, experts, 1, None
        yield END, req.id


def _union(ids: np.ndarray) -> tuple[list[int], list[int]]:
    """The sorted experts of a prefill step's `[T, k]` ids (padding dropped) and their token counts."""
    unique, counts = np.unique(ids, return_counts=True)
    keep = unique >= 0
    return unique[keep].tolist(), counts[keep].tolist()


def _decode_rows(decode: np.ndarray) -> list:
    """Per token, per layer, the sorted expert ids (padding dropped)."""
    rows = np.sort(decode, axis=2)
    if decode.size and (rows < 0).any():
        return [[[e for e in ids if e >= 0] for ids in token] for token in rows.tolist()]
    return rows.tolist()


def access_sequence(header: TraceHeader, requests: Sequence[TraceRequest], capacity: int) -> np.ndarray:
    """Flat keys in the exact order `ExpertCache.acquire` reports them to the policy."""
    parts = []
    E = header.num_experts
    for event in iter_steps(header, requests):
        if event[0] is STEP:
            layer, experts = event[2], event[3]
            for turn in chunks(experts, capacity):
                parts.append(np.asarray(turn, dtype=np.int64) + layer * E)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


# -- one replay ------------------------------------------------------------------------


def build_policy(name: str, header: TraceHeader, requests: Sequence[TraceRequest], capacity: int) -> Policy:
    if name == "belady":
        return BeladyPolicy(header.num_layers, header.num_experts, access_sequence(header, requests, capacity))
    return make_policy(name, header.num_layers, header.num_experts)


def replay(
    header: TraceHeader,
    requests: Sequence[TraceRequest],
    policy: str | Policy,
    capacity: int,
    prefetch: bool = False,
    link: LinkSpec | None = None,
    lookahead_accuracy: float | None = None,
    gate: bool = True,
    learn_overlap: bool = False,
) -> dict:
    """Run the trace through `ExpertCache` + policy; the counts of the DESIGN.md contract.

    `link`: also simulate time (`cache.timed`) and report TPOT. `lookahead_accuracy`: with
    prefetch, guess each decode step's next layer as the engine's look-ahead router does,
    right for that share of its experts (the trace holds no hidden states to apply a router to).
    `gate`: with a link, prefetch only while guesses are accurate enough to pay (`PrefetchCost`).
    `learn_overlap`: the gate learns one layer's compute from the simulated clock, as the engine
    learns it from the wall clock on CUDA, instead of taking `link.compute_ms` as known.
    """
    started = time.perf_counter()
    if isinstance(policy, str):
        policy = build_policy(policy, header, requests, capacity)
    stats = {"prefill": CacheStats(header.num_layers), "decode": CacheStats(header.num_layers)}
    backend = DryRunBackend(bytes_per_expert=1) if link is None else TimedBackend(Link(link))
    cache = ExpertCache(capacity, policy, stats["decode"], backend)
    cost = None
    if link is not None and gate:
        cost = PrefetchCost(link.copy_ms(link.expert_bytes), 0.0 if learn_overlap else link.compute_ms, learn_overlap)
    clock = _drive(cache, header, iter_steps(header, requests), stats, prefetch, lookahead_accuracy, cost)
    result = summarize(policy.name, capacity, header, len(requests), stats)
    result["prefetch"] = prefetch
    if link is not None:
        result.update(_timing(backend.link, clock, result))
    if cost is not None and prefetch:
        result["prefetch_window_ms"] = round(cost.overlap_ms, 4)  # the gate's compute window, given or learned
    result["seconds"] = round(time.perf_counter() - started, 3)
    return result


class DecodeClock:
    """Simulated decode time per request: from the end of its prefill to its last token."""

    def __init__(self) -> None:
        self.decode_ms = 0.0
        self.decode_tokens = 0
        self._mark: float | None = None

    def start(self, link: Link | None) -> None:
        if link is not None:
            self._mark = link.now

    def step(self, link: Link | None, phase: str, layer: int, last_layer: int) -> None:
        if link is None:
            return
        link.compute(link.spec.compute_ms)
        if layer == last_layer:
            link.compute(link.spec.token_ms)
            if phase == "decode":
                self.decode_ms += link.now - self._mark
                self.decode_tokens += 1
            self._mark = link.now


def _drive(cache: ExpertCache, header: TraceHeader, steps, stats: dict, prefetch: bool,
           lookahead_accuracy: float | None, cost: PrefetchCost | None) -> DecodeClock:
    """Each step through `ExpertRuntime.run_step`, as the engine runs it (prefetch at the same point)."""
    runtime = ExpertRuntime(cache, header.num_layers, header.num_experts, header.top_k)
    lookahead = SimulatedLookahead(header, lookahead_accuracy) if lookahead_accuracy is not None else None
    link = getattr(cache.backend, "link", None)
    if prefetch:
        routers = lookahead.routers() if lookahead else [None] * header.num_layers
        clock = (lambda: link.now / 1000) if link is not None else time.perf_counter
        runtime.prefetcher = Prefetcher(cache, routers, background=False,
                                        limit=PREFETCH_LIMIT_PER_TOP_K * header.top_k, cost=cost, clock=clock)
    clock = DecodeClock()
    wait_only = None if link is None else _no_compute  # with a link, `run_step` waits for each copy
    on_host = _host_executor(runtime, link)
    for event, following in _with_next(steps):
        if event[0] is STEP:
            _, phase, layer, experts, tokens, counts = event
            cache.stats = stats[phase]
            runtime.phase = phase
            if lookahead is not None:
                lookahead.expect(following)
            runtime.note_routing(layer, experts, tokens, counts)
            runtime.run_step(layer, experts, None, wait_only, on_host)
            clock.step(link, phase, layer, header.num_layers - 1)
        elif event[0] is START:
            runtime.begin_request(event[1])
            clock.start(link)
        else:
            runtime.end_request(event[1])
    return clock


def _no_compute(experts: Sequence[int], slots: list[int]) -> None:
    pass


def _host_executor(runtime: ExpertRuntime, link: Link | None):
    """With `cpu_gbps`, plan misses between the link and the host cores as the engine does."""
    if link is None or link.spec.cpu_gbps <= 0:
        return None
    costs = MissCosts(link.spec.copy_ms(link.spec.expert_bytes), link.spec.host_ms(link.spec.expert_bytes))
    if not costs.gains(link.spec.share_misses):
        return None
    runtime.planner = MissPlanner(costs, share=link.spec.share_misses)

    def compute_on_host(expert: int, buffer: object, fraction: float) -> None:
        link.compute_on_host(fraction * costs.host_ms)
        if fraction < 1:
            link.copy_part(round((1 - fraction) * link.spec.expert_bytes))

    return compute_on_host


def _with_next(events: Iterable) -> Iterator[tuple]:
    """Each event with the one after it (None after the last)."""
    previous = sentinel = object()
    for event in events:
        if previous is not sentinel:
            yield previous, event
        previous = event
    if previous is not sentinel:
        yield previous, None


class SimulatedLookahead:
    """The engine's look-ahead router, simulated from the trace: it names each of the next
    layer's experts correctly with probability `accuracy`, else another expert (seeded)."""

    def __init__(self, header: TraceHeader, accuracy: float, seed: int = 0) -> None:
        self.header = header
        self.accuracy = accuracy
        self.rng = random.Random(seed)
        self.guess: list[int] = []

    def routers(self) -> list:
        return [None] + [self._router] * (self.header.num_layers - 1)

    def expect(self, following: tuple | None) -> None:
        """Guess from the step after this one, when it is the next layer of the same decode token."""
        self.guess = []
        if following is not None and following[0] is STEP and following[1] == "decode" and following[2] > 0:
            truth = following[3]
            others = [e for e in range(self.header.num_experts) if e not in truth]
            self.guess = [e if self.rng.random() < self.accuracy or not others else others.pop(self.rng.randrange(len(others)))
                          for e in truth]

    def _router(self, hidden) -> torch.Tensor:
        return torch.tensor([self.guess], dtype=torch.long)


def _timing(link: Link, clock: DecodeClock, result: dict) -> dict:
    tokens = max(1, clock.decode_tokens)
    return {
        "tpot_ms": round(clock.decode_ms / tokens, 4),
        "link_gb_per_decode_token": round(
            (link.spec.expert_bytes * result["decode_transfers"] + link.part_bytes) / tokens / 1e9, 4
        ),
        "link": {"expert_bytes": link.spec.expert_bytes, "link_gbps": link.spec.link_gbps,
                 "compute_ms": link.spec.compute_ms, "token_ms": link.spec.token_ms,
                 "chunk_bytes": link.spec.chunk_bytes, "cpu_gbps": link.spec.cpu_gbps,
                 "share_misses": link.spec.share_misses},
    }


def summarize(name: str, capacity: int, header: TraceHeader, num_requests: int, stats: dict) -> dict:
    pre, dec = stats["prefill"].totals(), stats["decode"].totals()
    decode_accesses = dec["hits"] + dec["misses"]
    decode_transfers = dec["misses"] - dec["cpu_computed"] + dec["prefetches"]
    transfers = decode_transfers + pre["misses"] + pre["prefetches"]
    total = header.num_layers * header.num_experts
    return {
        "policy": name,
        "capacity": capacity,
        "capacity_frac": round(capacity / total, 4),
        "requests": num_requests,
        "decode_accesses": decode_accesses,
        "decode_misses": dec["misses"],
        "decode_cpu_computed": dec["cpu_computed"],
        "decode_miss_rate": _ratio(dec["misses"], decode_accesses),
        "prefill_accesses": pre["hits"] + pre["misses"],
        "prefill_misses": pre["misses"],
        "prefetches": pre["prefetches"] + dec["prefetches"],
        "prefetch_used": pre["prefetch_used"] + dec["prefetch_used"],
        "transfers": transfers,
        "decode_transfers": decode_transfers,
        "transfers_per_decode_access": _ratio(decode_transfers, decode_accesses),
        "decode_miss_rate_per_layer": [
            _ratio(m, h + m) for h, m in zip(stats["decode"].hits, stats["decode"].misses, strict=True)
        ],
    }


def _ratio(a: int, b: int) -> float:
    return round(a / b, 6) if b else 0.0


def capacity_of(header: TraceHeader, capacity: int | None, frac: float | None) -> int:
    """Slots from `--capacity` or `--capacity-frac`; at least one decode step's worth."""
    if capacity is None:
        capacity = round(frac * header.num_layers * header.num_experts)
    if capacity < header.top_k:
        raise ValueError(f"capacity {capacity} is below top_k={header.top_k}: a decode step cannot fit")
    return capacity


# -- sweep -----------------------------------------------------------------------------

_TRACES: dict[str, tuple] = {}  # per worker process: path → loaded trace


def _replay_job(path: str, policy: str, frac: float, prefetch: bool) -> dict:
    if path not in _TRACES:
        _TRACES[path] = load_trace(path)
    header, requests = _TRACES[path]
    result = replay(header, requests, policy, capacity_of(header, None, frac), prefetch)
    result["capacity_frac_requested"] = frac
    if prefetch:
        result["policy"] += "+prefetch"
    return result


def sweep(path: str, policies: Sequence[str], fracs: Sequence[float], jobs: int, prefetch: bool) -> dict:
    """Every policy at every capacity fraction; `prefetch` adds a sparsity-aware+prefetch series."""
    tasks = [(path, p, f, False) for f in fracs for p in policies]
    if prefetch:
        tasks += [(path, "sparsity-aware", f, True) for f in fracs]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            results = list(pool.map(_replay_job, *zip(*tasks, strict=True)))
    else:
        results = [_replay_job(*task) for task in tasks]
    header = _header(path)
    return {"trace": str(path), "model": header.model, "shape": _shape(header), "results": results}


def _header(path: str) -> TraceHeader:
    header, requests = read_trace(path)
    requests.close()  # only the header is needed
    return header


def _shape(header: TraceHeader) -> str:
    return f"{header.num_experts} experts, top-{header.top_k}, {header.num_layers} layers"


def gap_closed(lru: float, ours: float, belady: float) -> float | None:
    """Share of the LRU→Belady gap that `ours` closes (None when there is no gap)."""
    gap = lru - belady
    return (lru - ours) / gap if gap > 1e-12 else None


def sweep_table(data: dict) -> tuple[list[str], list[list[str]]]:
    """Rows per capacity: miss rate (transfers per decode access) per series, and gap closed."""
    by = {(r["policy"], r["capacity_frac_requested"]): r for r in data["results"]}
    series = list(dict.fromkeys(r["policy"] for r in data["results"]))
    head = ["cache", *series, "gap closed"]
    rows = []
    for frac in sorted({r["capacity_frac_requested"] for r in data["results"]}):
        cells = [f"{frac:.0%} ({by[(series[0], frac)]['capacity']})"]
        for name in series:
            r = by[(name, frac)]
            cells.append(f"{r['decode_miss_rate']:.1%} ({r['transfers_per_decode_access']:.3f})")
        rates = {name: by[(name, frac)]["decode_miss_rate"] for name in series}
        closed = None
        if {"lru", "belady", "sparsity-aware"} <= rates.keys():
            closed = gap_closed(rates["lru"], rates["sparsity-aware"], rates["belady"])
        cells.append("n/a" if closed is None else f"{closed:.0%}")
        rows.append(cells)
    return head, rows


def write_sweep(data: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "sweep.json", out / "sweep.md", out / "sweep.png"]
    paths[0].write_text(json.dumps(data, indent=1) + "\n")
    head, rows = sweep_table(data)
    lines = [
        f"Trace `{data['trace']}` ({data['shape']}): decode miss rate (transfers per decode access)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    paths[1].write_text("\n".join(lines) + "\n")
    plot_sweep(data, paths[2])
    return paths


def plot_sweep(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["policy"] for r in data["results"]):
        points = sorted((r["capacity_frac"], r["decode_miss_rate"]) for r in data["results"] if r["policy"] == name)
        style = "--" if name.endswith("+prefetch") else "-"
        ax.plot([100 * x for x, _ in points], [100 * y for _, y in points], style, marker="o", label=name)
    ax.set_xlabel("cache size (% of all experts)")
    ax.set_ylabel("decode miss rate (%)")
    ax.set_title(data["shape"])
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- CLI -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.sweep:
        return _main_sweep(args)
    if args.policy is None or (args.capacity is None) == (args.capacity_frac is None):
        print("error: give --policy and one of --capacity / --capacity-frac (or --sweep)", file=sys.stderr)
        return 2
    header, requests = load_trace(args.trace)
    link = link_spec(args) if args.timed else None
    capacity = capacity_of(header, args.capacity, args.capacity_frac)
    result = replay(header, requests, args.policy, capacity, args.prefetch, link, args.lookahead_accuracy,
                    gate=not args.no_prefetch_gate, learn_overlap=args.learn_overlap)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            if key not in ("decode_miss_rate_per_layer", "link"):
                print(f"{key:>28}: {value}")
    return 0


def _main_sweep(args) -> int:
    policies = args.policy.split(",") if args.policy else list(REPLAY_POLICIES)
    fracs = [float(f) for f in args.fracs.split(",")]
    data = sweep(args.trace, policies, fracs, args.jobs, args.prefetch)
    out = Path(args.out) if args.out else Path("bench/out") / Path(args.trace).stem
    paths = write_sweep(data, out)
    if args.json:
        print(json.dumps(data))
    else:
        print(paths[1].read_text(), end="")
        print("wrote", ", ".join(str(p) for p in paths))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cache.replay", description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a moe-trace/1 file")
    parser.add_argument("--policy", help=f"one of {', '.join(_policy_names())} (--sweep: a comma list)")
    parser.add_argument("--capacity", type=int, help="cache slots, counted in experts over all layers")
    parser.add_argument("--capacity-frac", type=float, help="cache slots as a fraction of L × E")
    parser.add_argument("--prefetch", action="store_true", help="let the policy prefetch after each layer")
    parser.add_argument("--lookahead-accuracy", type=float, default=None, metavar="P",
                        help="with --prefetch: simulate the engine's look-ahead guess, right for a share P of experts")
    timed = parser.add_argument_group("timed replay (cache.timed): simulated TPOT; defaults: Mixtral-8x7B "
                                      "bf16 experts on a 24 GB card over PCIe 4.0 x16")
    timed.add_argument("--timed", action="store_true", help="simulate the link and the compute; report TPOT")
    timed.add_argument("--expert-mb", type=float, default=LinkSpec.expert_bytes / 1e6, help="bytes per expert, in MB")
    timed.add_argument("--link-gbps", type=float, default=LinkSpec.link_gbps, help="host→device GB/s")
    timed.add_argument("--compute-ms", type=float, default=LinkSpec.compute_ms,
                       help="one MoE layer of one decode token with its experts resident")
    timed.add_argument("--token-ms", type=float, default=LinkSpec.token_ms, help="per token outside the MoE layers")
    timed.add_argument("--chunk-mb", type=float, default=0.0, help="copy granularity (0: whole experts)")
    timed.add_argument("--cpu-gbps", type=float, default=0.0,
                       help="compute some misses on the host cores, which read expert weights at this GB/s "
                            "(the engine's --cpu-experts; 0: off)")
    timed.add_argument("--no-share-misses", action="store_true",
                       help="with --cpu-gbps: compute each miss whole on one side (no expert shared by both)")
    timed.add_argument("--no-prefetch-gate", action="store_true",
                       help="issue every guess, however inaccurate (the engine before the cost gate)")
    timed.add_argument("--learn-overlap", action="store_true",
                       help="the gate learns a layer's compute from the simulated clock, as the engine does on CUDA "
                            "(default: it is given --compute-ms)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--sweep", action="store_true", help="every policy at every --fracs capacity")
    parser.add_argument("--fracs", default=",".join(str(f) for f in DEFAULT_FRACS))
    parser.add_argument("--out", help="sweep output folder (default bench/out/<trace name>)")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="sweep processes")
    return parser


def link_spec(args: argparse.Namespace) -> LinkSpec:
    return LinkSpec(
        expert_bytes=round(args.expert_mb * 1e6), link_gbps=args.link_gbps, compute_ms=args.compute_ms,
        token_ms=args.token_ms, chunk_bytes=round(args.chunk_mb * 1e6), cpu_gbps=args.cpu_gbps,
        share_misses=not args.no_share_misses,
    )


def _policy_names() -> list[str]:
    return sorted({*POLICIES, "belady"})


if __name__ == "__main__":
    sys.exit(main())
