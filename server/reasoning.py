"""A reasoning model's thinking, read out of its output as it arrives: it goes to the message's
`reasoning_content` (and `reasoning`, vLLM's newer name), the answer to `content`.

Four formats:
- `think`: a `<think>…</think>` block at the start of the output (Qwen3, DeepSeek-R1 and V3.1,
  GLM-4.5, MiniMax-M2, ...). Templates of thinking models often open the block in the prompt, so
  that the output begins inside it.
- `gemma4` (Gemma 4): the same with a `<|channel>thought\n…<channel|>` block, its `thought` label
  not part of the reasoning.
- `hunyuan` (Hunyuan-A13B): a `<think>` block, then the answer wrapped in `<answer>…</answer>`, tags
  that are not part of it.
- `harmony` (GPT-OSS): a run of channel messages, `<|channel|>NAME<|message|>BODY<|end|>`. The
  `analysis` channel is reasoning; `final` and preambles are the answer; a message to a function is
  a tool call, passed on whole to the tool-call parser (`server.tool_parsers.harmony`).

`OutputReader` chains the reasoning reader and the tool-call reader of one response. `plan_reasoning`
also turns a thinking budget into the engine's sampling fields: the engine closes a `<think>` block
that runs past it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from engine.api import ChatTemplateInfo, SamplingParams
from server.tool_parsers import Piece, ToolCallStream
from server.tool_parsers.stream import first_marker, partial_marker

REASONING_PARSERS = ("auto", "none", "think", "harmony", "gemma4", "hunyuan", "mistral")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MISTRAL_OPEN, MISTRAL_CLOSE = "[THINK]", "[/THINK]"  # Magistral's and Mistral Small 4's control tokens
GEMMA4_OPEN, GEMMA4_CLOSE, GEMMA4_LABEL = "<|channel>", "<channel|>", "thought"  # not harmony's <|channel|>
GEMMA4_MODEL_TYPES = ("gemma4", "gemma4_text")
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"  # Hunyuan-A13B's wrapper around the answer
HUNYUAN_MODEL_TYPES = ("hunyuan_v1_moe",)
# a block up front
BLOCK_MARKERS = {"think": (THINK_OPEN, THINK_CLOSE), "gemma4": (GEMMA4_OPEN, GEMMA4_CLOSE),
                 "hunyuan": (THINK_OPEN, THINK_CLOSE), "mistral": (MISTRAL_OPEN, MISTRAL_CLOSE)}
MESSAGE = "<|message|>"
HARMONY_TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
PROMPT_TAIL_TOKENS = 8  # enough to see whether the template ended the prompt with `<think>`
BUDGET_IGNORED = ("the thinking token budget was ignored: this model does not think in a <think>...</think> "
                  "(or Gemma 4 channel) block whose markers are single tokens")
_HARMONY_RECIPIENT = re.compile(r"\bto=functions\.")
_HARMONY_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


@dataclass(frozen=True)
class Reasoning:
    text: str


Part = str | Reasoning  # answer text (which may hold tool-call markup), or reasoning


def detect_reasoning(info: ChatTemplateInfo) -> str | None:
    """The reasoning format of a model, from its template's text (else its model type); None: none."""
    if "<|channel|>" in info.source or info.model_type == "gpt_oss":
        return "harmony"
    if GEMMA4_OPEN in info.source or GEMMA4_CLOSE in info.source or info.model_type in GEMMA4_MODEL_TYPES:
        return "gemma4"
    if (ANSWER_OPEN in info.source and THINK_OPEN in info.source) or info.model_type in HUNYUAN_MODEL_TYPES:
        return "hunyuan"
    if THINK_OPEN in info.source or THINK_CLOSE in info.source:
        return "think"
    if MISTRAL_OPEN in info.source or MISTRAL_CLOSE in info.source:
        return "mistral"
    return None


class _TextReader:
    """Text fed in pieces, buffered until `_drain` can tell what it is."""

    def __init__(self) -> None:
        self._buffer = ""
        self._fed = 0  # characters fed so far; those read are `_fed - len(_buffer)`
        self.reasoning_end: int | None = None  # where the thinking ended in the text fed, its end marker included

    def feed(self, text: str) -> list[Part]:
        self._buffer += text
        self._fed += len(text)
        return self._drain(final=False)

    def _drain(self, final: bool) -> list[Part]:
        raise NotImplementedError


class ThinkStream(_TextReader):
    """A thinking block at the start of the output, `<think>…</think>` unless other markers are given;
    `label`: a word the block opens with that names it (Gemma 4's `thought`), not part of the thinking;
    `wrapped`: the answer's tags (Hunyuan's `<answer>…</answer>`), dropped with the blanks next to them."""

    def __init__(self, opened_in_prompt: bool, open_marker: str = THINK_OPEN, close_marker: str = THINK_CLOSE,
                 label: str = "", wrapped: tuple[str, str] | None = None) -> None:
        super().__init__()
        self._state = "reasoning-start" if opened_in_prompt else "start"
        self._open, self._close, self._label = open_marker, close_marker, label
        self._wrapped = wrapped
        self._closed = False  # the wrapped answer's closing tag has come

    def finish(self) -> list[Part]:
        out = self._drain(final=True)
        if self._state in ("reasoning-start", "reasoning"):  # never closed: all of it was thinking
            self.reasoning_end = self._fed
        return out

    def _drain(self, final: bool) -> list[Part]:
        out: list[Part] = []
        if self._state == "start":
            head = self._buffer.lstrip()
            if head.startswith(self._open):
                self._buffer, self._state = head[len(self._open):], "reasoning-start"
            elif self._open.startswith(head) and not final:
                return out  # blanks, or the start of `<think>`: not decided yet
            else:
                self._state = "answer-start" if self._wrapped else "answer"  # a wrapped one may open at once
        if self._state == "reasoning-start" and self._label:
            label = self._read_label(final)
            if label is None:
                return out
            self._buffer, self._label = self._buffer[label:], ""  # read once: the thinking may start with it
        if self._state == "reasoning-start":  # the blank line after `<think>` is layout, not thought
            self._buffer = self._buffer.lstrip()
            if self._buffer:
                self._state = "reasoning"
        if self._state == "reasoning":
            end = self._buffer.find(self._close)
            if end < 0:
                keep = 0 if final else partial_marker(self._buffer, (self._close,))
                ready = self._buffer[: len(self._buffer) - keep].rstrip()  # blanks before `</think>` are layout
                _add_reasoning(out, ready)
                self._buffer = self._buffer[len(ready):]
                return out
            _add_reasoning(out, self._buffer[:end].rstrip())
            self.reasoning_end = self._fed - len(self._buffer) + end + len(self._close)
            self._buffer, self._state = self._buffer[end + len(self._close):], "answer-start"
        if self._state == "answer-start":  # so are the blanks between `</think>` and the answer
            self._buffer = self._buffer.lstrip()
            if self._wrapped and self._buffer.startswith(self._wrapped[0]):
                self._buffer = self._buffer[len(self._wrapped[0]):].lstrip()
            elif self._wrapped and self._wrapped[0].startswith(self._buffer) and not final:
                return out  # maybe the start of `<answer>`
            if self._buffer:
                self._state = "answer"
        if self._state == "answer" and self._buffer:
            self._answer(out, final)
        return out

    def _answer(self, out: list[Part], final: bool) -> None:
        """The answer read so far; a wrapped one without its closing tag and the blanks before it (held back
        where more may come)."""
        if not self._wrapped:
            out.append(self._buffer)
            self._buffer = ""
            return
        close = self._wrapped[1]
        keep = 0 if final else partial_marker(self._buffer, (close,))
        head = self._buffer[: len(self._buffer) - keep]
        self._closed = self._closed or close in head
        text = head.replace(close, "")
        ready = text if final and not self._closed else text.rstrip()
        if ready:
            out.append(ready)
        self._buffer = "" if final else text[len(ready):] + self._buffer[len(self._buffer) - keep:]

    def _read_label(self, final: bool) -> int | None:
        """The length of the label at the start of the block (0: none there); None: not decided yet.
        The label is a word of its own: followed by a blank or the end of the block."""
        label, text = self._label, self._buffer
        if not text.startswith(label):
            return None if label.startswith(text) and not final else 0
        after = text[len(label):]
        if after[:1].isspace() or after.startswith(self._close) or (final and not after):
            return len(label)
        return None if self._close.startswith(after) and not final else 0


class HarmonyStream(_TextReader):  # reasoning_end: where the last analysis message ended
    def __init__(self) -> None:
        super().__init__()
        self._kind: str | None = None  # in a message body: "reasoning", "answer" or "call"; None: in a header
        self._call = ""  # the tool-call message read so far, header included

    def finish(self) -> list[Part]:
        out = self._drain(final=True)
        if self._kind == "reasoning":  # an analysis message cut off: thinking to the end
            self.reasoning_end = self._fed
        if self._call:  # ended without a terminator (`<|call|>` is a stop token)
            out.append(self._call)
            self._call = ""
        return out

    def _drain(self, final: bool) -> list[Part]:
        out: list[Part] = []
        while self._buffer:
            if self._kind is None and not self._read_header(final):
                return out
            at = first_marker(self._buffer, HARMONY_TERMINATORS)
            if at is None:
                keep = 0 if final else partial_marker(self._buffer, HARMONY_TERMINATORS)
                self._body(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return out
            terminator = next(t for t in HARMONY_TERMINATORS if self._buffer.startswith(t, at))
            self._body(out, self._buffer[:at])
            if self._kind == "reasoning":
                self.reasoning_end = self._fed - len(self._buffer) + at + len(terminator)
            if self._kind == "call":
                out.append(self._call + terminator)
                self._call = ""
            self._buffer, self._kind = self._buffer[at + len(terminator):], None
        return out

    def _read_header(self, final: bool) -> bool:
        """Reads a message's header off the buffer; False: not whole yet."""
        head = self._buffer.lstrip()
        if head and not head.startswith("<|"[: len(head)]):  # text without a header: take it as the answer
            self._kind = "answer"
            return True
        at = self._buffer.find(MESSAGE)
        if at < 0:
            if final:
                self._buffer = ""  # a header with no message: nothing to show
            return False
        header = self._buffer[:at]
        channel = _HARMONY_CHANNEL.search(header)
        if _HARMONY_RECIPIENT.search(header):
            self._kind, self._call = "call", header + MESSAGE
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "answer"
        self._buffer = self._buffer[at + len(MESSAGE):]
        return True

    def _body(self, out: list[Part], text: str) -> None:
        if self._kind == "call":
            self._call += text
        elif self._kind == "reasoning":
            _add_reasoning(out, text)
        elif text:
            out.append(text)


class OutputReader:
    """Generated text → reasoning, answer text and tool calls, as it arrives (and the same at once
    for a finished output, so streamed and whole responses agree)."""

    def __init__(self, reasoning: ThinkStream | HarmonyStream | None, calls: ToolCallStream | None) -> None:
        self.reasoning, self.calls = reasoning, calls

    def feed(self, text: str) -> list[Piece | Reasoning]:
        return self._route(self.reasoning.feed(text) if self.reasoning else [text])

    def finish(self) -> list[Piece | Reasoning]:
        out = self._route(self.reasoning.finish() if self.reasoning else [])
        return out + (self.calls.finish() if self.calls else [])

    @property
    def tool_calls(self) -> list:
        return self.calls.calls if self.calls else []

    def _route(self, parts: list[Part]) -> list[Piece | Reasoning]:
        out: list[Piece | Reasoning] = []
        for part in parts:
            if isinstance(part, Reasoning):
                out.append(part)
            elif self.calls is not None:
                out += self.calls.feed(part)
            elif part:
                out.append(part)
        return out


class ReasoningTokens:
    """Counts the generated tokens that were thinking (usage's `reasoning_tokens`), as they arrive.

    A token is thinking when its text starts before the end of the reasoning in the output, markers
    included (`<think>`, `</think>`, a GPT-OSS analysis message's header and `<|end|>`): so a token that
    holds the end of `</think>` and the start of the answer counts as thinking. Tokens whose text comes
    out together (held back for a possible stop string) share where that text starts."""

    def __init__(self, stream: ThinkStream | HarmonyStream) -> None:
        self._stream = stream
        self._starts: list[tuple[int, int]] = []  # (where the text of a step starts, its tokens)
        self._fed = 0
        self._count: int | None = None

    def add(self, text: str, tokens: int) -> None:
        self._starts.append((self._fed, tokens))
        self._fed += len(text)
        self._stream.feed(text)

    def count(self) -> int:
        """Once the output is whole."""
        if self._count is None:
            self._stream.finish()
            end = self._stream.reasoning_end
            self._count = 0 if end is None else sum(tokens for start, tokens in self._starts if start < end)
        return self._count


def _add_reasoning(out: list[Part], text: str) -> None:
    if text:
        out.append(Reasoning(text))


@dataclass(frozen=True)
class ReasoningPlan:
    """How one response's output is read for reasoning."""

    format: str | None = None  # "think", "harmony", "gemma4", "hunyuan" or "mistral"; None: the answer as written
    opened_in_prompt: bool = False  # think, gemma4: the template opened the block, the output starts inside it
    needs_special_tokens: bool = False  # the format's markers are special tokens the decoder would drop
    grammar_after: int | None = None  # the token (`</think>`) after which the request's grammar holds
    grammar_may_open: int | None = None  # a first token (`<think>`) that starts thinking instead of the grammar
    thinking_budget: int | None = None  # tokens allowed inside the block before it is closed for the model
    thinking_end_ids: tuple[int, ...] = ()  # what closes it then: "\n", `</think>` and (without a grammar) "\n\n"
    thinking_open: int | None = None  # `<think>` (Gemma 4: `<|channel>`), with a budget
    thinking_close: int | None = None  # `</think>` (Gemma 4: `<channel|>`), with a budget
    budget_ignored: bool = False  # a budget was asked for, and this output has no `<think>` block to cap

    def stream(self) -> ThinkStream | HarmonyStream | None:
        if self.format == "think":
            return ThinkStream(self.opened_in_prompt)
        if self.format == "harmony":
            return HarmonyStream()
        if self.format == "gemma4":
            return ThinkStream(self.opened_in_prompt, GEMMA4_OPEN, GEMMA4_CLOSE, GEMMA4_LABEL)
        if self.format == "hunyuan":
            return ThinkStream(self.opened_in_prompt, wrapped=(ANSWER_OPEN, ANSWER_CLOSE))
        if self.format == "mistral":
            return ThinkStream(self.opened_in_prompt, MISTRAL_OPEN, MISTRAL_CLOSE)
        return None

    def token_counter(self) -> ReasoningTokens | None:
        """None where the output is not read for reasoning (usage then has no reasoning count)."""
        stream = self.stream()
        return ReasoningTokens(stream) if stream is not None else None

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        if self.needs_special_tokens:
            params = replace(params, skip_special_tokens=False)
        if self.thinking_budget is not None:
            params = replace(params, thinking_budget=self.thinking_budget, thinking_end_ids=self.thinking_end_ids,
                             thinking_open=self.thinking_open, thinking_close=self.thinking_close,
                             thinking_open_at_start=self.opened_in_prompt)
        if self.grammar_after is None:
            return params
        return replace(params, grammar_after=self.grammar_after, grammar_may_open=self.grammar_may_open)


def plan_reasoning(parser_name: str, engine, params: SamplingParams, prompt: list[int],
                   budget: int | None = None) -> ReasoningPlan:
    """`parser_name`: from `REASONING_PARSERS`; `prompt`: the rendered prompt's token ids; `budget`: the
    thinking tokens allowed (None: no limit).

    Under a grammar (JSON output, a forced tool call) a thinking model thinks freely and answers under
    the grammar after its `</think>`: from the start where the template opened the block, else if its
    first token opens one. Where the markers are not single tokens, the grammar holds from the first
    token and the output is not read for thinking. A budget holds only for a thinking block (`<think>`,
    Gemma 4's channel) whose two markers are single tokens: elsewhere the plan says it was ignored."""
    ignored = budget is not None
    name = detect_reasoning(engine.chat_template_info) if parser_name == "auto" else parser_name
    if name == "harmony":
        return ReasoningPlan("harmony", needs_special_tokens=True, budget_ignored=ignored)
    if name not in BLOCK_MARKERS:
        return ReasoningPlan(budget_ignored=ignored)
    from engine.constraint import added_token_ids  # imports torch: not at `moe-serve --help`

    open_marker, close_marker = BLOCK_MARKERS[name]
    tail = engine.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    opened = tail.rstrip().endswith(open_marker)
    added = added_token_ids(engine.tokenizer)
    think, close = added.get(open_marker), added.get(close_marker)
    gated = params.grammar is not None
    if gated and (close is None or (think is None and not opened)):
        return ReasoningPlan(budget_ignored=ignored)
    plan = ReasoningPlan(name, opened_in_prompt=opened,
                         needs_special_tokens=think is not None and engine.decode([think]) == "",
                         grammar_after=close if gated else None,
                         grammar_may_open=think if gated and not opened else None)
    if budget is None:
        return plan
    if think is None or close is None:
        return replace(plan, budget_ignored=True)
    return replace(plan, thinking_budget=budget, thinking_end_ids=thinking_end_ids(engine, close, gated),
                   thinking_open=think, thinking_close=close)


def thinking_end_ids(engine, close: int, gated: bool) -> tuple[int, ...]:
    """The tokens that close a thinking block for the model, laid out as a model closes it itself: `</think>`
    as its one token (its text would tokenize otherwise). Under a grammar nothing follows it: the grammar
    decides what the answer starts with."""
    after = [] if gated else engine.encode("\n\n", add_special_tokens=False)
    return (*engine.encode("\n", add_special_tokens=False), close, *after)

