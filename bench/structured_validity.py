"""`response_format: json_schema` (strict) over many varied schemas, through a real server:
`python -m bench.structured_validity [--schemas 50] [--model FOLDER] [--open]`.

Starts `moe-serve` (by default on a tiny random Qwen3-MoE with the real Qwen vocabulary, whose
output follows no instruction: only the grammar makes it JSON), sends one non-streamed request per
schema (temperature 1, a seed per request), validates every answer with `jsonschema`, then sends
the same request without a schema (`ignore_eos`, as many tokens as the constrained answer had) to
compare time per output token. Prints one JSON object: valid count, failures, and the medians.

`--open` sends each schema as pydantic writes one, without `"additionalProperties": false` and not
strict, and also counts the answers that keep to the keys the schema lists (valid against the closed
schema too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import jsonschema

from server.testing import RemoteServer
from tests.fixtures.models import build_checkpoint
from tests.fixtures.schemas import opened, varied_schemas

ASK = [{"role": "user", "content": "Fill in the form, please."}]


def post(http: httpx.Client, body: dict) -> tuple[dict, float]:
    start = time.perf_counter()
    response = http.post("/v1/chat/completions", json={"messages": ASK, **body}, timeout=600)
    response.raise_for_status()
    return response.json(), time.perf_counter() - start


def check(http: httpx.Client, name: str, schema: dict, seed: int, max_tokens: int, open_: bool) -> dict:
    """One schema: the constrained answer validated, and a free answer of as many tokens timed."""
    sent = {"name": name, "schema": opened(schema)} if open_ else {"name": name, "schema": schema, "strict": True}
    response_format = {"type": "json_schema", "json_schema": sent}
    answer, seconds = post(http, {"response_format": response_format, "temperature": 1.0, "seed": seed,
                                  "max_tokens": max_tokens})
    tokens = answer["usage"]["completion_tokens"]
    result = {"schema": name, "tokens": tokens, "finish_reason": answer["choices"][0]["finish_reason"],
              "ms_per_token": 1000 * seconds / tokens, "error": None}
    text = answer["choices"][0]["message"]["content"]
    try:
        jsonschema.validate(json.loads(text), sent["schema"])
    except (ValueError, jsonschema.ValidationError) as e:
        result["error"] = f"{type(e).__name__}: {str(e)[:200]} in {text[:200]!r}"
    result["listed_keys_only"] = result["error"] is None and jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
    free, free_seconds = post(http, {"temperature": 1.0, "seed": seed, "max_tokens": tokens, "ignore_eos": True})
    result["free_ms_per_token"] = 1000 * free_seconds / free["usage"]["completion_tokens"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=50)
    parser.add_argument("--model", help="a model folder; default: a tiny random Qwen3-MoE built now")
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--open", action="store_true", help="schemas as pydantic writes them: objects not closed")
    args = parser.parse_args()
    model = args.model or str(build_checkpoint("qwen3_moe", Path(tempfile.mkdtemp()) / "m", num_layers=2))
    with RemoteServer(["--model", model, "--device", "cpu"], env={"OMP_NUM_THREADS": "1"}) as srv, srv.http() as http:
        post(http, {"max_tokens": 2})  # the first constrained request also builds the grammar's tokenizer view
        results = [check(http, name, schema, seed, args.max_tokens, args.open)
                   for seed, (name, schema) in enumerate(varied_schemas(args.schemas))]
    failures = [r for r in results if r["error"]]
    print(json.dumps({
        "model": args.model or "tiny random qwen3_moe (Qwen vocabulary)", "schemas": len(results),
        "open": args.open, "valid": len(results) - len(failures), "failures": failures,
        "listed_keys_only": sum(r["listed_keys_only"] for r in results),
        "finish_reasons": sorted({r["finish_reason"] for r in results}),
        "tokens_median": statistics.median(r["tokens"] for r in results),
        "tokens_max": max(r["tokens"] for r in results),
        "constrained_ms_per_token_median": round(statistics.median(r["ms_per_token"] for r in results), 2),
        "free_ms_per_token_median": round(statistics.median(r["free_ms_per_token"] for r in results), 2),
        "overhead_ms_per_token_median": round(statistics.median(r["ms_per_token"] - r["free_ms_per_token"]
                                                                for r in results), 2),
    }, indent=2))


if __name__ == "__main__":
    main()
