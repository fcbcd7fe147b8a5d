"""The CUDA checks, as one script for a lent GPU machine (no GPU is needed anywhere else).

    python -m bench.cuda_check [--out FILE]

1. pinned host memory: every host-store buffer is pinned;
2. copies on a side stream: a slot load returns before its copy finishes and compute
   waits on the copy's event, not on the whole device;
3. equivalence on `cuda`: greedy tokens of the offloaded engine equal transformers' on
   the same device for every family, with a one-slot cache, a full one, and a small one
   whose prefetches read a bounded RAM tier from disk on the background thread;
4. quantized experts on `cuda` (`--expert-dtype int8|int4|int4-mixed`, tinygemm int4, int8 dequantized per
   use): the engine's logits against transformers holding the same dequantized weights, within the bound
   of `tests/test_engine_quant.py`, and the same greedy choice at every position;
5. the host executor (`--cpu-experts`): misses computed whole on the host and shared by host and device,
   greedy tokens against transformers;
6. prefix reuse (`--prefix-cache`): a chat's next turn, cut from the kept KV cache on the device, and a
   shared head copied from it, give transformers' greedy tokens;
   and with a context too small for a chat's entry beside a background request, the entry moves to
   pinned host memory (`--prefix-cache-host-gb`) and its next turn, copied back, gives them too;
7. embeddings on `cuda`: one input and a right-padded batch of inputs of different lengths (`more_inputs`),
   mean-pooled, against transformers' base model on the same device, with a small cache, per family;
8. TPOT: `bench.engine_bench tpot --device cuda`.
Prints one JSON object (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bench.engine_bench import run_tpot
from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from tests.fixtures.models import FAMILIES, MORE_FAMILIES, build_checkpoint, load_reference

PROMPT = "The quick brown fox jumps over the lazy dog, then"
CACHE_VARIANTS = {  # the device cache paths: one slot, all resident, and prefetch in the background
    "1-slot-lru": {"policy": "lru", "expert_cache_experts": 1},
    "all-resident": {"policy": "lru", "expert_cache_experts": 1000},
    # a RAM tier of one expert: prefetches read disk on their thread and copy on the prefetch stream
    "3-slots-sparsity-aware-disk": {"policy": "sparsity-aware", "expert_cache_experts": 3, "host_cache_gb": 1e-6},
}


def check_pinned_and_streams(folder: Path) -> dict:
    engine = Engine.load(EngineConfig(model=str(folder), device="cuda", policy="lru", expert_cache_experts=2))
    host = engine.loaded.host
    pinned = all(buf.is_pinned() for buf in host._resident.values())
    backend = engine.runtime.cache.backend
    start = time.perf_counter()
    backend.load((0, 0), 0)
    issued = time.perf_counter() - start
    event = backend._loaded[0]
    current = torch.cuda.current_stream()
    side_streams = current not in (backend._demand_stream, backend._prefetch_stream)
    event.synchronize()
    return {"host_buffers_pinned": pinned, "copies_on_side_streams": side_streams, "load_issue_ms": 1000 * issued}


def check_default_sizing(folder: Path) -> dict:
    """No cache size given: the cache takes the free memory less the dense weights (loaded after it),
    the headroom and a context's KV cache; the model must then load and generate."""
    engine = Engine.load(EngineConfig(model=str(folder), device="cuda", policy="lru"))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    tokens = [t for e in engine.generate(GenerationRequest("s", engine.encode(PROMPT), params)) for t in e.token_ids]
    result = {"capacity": engine.runtime.cache.capacity, "experts": len(engine.loaded.host.sources),
              "generated": len(tokens), "max_model_len": engine.max_model_len,
              "free_gib_after": torch.cuda.mem_get_info()[0] / 2**30}
    engine.close()
    return result


def check_prefix_reuse(tmp: Path) -> dict:
    results = {}
    for family in ("mixtral", "deepseek_v2", "qwen3_moe", "gpt_oss"):  # GPT-OSS: a sliding window, reused whole
        folder = build_checkpoint(family, tmp / f"prefix-{family}")
        reference = load_reference(folder).to("cuda")
        engine = Engine.load(EngineConfig(model=str(folder), device="cuda", dtype="float32", policy="lru",
                                          expert_cache_experts=2))
        first = list(range(5, 45))
        answer, _ = _greedy_and_cached(engine, first)
        for name, prompt in {"next_turn": first + answer + list(range(50, 70)),  # the entry cut back
                             "shared_head": first[:20] + list(range(200, 260))}.items():  # a copy of its head
            ours, cached = _greedy_and_cached(engine, prompt)
            with torch.no_grad():
                x = torch.tensor([prompt], device="cuda")
                out = reference.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12,
                                         eos_token_id=None, pad_token_id=0)  # fmt: skip
            results[f"{family}/{name}"] = {"same_tokens": ours == out[0, len(prompt):].tolist(), "cached": cached}
        engine.close()
    return results


