"""moe-serve's real app over a scripted Qwen3-thinking engine (for the Open WebUI reasoning check).

Run: python -m bench.scripted_thinking_server --port P [--delay S]
Every chat is answered with OUTPUT (what a Qwen3 thinking model writes after a prompt ending in
"<think>\n"), one Qwen token's text at a time. Each request's prompt text is logged to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator

import uvicorn

from engine.api import ChatTemplateInfo, GenerationEvent, GenerationRequest, Usage
from engine.config import EngineConfig
from engine.text_stream import IncrementalDetokenizer
from server.app import create_app
from server.config import ServerConfig
from tests.fixtures.tokenizers import QWEN3_THINKING_TEMPLATE, build_tokenizer

OUTPUT = ("The user asks for the capital of France. That is Paris.\n</think>\n\n"
          "The capital of France is **Paris**.")


class ScriptedThinkingEngine:
    model_name, max_model_len, vocab_size = "qwen3-thinking-scripted", 32768, 200_000
    model_names = (model_name,)
    chat_template_info = ChatTemplateInfo(supports_tools=True, source=QWEN3_THINKING_TEMPLATE,
                                          model_type="qwen3_moe")
    sampling_defaults: dict = {}

    def __init__(self, delay: float) -> None:
        self.tokenizer = build_tokenizer("qwen3_thinking")
        self.delay = delay
        self.output = OUTPUT

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                                 add_generation_prompt=True, **(template_kwargs or {}))
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = list(ids)
        print(f"[scripted] prompt ({len(ids)} tokens, tools={len(tools or [])}) tail: "
              f"{self.decode(ids[-40:], skip_special_tokens=False)!r}", file=sys.stderr, flush=True)
        return ids

    def validate(self, request: GenerationRequest) -> None:
        pass

    def generate(self, request: GenerationRequest, should_abort: Callable[[], bool]) -> Iterator[GenerationEvent]:
        ids = self.tokenizer.encode(self.output, add_special_tokens=False)
        detok = IncrementalDetokenizer(lambda i: self.tokenizer.decode(i, skip_special_tokens=True))
        n = 0
        for tid in ids:
            if should_abort():  # as the real engine (engine/engine.py): an aborted run ends with "abort"
                yield GenerationEvent("", (), finish_reason="abort", usage=Usage(len(request.prompt_token_ids), n))
                return
            if self.delay:
                time.sleep(self.delay)
            n += 1
            yield GenerationEvent(detok.push(tid), (tid,))
        yield GenerationEvent("", (), finish_reason="stop",
                              usage=Usage(len(request.prompt_token_ids), n))

    def cache_info(self) -> dict:
        return {}

    def cache_counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


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
