"""A stand-in engine for moe-serve's real app that writes scripted text, one real token at a time, for the
checks with real clients (Open WebUI, coding agents) that need a model to answer in a set way."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from engine.api import ChatTemplateInfo, GenerationEvent, GenerationRequest, Usage
from engine.chat_messages import prepare_messages
from engine.text_stream import IncrementalDetokenizer
from tests.fixtures.tokenizers import build_tokenizer


class ScriptedEngine:
    """Renders prompts with `template` and a real tokenizer; answers each with `answer(prompt text)`,
    token by token (`delay` seconds apart), ending as the real engine does on an abort."""

    max_model_len, vocab_size = 131_072, 200_000
    sampling_defaults: dict = {}

    def __init__(self, name: str, tokenizer: str, template: str, delay: float = 0.0) -> None:
        self.model_name = name
        self.model_names = (name,)
        self.chat_template_info = ChatTemplateInfo(supports_tools=True, source=template, model_type="qwen3_moe")
        self.template = template
        self.tokenizer = build_tokenizer(tokenizer)
        self.delay = delay

    def answer(self, prompt: str) -> str:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None, continue_final: bool = False) -> list[int]:
        messages = prepare_messages(messages, tool_template=True)  # as the real engine: text parts joined, ...
        text = self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.template,
                                                  tokenize=False, add_generation_prompt=True,
                                                  **(template_kwargs or {}))
        return self.encode(text)

    def validate(self, request: GenerationRequest) -> None:
        pass

    def generate(self, request: GenerationRequest, should_abort: Callable[[], bool]) -> Iterator[GenerationEvent]:
        prompt_tokens = len(request.prompt_token_ids)
        ids = self.encode(self.answer(self.decode(list(request.prompt_token_ids), skip_special_tokens=False)))
        skip = request.params.skip_special_tokens  # False where the server reads markers (harmony)
        detokenizer = IncrementalDetokenizer(lambda i: self.tokenizer.decode(i, skip_special_tokens=skip))
        for n, token_id in enumerate(ids):
            if should_abort():
                yield GenerationEvent("", (), finish_reason="abort", usage=Usage(prompt_tokens, n))
                return
            if self.delay:
                time.sleep(self.delay)
            yield GenerationEvent(detokenizer.push(token_id), (token_id,))
        yield GenerationEvent("", (), finish_reason="stop", usage=Usage(prompt_tokens, len(ids)))

    def cache_info(self) -> dict:
        return {}

    def cache_counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass
