"""Engine benchmarks (issue 2), run side by side in one process so ratios are comparable.

    python -m bench.engine_bench tpot [--device cpu] [--tokens 64] [--rounds 3]
    python -m bench.engine_bench rss  [--host-cache-gb 0.25]
    python -m bench.engine_bench server [--tokens 64] [--rounds 3]
    python -m bench.engine_bench apis [--tokens 64] [--rounds 3]

`tpot`: time per output token of our engine vs transformers `generate` on the same model
with all experts resident, then our engine with a cache of 25% of the experts (TPOT,
hits/misses and bytes moved per token). `rss`: peak RSS of a process that loads a
checkpoint bigger than `--host-cache-gb` and generates, vs one that keeps all experts in RAM.
`server`: the same model with all experts cached through a real `moe-serve` process (streamed
`/v1/completions`, TTFT and TPOT from the SSE chunks' arrival), against the engine called
directly and transformers `generate`, interleaved round by round (CPU). `apis`: the same server through
chat completions, the Responses API and the Anthropic Messages API, interleaved (the same messages).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM
from transformers.generation.streamers import BaseStreamer

from cache.stats import CacheStats
from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from tests.fixtures.tokenizers import write_tokenizer

PROMPT = "Explain, step by step, how a mixture-of-experts language model chooses its experts."


def build_model(
    folder: Path, hidden: int, intermediate: int, layers: int, experts: int, dtype: torch.dtype
) -> Path:
    tokenizer = write_tokenizer("mixtral", folder)
    config = MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=experts, num_experts_per_tok=2,
        max_position_embeddings=2048, initializer_range=0.1, dtype=dtype,
    )  # fmt: skip
    torch.manual_seed(0)
    MixtralForCausalLM(config).to(dtype).save_pretrained(folder)
    return folder


@dataclass(frozen=True)
class EngineRun:
    ttft_s: float
    tpot_s: float
    decode_counters: dict[str, int]  # the expert cache's counters over the decode steps (prefill excluded)
    decode_steps: int


def engine_run(engine: Engine, prompt: list[int], tokens: int) -> EngineRun:
    """One greedy request of `tokens` tokens: its times, and what the cache did after the prefill."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    before = None
    for _ in engine.generate(GenerationRequest("bench", prompt, params)):
        before = before or engine.cache_counters()  # at the first token: the prefill is done
    after = engine.cache_counters()
    t = engine.last_times
    counters = {name: after[name] - before[name] for name in CacheStats.COUNTERS}
    return EngineRun(t.first_token - t.start, (t.end - t.first_token) / (t.tokens - 1), counters, t.tokens - 1)


def engine_tpot(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(time to first token, time per output token after it) in seconds."""
    run = engine_run(engine, prompt, tokens)
    return run.ttft_s, run.tpot_s


class TokenClock(BaseStreamer):
    """Marks the time `generate` hands over the prompt and then each new token."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def put(self, value) -> None:
        self.marks.append(time.perf_counter())

    def end(self) -> None:
        pass


def transformers_tpot(model, prompt: list[int], tokens: int, device=None) -> tuple[float, float]:
    """(time to first token, time per output token after it) in seconds, of one `generate` call.

    `device`: where the prompt goes (default `model.device`, which is `meta` when accelerate
    offloads the first weights to disk)."""
    ids = torch.tensor([prompt], device=device or model.device)
    clock = TokenClock()
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, streamer=clock, **kwargs)
    first, last = clock.marks[1], clock.marks[-1]  # marks[0]: the prompt, before the prefill
    return first - start, (last - first) / (tokens - 1)


def run_tpot(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp), 256, 512, 8, 8, torch.float32)
        total = 8 * 8
        ours_all = Engine.load(
            EngineConfig(model=str(folder), device=args.device, policy="lru", expert_cache_experts=total,
                         prefix_cache=0)  # TTFT against transformers, which computes every prompt whole
        )
        ours_quarter = Engine.load(
            EngineConfig(model=str(folder), device=args.device, policy="lru", expert_cache_experts=total // 4,
                         prefix_cache=0)
        )
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(args.device).eval()
        prompt = ours_all.encode(PROMPT)
        engine_tpot(ours_all, prompt, 4)  # warm-up
        transformers_tpot(reference, prompt, 4)
        samples: dict[str, list[tuple[float, float]]] = {"ours_all": [], "transformers": [], "ours_25pct": []}
        for _ in range(args.rounds):  # interleaved, so machine noise hits all alike
            samples["ours_all"].append(engine_tpot(ours_all, prompt, args.tokens))
            samples["transformers"].append(transformers_tpot(reference, prompt, args.tokens))
            before = ours_quarter.cache_counters()
            samples["ours_25pct"].append(engine_tpot(ours_quarter, prompt, args.tokens))
        after = ours_quarter.cache_counters()
        per_run = {k: (after[k] - before[k]) for k in ("hits", "misses", "bytes_transferred")}
    result = {name: median_ms(values) for name, values in samples.items()}
    result["tpot_ratio_ours_over_transformers"] = (
        result["ours_all"]["tpot_ms"] / result["transformers"]["tpot_ms"]
    )
    result["ours_25pct_cache"] = {
        "hit_rate": per_run["hits"] / (per_run["hits"] + per_run["misses"]),
        "misses_per_token": per_run["misses"] / args.tokens,
        "bytes_per_token": per_run["bytes_transferred"] / args.tokens,
    }
    result["setup"] = {"model": "Mixtral-shaped, H=256, I=512, 8 layers x 8 experts top-2, fp32", "device": args.device,
                       "prompt_tokens": len(prompt), "new_tokens": args.tokens, "rounds": args.rounds}  # fmt: skip
    return result


def server_tpot(http, model: str, prompt: list[int], tokens: int) -> tuple[float, float]:
    """TTFT and TPOT (s) of greedy completions as a client sees them: the whole time of a
    one-token request, then of a `tokens` one (a random model's first tokens may be bytes of
    one character, so the first streamed chunk can come tokens late: chunks are not timed).
    `http`: one client kept open, as an SDK keeps its connection (building an httpx client
    costs tens of ms on this machine, which is the client's cost, not the server's)."""

    def complete(max_tokens: int) -> float:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        start = time.perf_counter()
        response = http.post("/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        assert response.json()["usage"]["completion_tokens"] == max_tokens
        return time.perf_counter() - start

    first = complete(1)
    return first, (complete(tokens) - first) / (tokens - 1)


def run_server(args: argparse.Namespace) -> dict:
    from server.testing import RemoteServer

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp), 256, 512, 8, 8, torch.float32)
        # the defaults (every expert cached, so no prefetch) but prompt reuse: TTFT is of whole prompts
        flags = ["--model", str(folder), "--device", "cpu", "--prefix-cache", "0"]
        engine = Engine.load(EngineConfig(model=str(folder), device="cpu", prefix_cache=0))
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        prompt = engine.encode(PROMPT)
        samples: dict[str, list[tuple[float, float]]] = {"server": [], "engine": [], "transformers": []}
        with RemoteServer(flags, ready_timeout=600) as server, server.http() as http:
            model = server.openai().models.list().data[0].id
            server_tpot(http, model, prompt, 4)  # warm-up
            engine_tpot(engine, prompt, 4)
            transformers_tpot(reference, prompt, 4)
            for _ in range(args.rounds):  # interleaved, so machine noise hits all alike
                samples["server"].append(server_tpot(http, model, prompt, args.tokens))
                samples["engine"].append(engine_tpot(engine, prompt, args.tokens))
                samples["transformers"].append(transformers_tpot(reference, prompt, args.tokens))
    result = {name: median_ms(values) for name, values in samples.items()}
    result["tpot_server_over_transformers"] = result["server"]["tpot_ms"] / result["transformers"]["tpot_ms"]
    result["tpot_server_over_engine"] = result["server"]["tpot_ms"] / result["engine"]["tpot_ms"]
    result["ttft_server_minus_engine_ms"] = result["server"]["ttft_ms"] - result["engine"]["ttft_ms"]
    result["setup"] = {"model": "Mixtral-shaped, H=256, I=512, 8 layers x 8 experts top-2, fp32, all cached",
                       "prompt_tokens": len(prompt), "new_tokens": args.tokens, "rounds": args.rounds}
    return result


API_PATHS = ("/v1/chat/completions", "/v1/responses", "/v1/messages")


def api_body(path: str, model: str, max_tokens: int) -> dict:
    """One greedy question in the shape of each chat-like API (the same messages: the same prompt)."""
    messages = [{"role": "user", "content": PROMPT}]
    if path == "/v1/responses":
        return {"model": model, "input": messages, "max_output_tokens": max_tokens, "temperature": 0, "store": False}
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def generated_tokens(path: str, body: dict) -> int:
    usage = body["usage"]
    return usage["completion_tokens"] if path == "/v1/chat/completions" else usage["output_tokens"]