def check_prefix_host_tier(tmp: Path) -> dict:
    results = {}
    for family in ("mixtral", "qwen3_moe"):
        folder = build_checkpoint(family, tmp / f"host-tier-{family}")
        reference = load_reference(folder).to("cuda")
        engine = Engine.load(EngineConfig(model=str(folder), device="cuda", dtype="float32", policy="lru",
                                          expert_cache_experts=2, max_model_len=128))
        first = list(range(5, 45))
        answer, _ = _greedy_and_cached(engine, first)
        _greedy_and_cached(engine, list(range(300, 390)))  # 90 + 12 tokens: the chat's 51 no longer fit beside
        hosted = [e for e in engine.prefix_cache._entries if e.on_host]
        pinned = bool(hosted) and all(layer.keys.is_pinned() and layer.values.is_pinned()
                                      for e in hosted for layer in e.kv.layers)
        prompt = first + answer + list(range(50, 70))
        ours, cached = _greedy_and_cached(engine, prompt)
        with torch.no_grad():
            x = torch.tensor([prompt], device="cuda")
            out = reference.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12,
                                     eos_token_id=None, pad_token_id=0)  # fmt: skip
        results[family] = {"same_tokens": ours == out[0, len(prompt):].tolist(), "cached": cached,
                           "host_entries_pinned": pinned}
        engine.close()
    return results


def _greedy_and_cached(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    events = list(engine.generate(GenerationRequest("p", prompt, params)))
    return [t for e in events for t in e.token_ids], events[-1].usage.cached_tokens


def check_equivalence(tmp: Path, results: dict, checked: Callable[[], None]) -> dict:
    """Fills `results` family by family and calls `checked` after each, so that a run cut short by its
    time limit keeps what it checked."""
    for family in FAMILIES + MORE_FAMILIES:  # on CUDA small experts take the stacked decode path
        folder = build_checkpoint(family, tmp / family)
        reference = load_reference(folder).to("cuda")
        for name, variant in CACHE_VARIANTS.items():
            engine = Engine.load(EngineConfig(model=str(folder), device="cuda", dtype="float32", **variant))
            ids = engine.encode(PROMPT)
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            ours = [t for e in engine.generate(GenerationRequest("c", ids, params)) for t in e.token_ids]
            counters = engine.cache_counters()
            engine.close()
            with torch.no_grad():
                x = torch.tensor([ids], device="cuda")
                out = reference.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12,
                                         eos_token_id=None, pad_token_id=0)  # fmt: skip
            results[f"{family}/{name}"] = {"same_tokens": ours == out[0, len(ids) :].tolist(),
                                           "prefetches": counters["prefetches"]}  # fmt: skip
        checked()
    return results


def check_embeddings(tmp: Path) -> dict:
    results = {}
    texts = [PROMPT, "Hello.", PROMPT[:30]]
    for family in FAMILIES:
        folder = build_checkpoint(family, tmp / f"embed-{family}")
        reference = load_reference(folder).to("cuda")
        engine = Engine.load(EngineConfig(model=str(folder), device="cuda", dtype="float32", expert_cache_experts=4))
        inputs = [engine.encode(text) for text in texts]
        (alone,) = engine.generate(GenerationRequest("e", inputs[0], pooling="mean"))
        (batch,) = engine.generate(GenerationRequest("b", inputs[0], pooling="mean", more_inputs=tuple(inputs[1:])))
        engine.close()
        differences = []
        with torch.no_grad():
            for ids, vector in zip([inputs[0], *inputs], [alone.embeddings[0], *batch.embeddings], strict=True):
                states = reference.base_model(input_ids=torch.tensor([ids], device="cuda")).last_hidden_state[0]
                differences.append((torch.tensor(vector, device="cuda") - states.float().mean(0)).abs().max().item())
        results[family] = {"max_abs_difference": max(differences), "within_1e-4": max(differences) <= 1e-4}
    return results


def check_host_executor(tmp: Path) -> dict:
    """`--cpu-experts`: misses computed on the host, whole (one per lane) and shared by host and device
    (equal costs given, so a lone miss is shared half and half), against transformers' greedy tokens."""
    from cache.miss_planner import MissCosts, MissPlanner

    results = {}
    for family in ("mixtral", "qwen3_moe"):
        folder = build_checkpoint(family, tmp / f"host-{family}")
        reference = load_reference(folder).to("cuda")
        for share in (False, True):
            engine = Engine.load(EngineConfig(model=str(folder), device="cuda", dtype="float32", policy="lru",
                                              expert_cache_experts=2, prefetch=False))  # fmt: skip
            engine.runtime.planner = MissPlanner(MissCosts(copy_ms=1.0, host_ms=1.0), share=share)
            ids = engine.encode(PROMPT)
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            ours = [t for e in engine.generate(GenerationRequest("h", ids, params)) for t in e.token_ids]
            computed = engine.cache_counters()["cpu_computed"]
            engine.close()
            with torch.no_grad():
                x = torch.tensor([ids], device="cuda")
                out = reference.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12,
                                         eos_token_id=None, pad_token_id=0)  # fmt: skip
            results[f"{family}/{'shared' if share else 'whole'}"] = {
                "same_tokens": ours == out[0, len(ids) :].tolist(), "cpu_computed": computed,
            }
    return results


def check_quantized(tmp: Path) -> dict:
    from tests.test_engine_quant import BF16_ACTIVATIONS, _fake_quantized_reference

    results = {}
    for family in ("mixtral", "gpt_oss"):  # [out, in] experts; GPT-OSS's transposed ones with biases
        folder = build_checkpoint(family, tmp / f"quant-{family}")
        for expert_dtype in ("int8", "int4", "int4-mixed"):
            engine = Engine.load(EngineConfig(model=str(folder), device="cuda", dtype="float32", policy="lru",
                                              expert_cache_experts=2, expert_dtype=expert_dtype))  # fmt: skip
            reference = _fake_quantized_reference(folder, engine.loaded.quant).to("cuda")
            ids = torch.tensor([engine.encode(PROMPT)], device="cuda")
            with torch.no_grad():
                ours, want = engine.model(input_ids=ids).logits, reference(input_ids=ids).logits
                # decode too: small int8 and plain int4 experts take the batched path there (`dequantize_slots`)
                decoded = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                             max_new_tokens=12, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:]
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            tokens = [t for e in engine.generate(GenerationRequest("q", ids[0].tolist(), params)) for t in e.token_ids]
            results[f"{family}/{expert_dtype}"] = {
                "packings": sorted({t.packing for t in engine.loaded.quant.tensors}),
                "batched_decode": engine.loaded.offloaded[0].stack,
                "max_error_over_scale": float((ours - want).abs().max() / want.abs().max()),
                "bound": BF16_ACTIVATIONS,
                "same_greedy_choices": bool(torch.equal(ours.argmax(-1), want.argmax(-1))),
                "decode_tokens_as_reference": sum(a == b for a, b in zip(tokens, decoded.tolist(), strict=True)),
            }
            engine.close()
    return results


def sections(tmp: Path, report: dict, out: str | None) -> dict[str, Callable[[], dict]]:
    """Each check by name, in the order they run."""
    return {
        "streams": lambda: check_pinned_and_streams(_mixtral(tmp / "streams")),
        "default_sizing": lambda: check_default_sizing(_mixtral(tmp / "streams")),
        "quantized": lambda: check_quantized(tmp),
        "host_executor": lambda: check_host_executor(tmp),
        "prefix_reuse": lambda: check_prefix_reuse(tmp),
        "prefix_host_tier": lambda: check_prefix_host_tier(tmp),
        "tpot": lambda: run_tpot(argparse.Namespace(device="cuda", tokens=64, rounds=3)),
        "embeddings": lambda: check_embeddings(tmp),
        # last and the longest (76 families): what a time limit cuts is the tail of the family list
        "equivalence": lambda: check_equivalence(tmp, report.setdefault("equivalence", {}), lambda: _write(report, out)),
    }


SECTIONS = tuple(sections(Path(), {}, None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"a comma list of the checks to run (they run in this order): {','.join(SECTIONS)}")
    args = parser.parse_args()
    wanted = args.sections.split(",")
    if unknown := set(wanted) - set(SECTIONS):
        parser.error(f"--sections: unknown {', '.join(sorted(unknown))}")
    assert torch.cuda.is_available(), "no CUDA device"
    report: dict = {"device": torch.cuda.get_device_name()}
    with tempfile.TemporaryDirectory() as tmp:
        # each result kept as it comes: a timeout loses only the rest
        for name, run in sections(Path(tmp), report, args.out).items():
            if name not in wanted:
                continue
            try:
                report[name] = run()
            except Exception as e:
                traceback.print_exc()
                report[name] = {"error": f"{type(e).__name__}: {e}"}
            _write(report, args.out)
    print(json.dumps(report, indent=2))
    if any(isinstance(v, dict) and "error" in v for v in report.values()):
        sys.exit(1)


def _mixtral(folder: Path) -> Path:
    """The Mixtral test checkpoint, built once for the sections that share it."""
    return folder if (folder / "config.json").exists() else build_checkpoint("mixtral", folder)


def _write(report: dict, out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
