"""The engine: one loaded model, its tokenizer and expert cache, and the generation loop.

Runs one request at a time (the worker in engine/client.py serialises them). Our own
prefill + decode loop over a KV cache; no `model.generate` on the hot path.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, Cache, GenerationConfig

from cache.eamc import EAMC
from cache.eamc_file import EAMCAutosaver, ModelFingerprint, load_eamc
from cache.miss_planner import MissCosts, MissPlanner
from cache.prefetcher import PREFETCH_LIMIT_PER_TOP_K, HostReadCost, PrefetchCost, Prefetcher
from cache.quant import DEFAULT_GROUP_SIZE, QUANT_DTYPES, QuantLayout
from cache.trace import TraceWriter
from engine import prompt_logprobs as scoring
from engine.api import (
    POOLINGS,
    TEMPLATE_TIMEOUT_CODE,
    ContextLengthError,
    DeviceMemoryError,
    EchoedPrompt,
    GenerationEvent,
    GenerationRequest,
    InvalidRequestError,
    Pooling,
    SamplingParams,
    TokenLogprob,
    Usage,
)
from engine.chat_messages import fold_late_system_messages, prepare_messages, template_info
from engine.chat_template import ChatTemplate, processor_chat_template, read_chat_template
from engine.checkpoint import checkpoint_digest, published_format, read_config_dict, resolve_model_path
from engine.config import EngineConfig
from engine.constraint import GrammarConstraint, GrammarTokenizer, check_grammar
from engine.demo_model import DEMO_MODEL_NAME, ensure_demo_model
from engine.fim import ExtraFiles, detect_fim, fim_prompt_ids
from engine.gguf_checkpoint import gguf_expert_dtype
from engine.gguf_experts import experts_stored_once
from engine.host_memory import available_ram_bytes
from engine.kv_budget import DEFAULT_KV_SHARE, GIB, model_max_len, warn_if_context_may_not_fit
from engine.model_loader import CacheSizing, OffloadedModel, QuantRequest, load_offloaded_model
from engine.moe_layers import router_top_k
from engine.paths import default_eamc_path, default_quant_path
from engine.prefix_cache import HostTier, PrefixCache, reusable
from engine.sampling import Sampler, token_logprob
from engine.text_stream import IncrementalDetokenizer, StopStringMatcher
from engine.time_limit import TimeLimitExceeded, call_with_time_limit

log = logging.getLogger(__name__)

EAMC_SAVE_INTERVAL_S = 60.0
CHAT_TEMPLATE_TIME_LIMIT_S = 10.0  # real templates render in milliseconds; a looping one is stopped
# what transformers' apply_chat_template takes itself, or the server sets: not a template variable
RESERVED_TEMPLATE_KWARGS = frozenset({
    "self", "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
WARM_UP_TOKENS = 4
DETOKENIZER_CONTEXT_TOKENS = 4  # prompt tokens a completion's text is decoded after (one word's worth)
PREFIX_HOST_DEFAULT_BYTES = 2**30  # kept KV caches in host RAM by default: a long chat's few turns


@dataclass
class StepTimes:
    """Wall-clock marks of the last request, for benchmarks."""

    start: float = 0.0
    first_token: float = 0.0
    end: float = 0.0
    tokens: int = 0


class Engine:
    def __init__(self, loaded: OffloadedModel, tokenizer, config: EngineConfig, device: torch.device) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.runtime = loaded.runtime
        self.tokenizer = tokenizer
        self.config = config
        self.device = device
        self.model_names = config.served_names or (config.model or DEMO_MODEL_NAME,)  # any may be sent
        self.model_name = self.model_names[0]  # the one responses carry
        self.vocab_size = loaded.model.get_output_embeddings().weight.shape[0]
        self.hidden_size = loaded.model.get_input_embeddings().weight.shape[1]  # an embedding's length
        self.max_model_len = config.max_model_len or loaded.max_context or model_max_len(loaded.config)
        # with the running request, at most one context's KV cache: what the device sizing set aside
        self.prefix_cache = (PrefixCache(config.prefix_cache, self.max_model_len, _prefix_host_tier(config, device))
                             if config.prefix_cache else None)
        self.prompt_tokens = self.prompt_tokens_cached = 0  # over all requests: the prompts, and what was reused
        self.eos_ids = _eos_ids(loaded.folder, tokenizer)
        self.chat_template_info = template_info(getattr(tokenizer, "chat_template", None),
                                                loaded.config.model_type)
        self._fim = detect_fim(tokenizer)
        self.fim_format: str | None = self._fim.name if self._fim else None  # "qwen", "deepseek", ...
        self.fim_stop_ids: tuple[int, ...] = self._fim.stop_ids if self._fim else ()  # each ends a middle
        defaults = generation_defaults(loaded.folder)
        self.max_new_tokens: int | None = defaults.pop("max_tokens", None)  # when a request sets no max_tokens
        self.sampling_defaults = defaults  # what a request that omits one of these gets
        self.last_times = StepTimes()
        self._grammar_tokenizer = GrammarTokenizer(tokenizer, self.vocab_size, self.eos_ids)
        self._tokenizer_lock = threading.Lock()  # a fast tokenizer fails when two threads use it at once
        # prompts are encoded on the server's threads with their own copy, so that tokenizing a long
        # prompt never holds up the decoding of the request that is running
        self._encoder, self._encoder_lock = copy.deepcopy(tokenizer), threading.Lock()
        self._anchor = tokenizer("a", add_special_tokens=False)["input_ids"]
        self._anchor_text = tokenizer.decode(self._anchor)
        self._eamc_saver: EAMCAutosaver | None = None
        self._eamc_saved_at = time.monotonic()
        self.miss_costs: MissCosts | None = None  # measured on CUDA with --cpu-experts auto

    @classmethod
    def load(cls, config: EngineConfig) -> Engine:
        # before the model: a bad --chat-template ends the start at once, not after minutes of loading
        chat_template = read_chat_template(config.chat_template) if config.chat_template else None
        folder = _model_folder(config)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, folder, device)
        sizing = CacheSizing(config.expert_cache_experts, config.expert_cache_gb, config.host_cache_gb)
        quant = _quant_request(config, folder, device)
        loaded = load_offloaded_model(folder, device, dtype, sizing, config.policy, quant, config.max_model_len)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        use_chat_template(tokenizer, chat_template, folder)
        engine = cls(loaded, tokenizer, config, device)
        engine.warm_up()  # before the EAMC, trace and prefetcher are attached: it leaves no record there
        engine._attach_cache_features()
        warn_if_context_may_not_fit(loaded.config, dtype, engine.max_model_len, device)
        if engine.max_model_len < model_max_len(loaded.config):
            log.info("context: %d tokens of the model's %d (%s); --max-model-len sets it, and its KV cache is set "
                     "aside from the expert cache's memory", engine.max_model_len, model_max_len(loaded.config),
                     "--max-model-len" if config.max_model_len else
                     f"the KV cache gets at most 1/{round(1 / DEFAULT_KV_SHARE)} of the device memory by default")
        shown = {**engine.sampling_defaults, "max_tokens": engine.max_new_tokens or "the rest of the context"}
        log.info("a request that omits them gets: %s (from generation_config.json, else the OpenAI defaults)",
                 ", ".join(f"{k}={v}" for k, v in shown.items()))
        return engine

    def warm_up(self) -> None:
        """A short generation through the whole path (chat template, prefill, decode, detokenizer), so
        that the first request does not pay for lazy initialisation and a cold expert cache."""
        start = time.perf_counter()
        has_template = getattr(self.tokenizer, "chat_template", None)
        prompt = self.apply_chat_template([{"role": "user", "content": "Hi"}]) if has_template else self.encode("Hi")
        request = GenerationRequest("warm-up", prompt, SamplingParams(max_tokens=WARM_UP_TOKENS, temperature=0,
                                                                        ignore_eos=True))
        for _ in self.generate(request):
            pass
        if self.prefix_cache is not None:
            self.prefix_cache.clear()  # nobody's prompt
        self.prompt_tokens = self.prompt_tokens_cached = 0
        log.info("warmed up in %.1f s", time.perf_counter() - start)

    def _attach_cache_features(self) -> None:
        runtime, config = self.runtime, self.config
        copy_ms = self._copy_ms()
        runtime.planner = self._miss_planner(copy_ms)
        if config.prefetch and self._cache_holds_every_expert():
            log.info("prefetch off: the expert cache holds every expert (a miss happens once per expert)")
        elif config.prefetch:
            routers = [router_top_k(layer) for layer in self.loaded.moe_layers]
            # CUDA copies are already async on a side stream; disk reads of a bounded RAM tier are not
            background = self.device.type != "cuda" or not self.loaded.host.fully_resident
            limit = PREFETCH_LIMIT_PER_TOP_K * runtime.top_k
            runtime.prefetcher = Prefetcher(runtime.cache, routers, background, limit, self._prefetch_cost(copy_ms))
        if hasattr(runtime.policy, "eamc"):
            self._eamc_saver = _eamc_saver(self, runtime.policy)
        if config.record_trace:
            runtime.recorder = TraceWriter(
                config.record_trace, self.model_name, runtime.num_layers, runtime.num_experts, runtime.top_k
            )

    def _cache_holds_every_expert(self) -> bool:
        """Nothing is ever evicted: a prefetch could only hide an expert's first load, and its
        look-ahead would cost every token (CPU, all resident: +15% TPOT)."""
        return self.runtime.cache.capacity >= self.runtime.num_layers * self.runtime.num_experts

    def _copy_ms(self) -> float | None:
        """One expert's host → device copy on this machine, measured now (None on CPU)."""
        if self.device.type != "cuda":
            return None
        copy_ms = self.runtime.cache.backend.measure_copy_ms(next(iter(self.loaded.host.sources)))
        log.info("one expert's copy to the device takes %.2f ms", copy_ms)
        return copy_ms

    def _prefetch_cost(self, copy_ms: float | None) -> PrefetchCost | None:
        """A guess must pay for its load. On CUDA: its copy (measured now). On CPU: its read from disk
        into the RAM tier, on the prefetch thread (timed on every read, see `HostReadCost`). The
        compute it can hide behind is learned while decoding."""
        if copy_ms is not None:
            return PrefetchCost(copy_ms, overlap_ms=0.0, measure_overlap=True)
        spare_core = (os.cpu_count() or 1) > torch.get_num_threads()
        log.info("CPU prefetch: the compute runs on %d threads, %s", torch.get_num_threads(),
                 "a core is left to the reads" if spare_core else "the reads share its cores")
        return HostReadCost(0.0, overlap_ms=0.0, measure_overlap=True, reads=self.loaded.host.read_times,
                            spare_core=spare_core)

    def _miss_planner(self, copy_ms: float | None) -> MissPlanner | None:
        """`--cpu-experts auto`: on CUDA, misses go to the host cores too when that was measured
        to finish a step sooner (the costs are shown in /v1/expert-cache)."""
        if copy_ms is None or self.config.cpu_experts == "off" or not self.loaded.offloaded[0].host_capable:
            return None
        torch.set_num_threads(host_compute_threads())
        with self.loaded.host.hold(next(iter(self.loaded.host.sources))) as buffer:
            host_ms = self.loaded.offloaded[0].measure_host_ms(buffer)
        self.miss_costs = MissCosts(copy_ms, host_ms)
        share = self.loaded.offloaded[0].can_share
        gains = self.miss_costs.gains(share)
        log.info("one expert on one token takes %.2f ms on %d host threads, its copy %.2f ms: misses %s",
                 host_ms, torch.get_num_threads(), copy_ms,
                 "are split between the host and the link" if gains else "are all copied (no gain measured)")
        return MissPlanner(self.miss_costs, share=share) if gains else None

    # -- prompts -----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens=False`: the text's own tokens, without the BOS a prompt starts with."""
        with self._encoder_lock:
            return self._encoder(text, add_special_tokens=add_special_tokens)["input_ids"]

    def fim_prompt(self, prefix: str, suffix: str, files: ExtraFiles = ()) -> list[int]:
        """The fill-in-the-middle prompt for the code around the cursor (engine/fim.py), after other `files` of
        the project; a request should also stop at `fim_stop_ids`. A model without FIM tokens:
        InvalidRequestError naming `suffix`."""
        if self._fim is None:
            raise InvalidRequestError("this model has no fill-in-the-middle tokens, so it cannot complete between "
                                      "a prompt and a suffix (code models such as Qwen2.5/3-Coder, "
                                      "DeepSeek-Coder-V2, Codestral and StarCoder have them)", param="suffix")
        with self._encoder_lock:
            return fim_prompt_ids(self._encoder, self._fim, prefix, suffix, files)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _check_prompt_ids(self, ids: list[int]) -> None:
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")

    def echoed_prompt(self, ids: list[int]) -> EchoedPrompt:
        """The prompt's text and its tokens' texts and offsets in it, for a completion that echoes it."""
        self._check_prompt_ids(ids)  # echoed before the request is validated
        detokenizer = IncrementalDetokenizer(self.decode)
        offsets, emitted = [], 0
        for token_id in ids:
            offsets.append(emitted)
            emitted += len(detokenizer.push(token_id))
        return EchoedPrompt(self.decode(ids), tuple(self._token_text(t) for t in ids), tuple(offsets))

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict[str, Any] | None = None, continue_final: bool = False) -> list[int]:
        """Prompt token ids; `tools` (OpenAI function definitions) only for a template that takes them;
        `template_kwargs`: more variables for the template (`enable_thinking`, ...); `continue_final`: the prompt
        ends inside the last message (a partial assistant answer, to continue), not with a new turn opened."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions", param="messages"
            )
        supports_tools = self.chat_template_info.supports_tools
        if tools and not supports_tools:
            raise InvalidRequestError("this model's chat template cannot take tools", param="tools")
        reserved = sorted(set(template_kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs cannot set {', '.join(reserved)}: the server sets them",
                                      param="chat_template_kwargs")
        normalised = prepare_messages(messages, tool_template=supports_tools)
        with self._encoder_lock:
            try:
                text = self._render_chat_template(normalised, tools, template_kwargs or {}, continue_final)
            except InvalidRequestError as e:
                folded = fold_late_system_messages(normalised)
                if folded is None or e.code == TEMPLATE_TIMEOUT_CODE:
                    raise
                text = self._render_chat_template(folded, tools, template_kwargs or {}, continue_final)
            return self._encoder(text, add_special_tokens=False)["input_ids"]

    def _render_chat_template(self, messages: list[dict], tools: list[dict] | None,
                              template_kwargs: dict[str, Any], continue_final: bool = False) -> str:
        """The model's template, in transformers' Jinja sandbox and within CHAT_TEMPLATE_TIME_LIMIT_S."""
        def render() -> str:
            return self._encoder.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                     add_generation_prompt=not continue_final,
                                                     continue_final_message=continue_final, **template_kwargs)
        try:
            return call_with_time_limit(render, CHAT_TEMPLATE_TIME_LIMIT_S)
        except TimeLimitExceeded:
            log.warning("the chat template did not finish within %.0f s", CHAT_TEMPLATE_TIME_LIMIT_S)
            raise InvalidRequestError(f"the model's chat template did not finish within {CHAT_TEMPLATE_TIME_LIMIT_S:g} s "
                                      "on these messages", param="messages", code=TEMPLATE_TIMEOUT_CODE) from None
        except Exception as e:  # the template's own checks (roles that must alternate) and the sandbox's
            raise InvalidRequestError(f"the chat template rejected the messages: {e}", param="messages") from None

    def validate(self, request: GenerationRequest) -> None:
        prompt, params = request.prompt_token_ids, request.params
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        self._check_prompt_ids(prompt)
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop token ids must be in [0, {self.vocab_size})", param="stop_token_ids")
        bad = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"logit_bias names token ids outside the vocabulary: {bad[:5]}", param="logit_bias"
            )
        if params.grammar is not None:
            check_grammar(params.grammar)
        if any(t is not None and not 0 <= t < self.vocab_size for t in (params.grammar_after, params.grammar_may_open)):
            raise InvalidRequestError(f"the thinking markers must be token ids in [0, {self.vocab_size})", param="grammar")
        thinking_ids = (*params.thinking_end_ids, params.thinking_close, params.thinking_open)
        if any(t is not None and not 0 <= t < self.vocab_size for t in thinking_ids):
            raise InvalidRequestError(f"the thinking markers must be token ids in [0, {self.vocab_size})",
                                      param="thinking_budget")
        if request.pooling is not None:  # an embedding samples nothing
            self._validate_embedding(request)
            return
        wanted = len(prompt) + (1 if params.max_tokens is None else params.max_tokens)
        if wanted > self.max_model_len:
            raise ContextLengthError(self.max_model_len, len(prompt), wanted - len(prompt))

    def _validate_embedding(self, request: GenerationRequest) -> None:
        if request.pooling not in POOLINGS:
            raise InvalidRequestError(f"pooling must be one of {', '.join(POOLINGS)}", param="pooling")
        for ids in request.more_inputs:
            if not ids:
                raise InvalidRequestError("an input is empty", param="prompt")
            self._check_prompt_ids(ids)
        longest = max(map(len, request.inputs))
        if longest > self.max_model_len:
            raise ContextLengthError(self.max_model_len, longest, 0)

    # -- generation --------------------------------------------------------------------
    def generate(
        self, request: GenerationRequest, should_abort: Callable[[], bool] = lambda: False
    ) -> Iterator[GenerationEvent]:
        self.validate(request)
        params, prompt = request.params, request.prompt_token_ids
        room = self.max_model_len - len(prompt)
        max_tokens = params.max_tokens  # 0: only the prompt is scored
        if max_tokens is None:
            max_tokens = min(self.max_new_tokens or room, room)
        constraint = None
        if params.grammar is not None:
            constraint = GrammarConstraint(self._grammar_tokenizer, params.grammar, self.vocab_size, self.device,
                                           params.grammar_after, params.grammar_may_open)
        sampler = Sampler(params, prompt, self.vocab_size, self.device, constraint)
        context = prompt[-DETOKENIZER_CONTEXT_TOKENS:] if params.text_continues_prompt else ()
        detokenizer = IncrementalDetokenizer(lambda ids: self.decode(ids, params.skip_special_tokens), context)
        stops = StopStringMatcher(params.stop)
        times = self.last_times = StepTimes(start=time.perf_counter())
        self.runtime.begin_request(request.request_id)
        try:
            with torch.inference_mode():
                # None: the model makes its family's own cache (sliding window, linear attention, ...)
                if request.pooling is not None:
                    yield self._embedding_event(request)
                    return
                kv, cached = self._reused_prefix(prompt, params)
                tokens = list(prompt)  # what the KV cache holds once `input_ids` are fed: the prompt, the answer
                input_ids = torch.tensor([prompt[cached:]], dtype=torch.long, device=self.device)  # [1, T]
                self.prompt_tokens += len(prompt)
                self.prompt_tokens_cached += cached
                while True:
                    if should_abort():
                        self._keep_prefix(tokens, kv)
                        yield GenerationEvent(
                            "", finish_reason="abort", usage=Usage(len(prompt), times.tokens, cached)
                        )
                        return
                    if self.prefix_cache is not None:
                        self.prefix_cache.make_room(len(tokens))
                    scored = None  # the prompt's logprobs, when asked: on the first event
                    if times.tokens == 0 and params.prompt_logprobs is not None:
                        logits, kv, scored = self._prefill_scoring_prompt(prompt, params.prompt_logprobs)
                        if max_tokens == 0:
                            self._keep_prefix(tokens, kv)
                            yield GenerationEvent("", finish_reason="length", prompt_logprobs=scored,
                                                  usage=Usage(len(prompt), 0, cached))
                            return
                    else:
                        logits, kv = self._forward(input_ids, kv)  # [V]
                    self.runtime.phase = "decode"
                    token = sampler.sample(logits)
                    sampler.observe(token)
                    times.tokens += 1
                    times.first_token = times.first_token or time.perf_counter()
                    event = self._step_event(token, logits, params, detokenizer, stops)
                    if scored is not None:
                        event = replace(event, prompt_logprobs=scored)
                    if event.finish_reason is None and times.tokens >= max_tokens:
                        event = replace(event, text=event.text + stops.flush(), finish_reason="length")
                    if event.finish_reason is not None:
                        times.end = time.perf_counter()
                        self._keep_prefix(tokens, kv)
                        log.info("request %s: %d prompt tokens (%d reused), %d generated; first token after "
                                 "%.2f s, %.2f s in all", request.request_id, len(prompt), cached, times.tokens,
                                 times.first_token - times.start, times.end - times.start)
                        yield _with_usage(event, Usage(len(prompt), times.tokens, cached))
                        return
                    yield event
                    tokens.append(token)
                    input_ids = torch.tensor([[token]], dtype=torch.long, device=self.device)  # [1, 1]
        except torch.OutOfMemoryError:
            context = len(prompt) + times.tokens
            log.warning("request %s: the device ran out of memory at %d tokens of context", request.request_id, context)
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # what the failed step and the kept prompts held, back to the driver
            raise DeviceMemoryError(
                f"the device ran out of memory at {context} tokens of context (the KV cache grows with it); "
                "a shorter conversation fits, or start the server with a smaller --expert-cache-gb or "
                "--max-model-len") from None
        finally:
            self.runtime.end_request(request.request_id)
            self._save_eamc_periodically()

    def _save_eamc_periodically(self) -> None:
        # between requests, on the worker thread: no lock needed against the policy
        if self._eamc_saver and time.monotonic() - self._eamc_saved_at >= EAMC_SAVE_INTERVAL_S:
            self._eamc_saver.save_if_changed()
            self._eamc_saved_at = time.monotonic()

    def _keep_prefix(self, tokens: list[int], kv: Cache | None) -> None:
        """Between steps the KV cache holds the first of `tokens` (not those still to be fed):
        kept for a later prompt that starts the same way."""
        if self.prefix_cache is not None and kv is not None:
            self.prefix_cache.put(tokens[: kv.get_seq_length()], kv)

    def _reused_prefix(self, prompt: list[int], params: SamplingParams) -> tuple[Cache | None, int]:
        """A kept KV cache of the prompt's start and its length; none for a request that scores its prompt
        (reused positions would have no logits)."""
        if self.prefix_cache is None or params.prompt_logprobs is not None:
            return None, 0
        return self.prefix_cache.take(prompt)

    def _forward(self, input_ids: torch.Tensor, kv: Cache | None) -> tuple[torch.Tensor, Cache]:
        out = self.model(input_ids=input_ids, cache=kv, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1], out.cache

    def _prefill_scoring_prompt(
        self, prompt: list[int], top: int
    ) -> tuple[torch.Tensor, Cache, tuple[TokenLogprob | None, ...]]:
        """The prefill of the whole prompt (no kept prefix) with logits at every position, fed in chunks of
        positions whose logits are scored and dropped before the next forward: the last position's logits
        [V], the KV cache, and the prompt tokens' logprobs. At most [SCORING_CHUNK, V] logits exist at once."""
        # a prompt repeats its tokens, its top alternatives more: each decoded once, across the chunks
        text = functools.cache(self._token_text)
        scored: list[TokenLogprob | None] = [None]  # nothing predicts the first token
        kv, start = None, 0
        while True:
            end = self._scoring_chunk_end(start, len(prompt), kv)
            input_ids = torch.tensor([prompt[start:end]], dtype=torch.long, device=self.device)  # [1, C]
            out = self.model(input_ids=input_ids, cache=kv, use_cache=True, logits_to_keep=0)
            logits, kv = out.logits[0], out.cache  # [C, V']
            targets = prompt[start + 1 : end + 1]  # row i predicts prompt token start + i + 1
            scored += scoring.score_rows(logits[: len(targets), : self.vocab_size], targets, top, text)
            if end == len(prompt):
                # the last row predicts the first generated token; a copy, so the chunk's logits can go
                return logits[-1].clone(), kv, tuple(scored)
            del out, logits  # before the next chunk's forward makes its own
            start = end

    def _embedding_event(self, request: GenerationRequest) -> GenerationEvent:
        """An embedding request's only event: each input's last hidden states (after the model's final norm)
        pooled into one float32 vector [H]. Every position's states are needed: no kept prefix is used."""
        inputs = request.inputs
        tokens = sum(map(len, inputs))
        self.prompt_tokens += tokens
        if self.prefix_cache is not None:
            self.prefix_cache.make_room(len(inputs) * max(map(len, inputs)))
        if len(inputs) == 1:
            pooled = self._pooled_in_chunks(inputs[0], request.pooling)[None]  # [1, H]
        else:
            pooled = self._pooled_batch(inputs, request.pooling)
        self.last_times.end = time.perf_counter()
        log.info("request %s: the embeddings of %d inputs, %d tokens, %.2f s", request.request_id, len(inputs),
                 tokens, self.last_times.end - self.last_times.start)
        return GenerationEvent("", finish_reason="stop", usage=Usage(tokens, 0),
                               embeddings=tuple(tuple(row) for row in pooled.tolist()))

    def _pooled_in_chunks(self, prompt: list[int], pooling: Pooling) -> torch.Tensor:
        """[H]: one input, fed in chunks like a scored prompt, so only [chunk, H] states exist at once."""
        kv, start, total = None, 0, None
        while True:
            end = self._scoring_chunk_end(start, len(prompt), kv)
            input_ids = torch.tensor([prompt[start:end]], dtype=torch.long, device=self.device)  # [1, C]
            out = self.model.base_model(input_ids=input_ids, cache=kv, use_cache=True)
            hidden, kv = out.last_hidden_state[0].float(), out.cache  # [C, H]
            total = hidden.sum(0) if total is None else total + hidden.sum(0)  # [H]
            if end == len(prompt):
                break
            start = end
        return total / len(prompt) if pooling == "mean" else hidden[-1]

    def _pooled_batch(self, inputs: list[list[int]], pooling: Pooling) -> torch.Tensor:
        """[N, H]: several inputs in one pass, padded on the right. The attention is causal, so no real position
        sees a pad and each input's states are its own; pad positions' states are dropped, and the offloaded
        experts skip them (`ExpertRuntime.live_tokens`): a pad loads no expert and is not in a recorded trace."""
        lengths = torch.tensor([len(ids) for ids in inputs])  # [N]
        input_ids = torch.zeros(len(inputs), int(lengths.max()), dtype=torch.long)  # [N, W], built on the host
        for row, ids in enumerate(inputs):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask = torch.arange(input_ids.shape[1])[None] < lengths[:, None]  # [N, W]
        live = mask.flatten().nonzero()[:, 0]  # [sum(lengths)]
        input_ids, lengths, mask, live = (t.to(self.device) for t in (input_ids, lengths, mask, live))
        self.runtime.live_tokens = live
        try:
            out = self.model.base_model(input_ids=input_ids, attention_mask=mask.long(), use_cache=False)
        finally:
            self.runtime.live_tokens = None
        hidden = out.last_hidden_state.float()  # [N, W, H]
        if pooling == "mean":
            return (hidden * mask[..., None]).sum(1) / lengths[:, None]
        return hidden[torch.arange(len(inputs), device=self.device), lengths - 1]

    @staticmethod
    def _scoring_chunk_end(start: int, length: int, kv: Cache | None) -> int:
        """Where the scoring chunk from `start` ends. A family's own cache class (`reusable` says which
        are known) is not known to take a multi-token forward after a prefix: the rest goes in one."""
        if kv is not None and not reusable(kv):
            return length
        return min(start + scoring.SCORING_CHUNK, length)

    def _step_event(self, token, logits, params: SamplingParams, detokenizer, stops) -> GenerationEvent:
        logprobs = ()
        if params.top_logprobs is not None:
            logprobs = (token_logprob(logits[: self.vocab_size], token, params.top_logprobs, self._token_text),)
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return GenerationEvent(stops.flush(), (token,), logprobs, "stop")
        text, stopped = stops.feed(detokenizer.push(token))
        if stopped:
            return GenerationEvent(text, (token,), logprobs, "stop", stop_sequence=stops.matched)
        return GenerationEvent(text, (token,), logprobs)

    def _token_text(self, token_id: int) -> str:
        """The text a token adds after other text (decoding it alone drops a leading space)."""
        with self._tokenizer_lock:
            return self.tokenizer.decode(self._anchor + [token_id])[len(self._anchor_text) :]

    # -- cache view --------------------------------------------------------------------
    def cache_counters(self) -> dict[str, int]:
        counters = self.runtime.stats.totals()
        counters["eamc_entries"] = _eamc_size(self.runtime.policy)
        counters["prefetch_failures"] = self.runtime.prefetcher.failures if self.runtime.prefetcher else 0
        counters["trace_write_failures"] = self.runtime.recorder.failures if self.runtime.recorder else 0
        counters["prompt_tokens"] = self.prompt_tokens
        counters["prompt_tokens_cached"] = self.prompt_tokens_cached
        return counters

    def cache_info(self) -> dict:
        stats = self.runtime.stats
        totals, per_layer = stats.totals(), stats.per_layer()
        resident: dict[int, list[int]] = {layer: [] for layer in range(self.runtime.num_layers)}
        for layer, expert in self.runtime.cache.resident():
            resident[layer].append(expert)
        return {
            "policy": self.runtime.policy.name,
            "prefetch": self.runtime.prefetcher is not None,
            "capacity_experts": self.runtime.cache.capacity,
            "total_experts": self.runtime.num_layers * self.runtime.num_experts,
            "num_moe_layers": self.runtime.num_layers,
            "experts_per_layer": self.runtime.num_experts,
            "top_k": self.runtime.top_k,
            "expert_dtype": self.loaded.quant.expert_dtype if self.loaded.quant else str(self.loaded.host.dtype).removeprefix("torch."),
            "expert_group_sizes": _group_sizes(self.loaded.quant),
            "bytes_per_expert": self.loaded.host.bytes_per_expert,
            "host_tier": {  # on CPU the cache's slots are the RAM tier
                "capacity_experts": self.runtime.cache.capacity if self.device.type == "cpu" else self.loaded.host.capacity,
                "disk_reads": self.loaded.host.disk_reads,
            },
            **totals,
            "hit_rate": stats.hit_rate(),
            "prefetch_accuracy": totals["prefetch_used"] / totals["prefetches"]
            if totals["prefetches"]
            else None,
            "lookahead_accuracy": self.runtime.prefetcher.lookahead_accuracy if self.runtime.prefetcher else None,
            "prefetch_gate": self.runtime.prefetcher.gate_info() if self.runtime.prefetcher else None,
            "cpu_experts": self._cpu_experts_info(totals),
            "eamc_entries": _eamc_size(self.runtime.policy),
            "prefix_cache": self.prefix_cache.summary() if self.prefix_cache is not None else None,
            "eamc_path": str(self._eamc_saver.path) if self._eamc_saver else None,
            "layers": [
                {
                    "layer": layer,
                    "hits": per_layer["hits"][layer],
                    "misses": per_layer["misses"][layer],
                    "hit_rate": _rate(per_layer["hits"][layer], per_layer["misses"][layer]),
                    "resident_experts": resident[layer],
                }
                for layer in range(self.runtime.num_layers)
            ],
        }

    def _cpu_experts_info(self, totals: dict[str, int]) -> dict:
        """The host executor: its cost model and the share of expert uses it computed."""
        uses = totals["hits"] + totals["misses"]
        costs = self.miss_costs
        return {
            "enabled": self.runtime.planner is not None,
            "copy_ms_per_expert": round(costs.copy_ms, 3) if costs else None,
            "cpu_ms_per_expert": round(costs.host_ms, 3) if costs else None,
            "cpu_threads": torch.get_num_threads() if costs else None,
            "shares_misses": bool(self.runtime.planner and self.runtime.planner.share),  # one per step, both lanes
            "computed": totals["cpu_computed"],
            "share_of_expert_uses": totals["cpu_computed"] / uses if uses else 0.0,
        }

    def close(self) -> None:
        """Persist what must survive a restart; stop background work."""
        if self._eamc_saver is not None:
            self._eamc_saver.close()
        if self.runtime.prefetcher is not None:
            self.runtime.prefetcher.close()
        if self.runtime.recorder is not None:
            self.runtime.recorder.close()


def host_compute_threads() -> int:
    """Intra-op threads for experts computed on the host: all cores but one, which the engine
    thread's Python work and the prefetch thread's disk reads need to stay responsive."""
    return max(1, (os.cpu_count() or 2) - 1)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but CUDA is not available on this machine")
    return device


def resolve_dtype(name: str, folder: Path, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type != "cuda":
        return torch.float32  # half-precision matmuls are slow or missing on many CPUs
    dtype = getattr(AutoConfig.from_pretrained(folder), "dtype", None) or torch.bfloat16
    return dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16


def _model_folder(config: EngineConfig) -> Path:
    if config.model is None:
        return ensure_demo_model()
    return resolve_model_path(config.model)


def _quant_request(config: EngineConfig, folder: Path, device: torch.device) -> QuantRequest | None:
    """`--expert-dtype int8|int4`, or any expert dtype of a checkpoint published quantized (FP8, MXFP4): which
    form, and its file under the state folder (one per form and device)."""
    published = published_format(read_config_dict(folder), folder / "config.json")
    wanted = config.expert_dtype
    if wanted == "auto":
        wanted = gguf_expert_dtype(folder) or wanted  # a GGUF file's 4- or 8-bit experts stay that small
    from_gguf = experts_stored_once(folder)  # a GGUF file's experts, stored in the expert store once
    if wanted not in QUANT_DTYPES and published is None and not from_gguf:
        return None  # auto, bf16: the checkpoint's weights in --dtype
    group = DEFAULT_GROUP_SIZE.get(wanted, 0) if config.expert_group_size is None else config.expert_group_size
    digest = checkpoint_digest(folder)
    form = f"{wanted}-g{group or 'channel'}-{device.type}"
    if wanted not in QUANT_DTYPES:  # the published bytes (auto), or decoded into --dtype (bf16)
        form = f"{published.method if published else 'gguf'}-{wanted}-{device.type}"
    path = default_quant_path(f"{config.model or DEMO_MODEL_NAME}|{digest}", form)
    return QuantRequest(wanted, group, path, digest)


def _eamc_saver(engine: Engine, policy) -> EAMCAutosaver:
    """Load the saved EAMC into the policy (if it belongs to this model) and return its saver."""
    runtime, config = engine.runtime, engine.config
    identity = f"{engine.model_name}|{checkpoint_digest(engine.loaded.folder)}"
    fingerprint = ModelFingerprint(engine.loaded.config.model_type, runtime.num_layers, runtime.num_experts, identity)
    path = Path(config.eamc_path) if config.eamc_path else default_eamc_path(identity)
    saved = load_eamc(path, fingerprint, capacity=config.eamc_capacity)
    policy.eamc = saved or EAMC(runtime.num_layers, runtime.num_experts, capacity=config.eamc_capacity)
    log.info("EAMC %s: %d entries loaded", path, len(policy.eamc))
    return EAMCAutosaver(path, fingerprint, lambda: policy.eamc)


# generation_config.json key -> SamplingParams field, as vLLM's `--generation-config auto` reads them
GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(folder: Path) -> dict[str, Any]:
    """The sampling defaults the model's generation_config.json sets (only those it sets explicitly)."""
    try:
        config = json.loads((folder / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    defaults = {ours: config[key] for key, ours in GENERATION_DEFAULT_KEYS.items() if config.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except (InvalidRequestError, TypeError) as e:
        log.warning("ignoring the sampling defaults in %s: %s", folder / "generation_config.json", e)
        return {}
    return defaults


def _prefix_host_tier(config: EngineConfig, device: torch.device) -> HostTier | None:
    """The host RAM kept KV caches may move to off the device (`--prefix-cache-host-gb`)."""
    if config.prefix_cache_host_gb is not None:
        capacity = int(config.prefix_cache_host_gb * GIB)
    else:  # after the experts loaded: a share of what they left, never the RAM the system needs
        available = available_ram_bytes()
        capacity = min(PREFIX_HOST_DEFAULT_BYTES, available // 8) if available is not None else PREFIX_HOST_DEFAULT_BYTES
    if capacity <= 0:
        return None
    log.info("kept KV caches: up to %.2f GiB in host RAM once they leave the device's context budget", capacity / GIB)
    return HostTier(capacity, device)


def use_chat_template(tokenizer, override: ChatTemplate | None, folder: Path | None = None) -> None:
    """Sets `override` on the tokenizer, the one source every user of the template reads (prompts, the
    tool and reasoning parsers' auto-detection, Ollama's /api/show), or where the tokenizer has none, the template
    a multimodal model keeps with its processor in `folder`; logs which template is in use."""
    if override is not None:
        tokenizer.chat_template = override.text
        log.info("chat template: %s (--chat-template), in place of the model's own", override.origin)
    elif getattr(tokenizer, "chat_template", None):
        log.info("chat template: the model's own")
    elif folder is not None and (processor_template := processor_chat_template(folder)):
        tokenizer.chat_template = processor_template
        log.info("chat template: the model's own, from its processor's settings")
    else:
        log.info("chat template: none (the model has none; --chat-template can give one)")


def _eos_ids(folder: Path, tokenizer) -> set[int]:
    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass  # no generation_config.json
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _with_usage(event: GenerationEvent, usage: Usage) -> GenerationEvent:
    return replace(event, usage=usage)


def _group_sizes(layout: QuantLayout | None) -> dict[str, int] | None:
    """Weights per scale of each quantized expert weight (a size that did not divide a row shrank)."""
    return None if layout is None else {t.name: t.group_size for t in layout.tensors if t.packing != "raw"}


def _rate(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def _eamc_size(policy) -> int:
    eamc = getattr(policy, "eamc", None)
    return len(eamc) if eamc is not None else 0
