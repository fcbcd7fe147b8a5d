"""Quality of quantized experts against the unquantized engine: token agreement, KL, perplexity.

    python -m bench.quant_quality [--tokens 500] [--prompts 10] [--models demo,mixtral]

For each model the unquantized engine (`--expert-dtype auto`, float32 on CPU) writes a greedy
continuation of varied prompts (`bench.prompts`), `--tokens` in all. Every quantized form then
reads the same sequences (teacher-forced, so one early flip does not change everything after it):
*agreement* is the share of positions where its greedy choice equals the reference token,
*agreement_same_pass* the share where it equals the reference's own greedy choice in the same
teacher-forced pass (prefill against prefill: what the weights change, without the gap between the
reference's prefill and its decode), *KL* the mean KL(reference || quantized) of the next-token
distributions there. *flip_margin_*: by how many nats the reference preferred its own token
where the form chose another (near 0: a near-tie that any rounding can flip). On the demo model
also the perplexity of `bench/data/public_domain.txt` (the Gettysburg Address, the start of the
Declaration of Independence and the Preamble of the US Constitution). Prints one JSON object.

Two controls: `reference_teacher_forced` (the reference against its own greedy tokens: 1.0 unless
its prefill and decode disagree) and the form `bf16-compute` (no quantization, the model computed
in bf16): what rounding the activations alone does, a floor for how sensitive the model is. The
CPU kernels take bf16 activations, so the int8 per-channel and int4 kernel forms include it.

`--compute-dtype bfloat16` runs the reference and every form in bf16 (as CUDA runs the engine), so
the forms differ from the reference by the quantized expert weights alone: "agreement with bf16".
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.engine_bench import build_model
from bench.prompts import prompts
from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine

TEXT = Path(__file__).parent / "data" / "public_domain.txt"
BF16_CONTROL = "bf16-compute"  # a form: no quantization, the whole model computed in bf16 (`--dtype bfloat16`)
FORMS = {  # model → (expert dtype, group size) compared with the unquantized reference
    "demo": [("int8", 0), ("int8", 64), ("int4", 32), ("int4", 64), ("bf16-compute", 0)],  # H 576: 128 → 64
    "mixtral": [("int8", 0), ("int8", 128), ("int4", 64), ("int4", 128), ("bf16-compute", 0)],
}


def _engine(folder: Path | None, expert_dtype: str = "auto", group: int | None = None, dtype: str = "auto") -> Engine:
    return Engine.load(EngineConfig(model=str(folder) if folder else None, device="cpu", policy="lru", dtype=dtype,
                                    prefetch=False, expert_dtype=expert_dtype, expert_group_size=group,
                                    prefix_cache=0))  # every form computes every prompt whole


def _sequences(engine: Engine, n_prompts: int, tokens: int) -> list[tuple[int, list[int]]]:
    """(prompt length, prompt + greedy continuation) per prompt, `tokens` continuation tokens in all."""
    out, each = [], tokens // n_prompts
    for _, text in prompts(n_prompts, seed=1):
        ids = engine.apply_chat_template([{"role": "user", "content": text}])
        params = SamplingParams(max_tokens=each, temperature=0, ignore_eos=True)
        generated = [t for e in engine.generate(GenerationRequest("q", ids, params)) for t in e.token_ids]
        out.append((len(ids), ids + generated))
    return out


def _log_probs(engine: Engine, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return F.log_softmax(engine.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float(), -1)


def _compare(engine: Engine | None, sequences, reference: list[torch.Tensor]) -> dict:
    """Against the reference's greedy tokens; `engine` None: the reference itself, teacher-forced
    (1.0 unless its prefill and its decode disagree)."""
    agree, agree_prefill, kl, count = 0, 0, 0.0, 0
    flip_margins, margins = [], []
    for (start, ids), ref in zip(sequences, reference):
        ours = (ref if engine is None else _log_probs(engine, ids))[start - 1 : -1]  # [T, V] predictions of the continuation
        ref_positions = ref[start - 1 : -1]
        agree += int((ours.argmax(-1) == torch.tensor(ids[start:])).sum())
        same = ours.argmax(-1) == ref_positions.argmax(-1)  # [T]
        agree_prefill += int(same.sum())
        top2 = ref_positions.topk(2, dim=-1).values  # [T, 2]
        margin = top2[:, 0] - top2[:, 1]  # [T] nats by which the reference prefers its token
        margins += margin.tolist()
        flip_margins += margin[~same].tolist()
        kl += float((ref_positions.exp() * (ref_positions - ours)).sum())
        count += len(ids) - start
    return {"agreement": agree / count, "agreement_same_pass": agree_prefill / count, "mean_kl": kl / count,
            "positions": count, **_flip_summary(flip_margins, margins)}


def _flip_summary(flip_margins: list[float], margins: list[float]) -> dict:
    """How close to a tie the flipped positions were: the reference's top-1 minus top-2 log-prob there,
    and how many positions of the whole set are at least that close (a flip there is a coin toss)."""
    if not flip_margins:
        return {"flip_margin_max": None, "positions_within_flip_margin_max": 0}
    worst = max(flip_margins)
    return {"flip_margin_median": round(sorted(flip_margins)[len(flip_margins) // 2], 4),
            "flip_margin_max": round(worst, 4),
            "positions_within_flip_margin_max": sum(m <= worst for m in margins)}


def _perplexity(engine: Engine) -> float:
    ids = engine.encode(TEXT.read_text())
    logp = _log_probs(engine, ids)
    nll = -logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean()
    return math.exp(float(nll))


def measure(name: str, folder: Path | None, forms: list[tuple[str, int]], args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    reference = _engine(folder, dtype=args.compute_dtype)
    sequences = _sequences(reference, args.prompts, args.tokens)
    ref_logp = [_log_probs(reference, ids) for _, ids in sequences]
    result = {"bytes_per_expert": {"reference": reference.loaded.host.bytes_per_expert}, "forms": {},
              "compute_dtype": args.compute_dtype}
    result["reference_teacher_forced"] = _compare(None, sequences, ref_logp)
    if name == "demo":
        result["perplexity"] = {"reference": _perplexity(reference)}
    result["seconds"] = {"reference": round(time.perf_counter() - start)}
    _close(reference)
    del reference  # its float experts: GBs the quantized engines need
    for expert_dtype, group in forms:
        start = time.perf_counter()
        if expert_dtype == BF16_CONTROL:  # unquantized, all in bf16: what bf16 activations alone change
            engine, label = _engine(folder, dtype="bfloat16"), BF16_CONTROL
        else:
            engine = _engine(folder, expert_dtype, group, dtype=args.compute_dtype)
            label = f"{expert_dtype}-g{group or 'channel'}"
        loaded = time.perf_counter()
        row = _compare(engine, sequences, ref_logp)
        row["bytes_per_expert"] = engine.loaded.host.bytes_per_expert
        row["group_sizes"] = engine.cache_info()["expert_group_sizes"]
        if name == "demo":
            row["perplexity"] = _perplexity(engine)
        row["seconds"] = {"load_and_quantize": round(loaded - start), "measure": round(time.perf_counter() - loaded)}
        result["forms"][label] = row
        _close(engine)
        del engine
    return result


def _close(engine: Engine) -> None:
    engine.close()
    gc.collect()


def _forms(text: str) -> list[tuple[str, int]]:
    return [(dtype, int(group)) for dtype, group in (form.split(":") for form in text.split(","))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--models", default="demo,mixtral")
    parser.add_argument("--forms", default=None,
                        help=f"e.g. int8:0,int4:64,{BF16_CONTROL}:0 (0: per channel); default: FORMS")
    parser.add_argument("--compute-dtype", default="auto", choices=["auto", "bfloat16"],
                        help="the reference's and the forms' compute dtype (auto: float32 on CPU)")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MOE_SERVE_STATE_DIR"] = str(Path(tmp) / "state")  # quantized files: not the user's
        for name in args.models.split(","):
            folder = None if name == "demo" else build_model(Path(tmp) / name, 256, 512, 8, 8, torch.bfloat16)
            results[name] = measure(name, folder, _forms(args.forms) if args.forms else FORMS[name], args)
            print(json.dumps({name: results[name]}), flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