def api_tpot(http, path: str, model: str, tokens: int) -> tuple[float, float]:
    """TTFT and TPOT (s) through one API, as `server_tpot`; TPOT over the tokens the answer really has
    (the Anthropic API has no ignore_eos)."""

    def complete(max_tokens: int) -> tuple[float, int]:
        start = time.perf_counter()
        response = http.post(path, json=api_body(path, model, max_tokens), timeout=600)
        response.raise_for_status()
        return time.perf_counter() - start, generated_tokens(path, response.json())

    first, _ = complete(1)
    whole, count = complete(tokens)
    return first, (whole - first) / max(1, count - 1)


def run_apis(args: argparse.Namespace) -> dict:
    """The chat-like APIs on one server, interleaved: what translating a request costs over chat's."""
    from server.testing import RemoteServer

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp), 256, 512, 8, 8, torch.float32)
        flags = ["--model", str(folder), "--device", "cpu", "--prefix-cache", "0"]
        samples: dict[str, list[tuple[float, float]]] = {path: [] for path in API_PATHS}
        with RemoteServer(flags, ready_timeout=600) as server, server.http() as http:
            model = server.openai().models.list().data[0].id
            for path in API_PATHS:
                api_tpot(http, path, model, 4)  # warm-up
            for _ in range(args.rounds):
                for path in API_PATHS:
                    samples[path].append(api_tpot(http, path, model, args.tokens))
    result = {path: median_ms(values) for path, values in samples.items()}
    chat = result["/v1/chat/completions"]
    for path in API_PATHS[1:]:
        result[path]["tpot_over_chat"] = result[path]["tpot_ms"] / chat["tpot_ms"]
        result[path]["ttft_minus_chat_ms"] = result[path]["ttft_ms"] - chat["ttft_ms"]
    result["setup"] = {"model": "Mixtral-shaped, H=256, I=512, 8 layers x 8 experts top-2, fp32, all cached",
                       "new_tokens": args.tokens, "rounds": args.rounds}
    return result


def median_ms(values: list[tuple[float, float]]) -> dict:
    return {
        "ttft_ms": 1000 * statistics.median(v[0] for v in values),
        "tpot_ms": 1000 * statistics.median(v[1] for v in values),
    }


def rss_child(folder: str, host_cache_gb: float | None) -> None:
    """Runs in a fresh process: load, generate, print peak RSS."""
    engine = Engine.load(
        EngineConfig(
            model=folder, device="cpu", policy="lru", expert_cache_experts=4, host_cache_gb=host_cache_gb
        )
    )
    list(
        engine.generate(
            GenerationRequest("rss", engine.encode(PROMPT), SamplingParams(max_tokens=8, temperature=0))
        )
    )
    host = engine.loaded.host
    print(json.dumps({
        "peak_rss_mib": _peak_rss_mib(),
        "ram_tier_experts": host.capacity, "ram_tier_mib": host.capacity * host.bytes_per_expert / 2**20,
        "all_experts_mib": len(host.sources) * host.bytes_per_expert / 2**20, "disk_reads": host.disk_reads,
    }))  # fmt: skip


def _peak_rss_mib() -> float:
    # VmHWM, not ru_maxrss: ru_maxrss survives exec and would report the parent's peak
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_rss(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp), 1024, 2816, 8, 8, torch.bfloat16)  # 64 experts x 17 MB bf16 on disk
        result = {"checkpoint_mib": sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors")) / 2**20}
        budgets = {
            "one_expert_in_ram": 1e-9,
            f"host_cache_gb={args.host_cache_gb}": args.host_cache_gb,
            "all_in_ram": None,
        }
        for label, budget in budgets.items():
            code = f"from bench.engine_bench import rss_child; rss_child({str(folder)!r}, {budget!r})"
            out = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            ).stdout
            result[label] = json.loads(out.strip().splitlines()[-1])
        base = result["one_expert_in_ram"]["peak_rss_mib"]
        for label in budgets:
            result[label]["peak_rss_above_one_expert_mib"] = result[label]["peak_rss_mib"] - base
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["tpot", "rss", "server", "apis"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--host-cache-gb", type=float, default=0.25)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    run = {"tpot": run_tpot, "rss": run_rss, "server": run_server, "apis": run_apis}[args.what]
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
