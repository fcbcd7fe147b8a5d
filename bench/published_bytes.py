"""Bytes per expert of published-quantized models in each expert form, and the cost of decoding per use.

    python -m bench.published_bytes [--time] [--repeats 3]

Sizes come from the layouts the engine plans (`plan_published_layout` for the published bytes,
`plan_layout` for int8/int4, the float forms by element count); no weights are built for them. With
`--time`, one token through one expert (gate+up, then down) is timed on the CPU for the published form
(decoded into a float32 scratch weight per product, as the engine computes it) and for float32 weights.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from cache.quant import DEFAULT_GROUP_SIZE, ParamSpec, plan_layout, unpack_expert
from cache.quant_published import PublishedFormat, plan_published_layout

# (name, expert params as the model holds them, the published format, which params the checkpoint quantizes)
MODELS = {
    "deepseek-v3": ([ParamSpec("gate_up_proj", (4096, 7168)), ParamSpec("down_proj", (7168, 2048))],
                    PublishedFormat("fp8", (128, 128)), {"gate_up_proj": 2, "down_proj": 1}),
    "gpt-oss-120b": ([ParamSpec("gate_up_proj", (2880, 5760), True), ParamSpec("gate_up_proj_bias", (5760,)),
                      ParamSpec("down_proj", (2880, 2880), True), ParamSpec("down_proj_bias", (2880,))],
                     PublishedFormat("mxfp4", (1, 32)), {"gate_up_proj": 1, "down_proj": 1}),
}
def bytes_per_expert(specs, fmt: PublishedFormat, quantized: dict[str, int], device_type: str) -> dict[str, int]:
    elements = sum(torch.Size(p.shape).numel() for p in specs)
    sizes = {"bf16": 2 * elements, "published": plan_published_layout(specs, fmt, quantized, torch.bfloat16).nbytes}
    for dtype in ("int8", "int4"):
        sizes[dtype] = plan_layout(specs, dtype, DEFAULT_GROUP_SIZE[dtype], torch.bfloat16, device_type).nbytes
    return sizes


def _random_expert(specs, fmt: PublishedFormat, quantized: dict[str, int]):
    """A buffer of the published layout filled with valid random bytes (scales near 2^-8)."""
    layout = plan_published_layout(specs, fmt, quantized, torch.float32)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for t in layout.tensors:
        if t.packing == "raw":
            continue
        data = torch.randn(t.shape).to(torch.float8_e4m3fn).view(torch.uint8) if t.packing == "fp8" \
            else torch.randint(0, 256, (t.shape[0], t.shape[1] // 2), dtype=torch.uint8)
        buffer[t.offset : t.offset + t.nbytes] = data.reshape(-1)
        scale = torch.full((t.scale_nbytes // 4,), 2.0**-8) if t.packing == "fp8" else torch.full((t.scale_nbytes,), 119, dtype=torch.uint8)
        buffer[t.scale_offset : t.scale_offset + t.scale_nbytes] = scale.view(torch.uint8)
    return layout, buffer


def time_one_token(specs, fmt, quantized, repeats: int) -> dict[str, float]:
    layout, buffer = _random_expert(specs, fmt, quantized)
    views = unpack_expert(layout, buffer)
    gate_up, down = views["gate_up_proj"], views["down_proj"]
    floats = {name: v.dequantize(torch.float32) for name, v in (("gate_up", gate_up), ("down", down))}
    x = torch.randn(1, down.shape[0])  # [1, H]
    inner = down.shape[1]

    def published():
        return down.linear(gate_up.linear(x)[:, :inner])

    def float32():
        return F.linear(F.linear(x, floats["gate_up"])[:, :inner], floats["down"])

    return {"published_decode_ms": _median_ms(published, repeats), "float32_ms": _median_ms(float32, repeats)}


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time", action="store_true", help="also time one token through one expert on the CPU")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    report = {}
    for name, (specs, fmt, quantized) in MODELS.items():
        report[name] = {"format": fmt.method, **{f"{device}_bytes": bytes_per_expert(specs, fmt, quantized, device)
                                                  for device in ("cpu", "cuda")}}
        if args.time:
            report[name]["cpu_one_token"] = time_one_token(specs, fmt, quantized, args.repeats)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
