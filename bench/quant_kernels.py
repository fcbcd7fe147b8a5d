"""Which quantized matmul to use per device: one token through one expert product, each form timed.

    python -m bench.quant_kernels [--hidden 4096] [--intermediate 14336] [--tokens 1] [--repeats 5]
        [--dtype float32] [--device cpu]

The product is a Mixtral-size gate+up `[2I, H]` and down `[H, I]`; every form goes through
`cache.quant` exactly as the engine calls it (`QuantizedWeight.linear`), so the packing the
module picks for the device is what is timed, beside the forced dequantize path and the float
`F.linear`. Prints one JSON object: ms per product (median of `--repeats`) and bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from cache.quant import PER_CHANNEL, ParamSpec, pack_expert, plan_layout, unpack_expert

FORMS = (("int8", PER_CHANNEL), ("int8", 128), ("int4", 32), ("int4", 64), ("int4", 128))


def _time_ms(fn, repeats: int, sync) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def measure(args: argparse.Namespace) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    h, i = args.hidden, args.intermediate
    torch.manual_seed(0)
    weights = {"gate_up_proj": torch.randn(2 * i, h) * 0.02, "down_proj": torch.randn(h, i) * 0.02}
    specs = [ParamSpec(name, tuple(w.shape)) for name, w in weights.items()]
    x = {"gate_up_proj": torch.randn(args.tokens, h, dtype=dtype, device=device),
         "down_proj": torch.randn(args.tokens, i, dtype=dtype, device=device)}
    rows = []
    for name, w in weights.items():
        dense = w.to(device=device, dtype=dtype)
        rows.append({"product": name, "form": f"{args.dtype} F.linear", "bytes": dense.numel() * dense.element_size(),
                     "ms": _time_ms(lambda name=name, dense=dense: F.linear(x[name], dense), args.repeats, sync)})
    for expert_dtype, group in FORMS:
        layout = plan_layout(specs, expert_dtype, group, dtype, device.type)
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        pack_expert(layout, weights, buffer)
        views = unpack_expert(layout, buffer.to(device))
        for name in weights:
            weight, t = views[name], layout[name]
            label = f"{expert_dtype} g{group or 'channel'}"
            forms = {f"{t.packing} (the pick)": weight.linear}
            if t.packing in ("int8", "int8-cpu", "int4-plain"):  # the same bytes, forced through the dequantize path
                forms["dequantize + F.linear"] = weight.linear_dequantized
            for form, fn in forms.items():
                rows.append({"product": name, "form": f"{label} {form}", "bytes": t.nbytes + t.scale_nbytes,
                             "ms": _time_ms(lambda fn=fn, name=name: fn(x[name]), args.repeats, sync)})
    return {"device": str(device), "dtype": args.dtype, "hidden": h, "intermediate": i, "tokens": args.tokens,
            "threads": torch.get_num_threads(), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cpu")
    print(json.dumps(measure(parser.parse_args()), indent=1))


if __name__ == "__main__":
    main()
