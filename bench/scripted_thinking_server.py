"""moe-serve's real app over a scripted Qwen3-thinking engine (for the Open WebUI reasoning check).

Run: python -m bench.scripted_thinking_server --port P [--delay S]
Every chat is answered with OUTPUT (what a Qwen3 thinking model writes after a prompt ending in
"<think>\n"), one Qwen token's text at a time. Each request's prompt text is logged to stderr.
"""

from __future__ import annotations

import argparse
import sys

import uvicorn

from bench.scripted_engine import ScriptedEngine
from engine.config import EngineConfig
from server.app import create_app
from server.config import ServerConfig
from tests.fixtures.tokenizers import QWEN3_THINKING_TEMPLATE

OUTPUT = ("The user asks for the capital of France. That is Paris.\n</think>\n\n"
          "The capital of France is **Paris**.")


class ScriptedThinkingEngine(ScriptedEngine):
    """Answers every chat with OUTPUT; logs each prompt's tail to stderr."""

    def __init__(self, delay: float) -> None:
        super().__init__("qwen3-thinking-scripted", "qwen3_thinking", QWEN3_THINKING_TEMPLATE, delay)

    def answer(self, prompt: str) -> str:
        print(f"[scripted] prompt tail: {prompt[-200:]!r}", file=sys.stderr, flush=True)
        return OUTPUT


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay", type=float, default=0.05, help="seconds per token (to see streaming)")
    args = ap.parse_args()
    engine = ScriptedThinkingEngine(args.delay)
    app = create_app(ServerConfig(port=args.port), EngineConfig(), load_engine=lambda: engine)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="info")


if __name__ == "__main__":
    main()
