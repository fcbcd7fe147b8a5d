"""The JavaScript/TypeScript client libraries web apps and tools use, against real moe-serve processes, end to end.

Install the clients (outside the repository; Node 20):
    npm install --prefix /tmp/node-clients openai zod ai @ai-sdk/openai @ai-sdk/openai-compatible \
        ollama-ai-provider-v2 @langchain/openai @langchain/ollama @langchain/core ollama
Run (from the repository root, with the project's .venv or any Python 3.10+: the driver only starts processes):
    PYTHONPATH=$PWD .venv/bin/python bench/node_clients.py [--only openai,vercel-ai,...] [--out FILE] \
        [--prefix /tmp/node-clients]

The servers, the request recorder and the result rows are bench/python_clients.py's (the demo model for plain
chat and embeddings, the scripted Qwen2.5 tool-template engine for tools and structured output). Each call is
one `node bench/node_clients.mjs LIBRARY CALL` process, so the requests recorded while it runs are its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from the repository root

from bench import python_clients as pc  # noqa: E402

SCRIPT = Path(__file__).with_suffix(".mjs")
CALL_TIMEOUT_S = 180


def config(demo: str, scripted: str) -> str:
    """The constants the JS calls share with the Python ones, so both benches ask and expect the same."""
    return json.dumps({
        "demo": demo, "scripted": scripted, "demo_model": pc.DEMO, "scripted_model": pc.SCRIPTED, "ask": pc.ASK,
        "weather_ask": pc.WEATHER_ASK, "weather_tool": pc.WEATHER_TOOL, "tool_result": pc.TOOL_RESULT,
        "person": pc.PERSON, "person_schema": pc.PERSON_SCHEMA, "n": pc.N, "texts": pc.TEXTS})


def node(args: list[str], env: dict[str, str]) -> dict:
    done = subprocess.run(["node", str(SCRIPT), *args], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=CALL_TIMEOUT_S)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"node exited {done.returncode}: {done.stderr[-600:]}")
    return json.loads(lines[-1])


def library_checks(library: str, prefix: str):
    """`python_clients.run_libraries`'s factory for one JS library: each call runs in its own node process."""

    def checks(demo: str, scripted: str) -> dict:
        env = {"NODE_CLIENTS_PREFIX": prefix, "NODE_CLIENTS_CONFIG": config(demo, scripted)}

        def check(call: str) -> str:
            row = node([library, call], env)
            if not row["passed"]:
                raise AssertionError(f"{row['error']} at {row['where']}")
            return row["detail"]

        return {call: (lambda c=call: check(c)) for call in node(["--list"], env)[library]}

    return checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", default="/tmp/node-clients", help="the npm --prefix the libraries are in")
    ap.add_argument("--only", default=None, help="libraries to run, comma-separated (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON object here")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(node(["--list"], {}))
    pc.run_libraries({name: library_checks(name, args.prefix) for name in names}, names, args.out)


if __name__ == "__main__":
    main()
