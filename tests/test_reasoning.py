"""Reasoning read out of recorded outputs (`<think>` blocks, GPT-OSS channels), whole and piece by
piece: the pieces add up to the same reasoning, content and calls, and nothing shown as one kind
later turns out to be another."""

from __future__ import annotations

import json

import openai
import pytest

from engine.api import ChatTemplateInfo, SamplingParams
from engine.chat_messages import prepare_messages
from server.reasoning import (
    OutputReader,
    Reasoning,
    ReasoningPlan,
    detect_reasoning,
    plan_reasoning,
)
from server.tool_parsers import PARSERS, ToolCall, ToolCallStream
from tests.test_server_faults import InProcessServer, ScriptedEngine, wait_for_health
from tests.test_tool_parsers import NAMES, TOOLS, splits

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. Easy.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny."
GEMMA4_CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
HARMONY_CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city": "Tokyo"}')

# (format, opened in the prompt, tool-call parser, recorded output, reasoning, content, calls)
CASES = [
    ("think", False, None, "<think>\nAdd two and two.\n</think>\n\nIt is 4.", "Add two and two.", "It is 4.", []),
    ("think", True, None, "Add two and two.\n</think>\n\nIt is 4.", "Add two and two.", "It is 4.", []),
    ("think", True, None, "\n\nAdd.</think>4", "Add.", "4", []),
    ("think", False, None, "It is 4.", "", "It is 4.", []),
    ("think", False, None, "\n<think>Add.</think>It is 4.", "Add.", "It is 4.", []),
    ("think", False, None, "Use the <think> tag. </think>", "", "Use the <think> tag. </think>", []),
    ("think", False, None, "<think>\nStill thinking when max_tokens ran out", "Still thinking when max_tokens ran out",
     "", []),
    ("think", False, None, "<think></think>\n\nNo thought needed.", "", "No thought needed.", []),
    ("think", False, None, "<thin", "", "<thin", []),
    ("think", False, "hermes", f"<think>I need the weather.</think>\n\n{CALL}", "I need the weather.", "",
     [("get_weather", {"city": "Paris"})]),
    ("think", False, "hermes", f"<think>Maybe {CALL} later.</think>Done.", f"Maybe {CALL} later.", "Done.", []),
    ("harmony", False, None, ANALYSIS + FINAL + "<|return|>", "The user wants the weather. Easy.", "It is sunny.", []),
    ("harmony", False, None, ANALYSIS + FINAL, "The user wants the weather. Easy.", "It is sunny.", []),
    ("harmony", False, None, "<|channel|>final<|message|>Hi.<|return|>", "", "Hi.", []),
    ("harmony", False, None, "<|channel|>commentary<|message|>Checking.<|end|>" + FINAL, "", "Checking.It is sunny.",
     []),
    ("harmony", False, None, "Plain text, no channels.", "", "Plain text, no channels.", []),
    ("harmony", False, "harmony", ANALYSIS + HARMONY_CALL + "<|call|>", "The user wants the weather. Easy.", "",
     [("get_weather", {"city": "Tokyo"})]),
    ("harmony", False, "harmony", ANALYSIS + HARMONY_CALL, "The user wants the weather. Easy.", "",
     [("get_weather", {"city": "Tokyo"})]),
    ("harmony", False, "harmony", ANALYSIS + FINAL, "The user wants the weather. Easy.", "It is sunny.", []),
    ("gemma4", False, None, "<|channel>thought\nAdd two and two.<channel|>It is 4.", "Add two and two.", "It is 4.",
     []),
    ("gemma4", False, None, "<|channel>thought\n\nthought: add.\n<channel|>\n\nIt is 4.", "thought: add.",
     "It is 4.", []),
    ("gemma4", False, None, "<|channel>thoughtful, I add.<channel|>4", "thoughtful, I add.", "4", []),
    ("gemma4", False, None, "<|channel>thought\n\nthought about it<channel|>4", "thought about it", "4", []),
    ("gemma4", False, None, "<|channel>thought<channel|>No thought needed.", "", "No thought needed.", []),
    ("gemma4", False, None, "<|channel>thought\nStill thinking when max_tokens ran out",
     "Still thinking when max_tokens ran out", "", []),
    ("gemma4", False, None, "It is 4.", "", "It is 4.", []),
    ("gemma4", False, None, "The <|channel> token. <channel|>", "", "The <|channel> token. <channel|>", []),
    ("gemma4", False, None, "<|chan", "", "<|chan", []),
    ("gemma4", False, None, "<|channel>thought", "", "", []),
    ("gemma4", False, "gemma4", f"<|channel>thought\nI need the weather.<channel|>{GEMMA4_CALL}",
     "I need the weather.", "", [("get_weather", {"city": "Paris"})]),
    ("gemma4", False, "gemma4", f"Sure.{GEMMA4_CALL}", "", "Sure.", [("get_weather", {"city": "Paris"})]),
    # Hunyuan-A13B: its answer wrapped in tags that are not part of it
    ("hunyuan", False, None, "<think>\nAdd two and two.\n</think>\n<answer>\nIt is **4**.\n</answer>",
     "Add two and two.", "It is **4**.", []),
    ("hunyuan", True, None, "Add.\n</think>\n<answer>\nLine one.\n\nLine two.\n</answer>\n", "Add.",
     "Line one.\n\nLine two.", []),
    ("hunyuan", False, None, "<answer>No thinking.</answer>", "", "No thinking.", []),
    ("hunyuan", False, None, "Plain answer, trailing blank \n", "", "Plain answer, trailing blank \n", []),
    ("hunyuan", False, None, "<think>Cut</think><answer>Half an ans", "Cut", "Half an ans", []),
    ("hunyuan", False, None, "<answer>Use the </ans tag</answer>", "", "Use the </ans tag", []),
    ("hunyuan", False, "hunyuan", '<think>Weather.</think>\n<answer>\n<tool_calls>[{"name": "get_weather", '
     '"arguments": {"city": "Paris"}}]</tool_calls>\n</answer>', "Weather.", "", [("get_weather", {"city": "Paris"})]),
    # Magistral, Mistral Small 4: control tokens, kept in the text read here
    ("mistral", False, None, "[THINK]Add two and two.[/THINK]It is 4.", "Add two and two.", "It is 4.", []),
    ("mistral", False, None, "[THINK]\nAdd.\n[/THINK]\n\nIt is 4.", "Add.", "It is 4.", []),
    ("mistral", False, None, "It is 4.", "", "It is 4.", []),  # reasoning off: no block
    ("mistral", False, None, "[THINK]Still thinking when max_tokens ran out", "Still thinking when max_tokens ran out",
     "", []),
    ("mistral", False, None, "Write [THINK] and [/THINK].", "", "Write [THINK] and [/THINK].", []),
    ("mistral", False, None, "[THI", "", "[THI", []),
    ("mistral", False, "mistral", '[THINK]I need the weather.[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
     "I need the weather.", "", [("get_weather", {"city": "Paris"})]),
    ("mistral", False, "mistral", '[THINK]Maybe [TOOL_CALLS]get_weather[ARGS]{}[/THINK]Done.',
     "Maybe [TOOL_CALLS]get_weather[ARGS]{}", "Done.", []),
]


def reader(fmt: str, opened: bool, parser: str | None) -> OutputReader:
    reasoning = ReasoningPlan(fmt, opened_in_prompt=opened).stream()
    calls = ToolCallStream(PARSERS[parser](TOOLS), NAMES) if parser else None
    return OutputReader(reasoning, calls)


def summary(out: list) -> tuple[str, str, list]:
    thought = "".join(p.text for p in out if isinstance(p, Reasoning))
    content = "".join(p for p in out if isinstance(p, str))
    calls = [(p.name, json.loads(p.arguments)) for p in out if isinstance(p, ToolCall)]
    return thought, content, calls


@pytest.mark.parametrize("fmt, opened, parser, text, thought, content, calls", CASES)
def test_recorded_output_read_whole_and_piece_by_piece(fmt, opened, parser, text, thought, content, calls):
    for pieces in splits(text):
        r = reader(fmt, opened, parser)
        out = [p for piece in pieces for p in r.feed(piece)] + r.finish()
        assert summary(out) == (thought, content, calls), pieces[:3]


@pytest.mark.parametrize("fmt, opened, parser, text, thought, content, calls", CASES)
def test_nothing_shown_as_one_kind_turns_out_to_be_another(fmt, opened, parser, text, thought, content, calls):
    r = reader(fmt, opened, parser)
    shown_thought = shown_content = ""
    for char in text:
        pieces = r.feed(char)
        shown_thought += "".join(p.text for p in pieces if isinstance(p, Reasoning))
        shown_content += "".join(p for p in pieces if isinstance(p, str))
        assert thought.startswith(shown_thought) and content.startswith(shown_content)


def test_reasoning_streams_as_it_is_written_not_at_its_end():
    r = reader("think", False, None)
    shown = [p.text for chunk in ("<think>", "Add ", "two", " and two.", "\n</think>") for p in r.feed(chunk)]
    assert shown == ["Add", " two", " and two."]  # a trailing blank waits for the next word
    r = reader("harmony", False, None)
    shown = [p.text for chunk in ("<|channel|>analysis<|message|>", "Add ", "two.") for p in r.feed(chunk)]
    assert shown == ["Add ", "two."]


# (format, opened in the prompt, the output's steps: each a token's text, or (text, tokens) where
# text held back for a stop string comes out with a later token, the reasoning tokens expected)
TOKEN_CASES = [
    ("think", False, ["<think>", "\n", "Add", " two", ".", "\n", "</think>", "\n\n", "It", " is", " 4."], 7),
    ("think", True, ["Add", ".", "</think>", "4"], 3),
    ("think", False, ["It", " is", " 4."], 0),
    ("think", False, ["<think>", "Still", " thinking"], 3),  # max_tokens ran out while thinking
    ("think", False, ["<think>", "</think>", "Hi"], 2),  # the markers are the thinking part
    ("think", False, ["<think>", "Hm", "</thi", "nk>\n\nIt", " is 4"], 4),  # a token across the end: thinking
    ("think", False, ["<think>", "Hm", ("", 1), ("</think>", 1), "It"], 4),  # `</th` held back, then out with `ink>`
    ("think", False, ["<think>", "Hm", "</think>", ("", 1), ("It", 1)], 3),
    ("think", False, ["Use", " <think>", " tags", "</think>"], 0),  # not at the start: not thinking
    ("harmony", False, ["<|channel|>", "analysis", "<|message|>", "Think", "<|end|>", "<|start|>", "assistant",
                        "<|channel|>", "final", "<|message|>", "Hi", "<|return|>"], 5),
    ("harmony", False, ["<|channel|>analysis<|message|>", "Hm"], 2),
    ("harmony", False, ["Plain", " text"], 0),
    ("gemma4", False, ["<|channel>", "thought", "\n", "Add", ".", "<channel|>", "It", " is", " 4."], 6),
    ("gemma4", False, ["<|channel>", "thought", "\n", "Hm"], 4),
    ("gemma4", False, ["It", " is", " 4."], 0),
    ("mistral", False, ["[THINK]", "Add", ".", "[/THINK]", "It", " is", " 4."], 4),
    ("mistral", False, ["It", " is", " 4."], 0),
]


@pytest.mark.parametrize("fmt, opened, steps, expected", TOKEN_CASES)
def test_reasoning_tokens_are_those_that_start_before_the_end_of_the_thinking(fmt, opened, steps, expected):
    plan = ReasoningPlan(fmt, opened_in_prompt=opened)
    counter = plan.token_counter()
    for step in steps:
        text, tokens = step if isinstance(step, tuple) else (step, 1)
        counter.add(text, tokens)
    assert counter.count() == expected
    assert counter.count() == expected  # asked again: the same
    assert ReasoningPlan().token_counter() is None  # no parser: no count


THINK_TEMPLATE = "{% if enable_thinking is false %}<think>\n\n</think>{% endif %}{{ content.split('</think>')[-1] }}"


@pytest.mark.parametrize("source, model_type, expected", [
    (THINK_TEMPLATE, "qwen3_moe", "think"),
    ("{{ '<|start|>assistant<|channel|>final<|message|>' }}", "gpt_oss", "harmony"),
    ("", "gpt_oss", "harmony"),
    ("{{ '<|im_start|>assistant\n' }}", "qwen2_moe", None),
    ("{{ '<|turn>model\n' }}{{ content.split('<channel|>')[-1] }}", "qwen3_moe", "gemma4"),
    ("{%- if '<|channel>' in content %}", "gemma4_text", "gemma4"),
    ("{{ '<|turn>model\n' }}", "gemma4", "gemma4"),
    ("{{ '<|turn>model\n' }}", "gemma4_text", "gemma4"),
    ("{{ '<|start|>assistant<|channel|>' }}", "gemma4", "harmony"),  # harmony's marker is not Gemma 4's
    ("{{ '<think>\n' + thought + '\n</think>\n<answer>\n' + answer + '\n</answer>' }}", "qwen3_moe", "hunyuan"),
    ("", "hunyuan_v1_moe", "hunyuan"),
    ("{%- if chunk.type == 'thinking' %}{{ '[THINK]' + chunk.thinking + '[/THINK]' }}", "mistral3", "mistral"),
    ("{{ '[INST]' + content + '[/INST]' }}", "mistral3", None),  # Mistral Small 3.1: no thinking
])
def test_the_format_is_detected_from_the_template_else_the_model_type(source, model_type, expected):
    assert detect_reasoning(ChatTemplateInfo(True, source, model_type)) == expected


class TailEngine:
    """What `plan_reasoning` asks of the engine: the template, decoding, the tokenizer's added tokens."""

    def __init__(self, source: str, prompt_text: str, think_special: bool = False,
                 markers: tuple[str, str] = ("<think>", "</think>")) -> None:
        self.chat_template_info = ChatTemplateInfo(False, source, "qwen3_moe")
        self.prompt_text, self.think_special, self.markers = prompt_text, think_special, markers
        added = {7: type("T", (), {"content": markers[0]}), 8: type("T", (), {"content": markers[1]})}
        self.tokenizer = type("Tokenizer", (), {"added_tokens_decoder": added})()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if ids == [7]:
            return "" if self.think_special and skip_special_tokens else self.markers[0]
        return self.prompt_text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [100 + ord(c) for c in text]  # one id per character, clear of the markers'


@pytest.mark.parametrize("prompt_text, opened", [("<|im_start|>assistant\n<think>\n", True),
                                                 ("<|im_start|>assistant\n", False),
                                                 ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False)])
def test_a_block_opened_by_the_template_is_seen_in_the_prompt(prompt_text, opened):
    plan = plan_reasoning("auto", TailEngine(THINK_TEMPLATE, prompt_text), SamplingParams(), [1, 2, 3])
    assert (plan.format, plan.opened_in_prompt, plan.needs_special_tokens) == ("think", opened, False)
    assert plan.sampling_params(SamplingParams()).skip_special_tokens


def test_a_special_think_token_is_kept_in_the_text_and_none_turns_reading_off():
    engine = TailEngine(THINK_TEMPLATE, "assistant\n", think_special=True)
    plan = plan_reasoning("auto", engine, SamplingParams(), [1])
    assert plan.needs_special_tokens and not plan.sampling_params(SamplingParams()).skip_special_tokens
    assert plan_reasoning("none", engine, SamplingParams(), [1]).format is None
    harmony = plan_reasoning("harmony", engine, SamplingParams(), [1])
    assert harmony.format == "harmony" and harmony.needs_special_tokens


GEMMA4_TEMPLATE = "{{ '<|turn>model\n' }}{{ content.split('<channel|>')[-1] }}"


@pytest.mark.parametrize("grammar", [None, 'start: "x"'])
def test_gemma4_thinking_keeps_its_special_tokens_takes_a_budget_and_a_grammar_after_it(grammar):
    engine = TailEngine(GEMMA4_TEMPLATE, "<|turn>model\n", think_special=True, markers=("<|channel>", "<channel|>"))
    params = SamplingParams(grammar=grammar)
    plan = plan_reasoning("auto", engine, params, [1], budget=64)
    assert (plan.format, plan.needs_special_tokens, plan.budget_ignored) == ("gemma4", True, False)
    assert (plan.thinking_budget, plan.thinking_open, plan.thinking_close) == (64, 7, 8)
    assert 8 in plan.thinking_end_ids  # `<channel|>` closes a block that runs past the budget
    assert (plan.grammar_after, plan.grammar_may_open) == ((8, 7) if grammar else (None, None))
    assert not plan.sampling_params(params).skip_special_tokens
    assert plan_reasoning("gemma4", engine, params, [1]).format == "gemma4"
    assert not plan_reasoning("auto", engine, params, [1]).budget_ignored  # none asked for
    as_text = TailEngine(GEMMA4_TEMPLATE, "<|turn>model\n", markers=("<|channel>", "<channel|>"))
    as_text.tokenizer.added_tokens_decoder = {}  # markers that are not single tokens: no budget to hold
    assert plan_reasoning("auto", as_text, SamplingParams(), [1], budget=64).budget_ignored


MISTRAL_TEMPLATE = "{{ '[THINK]' + thinking + '[/THINK]' if thinking }}{{ content }}"


def test_mistral_thinking_keeps_its_control_tokens_and_takes_a_budget():
    engine = TailEngine(MISTRAL_TEMPLATE, "[INST]Hi[/INST]", think_special=True, markers=("[THINK]", "[/THINK]"))
    plan = plan_reasoning("auto", engine, SamplingParams(), [1], budget=32)
    assert (plan.format, plan.opened_in_prompt, plan.needs_special_tokens) == ("mistral", False, True)
    assert (plan.thinking_budget, plan.thinking_open, plan.thinking_close) == (32, 7, 8)
    assert not plan.sampling_params(SamplingParams()).skip_special_tokens
    opened = TailEngine(MISTRAL_TEMPLATE, "[INST]Hi[/INST][THINK]", think_special=True, markers=("[THINK]", "[/THINK]"))
    assert plan_reasoning("auto", opened, SamplingParams(), [1]).opened_in_prompt


def test_under_a_grammar_a_block_opened_in_the_prompt_is_thought_freely_then_the_grammar_holds():
    grammar = SamplingParams(grammar='start: "x"')
    opened = plan_reasoning("auto", TailEngine(THINK_TEMPLATE, "assistant\n<think>\n"), grammar, [1])
    assert (opened.format, opened.opened_in_prompt, opened.grammar_after) == ("think", True, 8)  # `</think>`
    assert opened.sampling_params(grammar).grammar_after == 8
    assert plan_reasoning("auto", TailEngine(THINK_TEMPLATE, "assistant\n<think>\n"), SamplingParams(),
                          [1]).grammar_after is None  # no grammar: nothing to hold back
    assert opened.grammar_may_open is None  # already open


def test_under_a_grammar_a_model_may_open_thinking_with_its_first_token():
    grammar = SamplingParams(grammar='start: "x"')
    plan = plan_reasoning("auto", TailEngine(THINK_TEMPLATE, "assistant\n"), grammar, [1])
    assert (plan.format, plan.opened_in_prompt, plan.grammar_after, plan.grammar_may_open) == ("think", False, 8, 7)
    assert (plan.sampling_params(grammar).grammar_after, plan.sampling_params(grammar).grammar_may_open) == (8, 7)
    markers_as_text = TailEngine(THINK_TEMPLATE, "assistant\n")
    markers_as_text.tokenizer.added_tokens_decoder = {}  # no single tokens to watch for: the grammar holds at once
    assert plan_reasoning("auto", markers_as_text, grammar, [1]).format is None


# -- a real server on a tiny Qwen3-style thinking model ------------------------------------------
ASK = [{"role": "user", "content": "What is two plus two?"}]
GREEDY = {"max_tokens": 12, "temperature": 0}
THINKING_PROMPT = "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n<think>\n"  # ASK, templated


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    from server.testing import RemoteServer
    from tests.fixtures.models import build_checkpoint

    folder = build_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3-thinking"), tokenizer="qwen3_thinking")
    with RemoteServer(["--model", str(folder), "--device", "cpu"], env={"OMP_NUM_THREADS": "1"}) as server:
        yield server


def completion_text(server, prompt: str) -> str:
    """The same greedy tokens, read raw through /v1/completions."""
    client = server.openai()
    return client.completions.create(model=client.models.list().data[0].id, prompt=prompt, **GREEDY,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_thinking_opened_by_the_template_comes_back_as_reasoning(thinking_server):
    client = thinking_server.openai()
    model = client.models.list().data[0].id
    raw = completion_text(thinking_server, THINKING_PROMPT)
    before, closed, after = raw.partition("</think>")
    expected = (before.strip(), after.lstrip() if closed else "")

    message = client.chat.completions.create(model=model, messages=ASK, **GREEDY,
                                             extra_body={"ignore_eos": True}).choices[0].message
    assert (message.reasoning_content, message.content) == expected and message.reasoning == expected[0]
    assert expected[0]  # the tiny model wrote something to read

    thought = content = ""
    for chunk in client.chat.completions.create(model=model, messages=ASK, **GREEDY, stream=True,
                                                extra_body={"ignore_eos": True}):
        delta = chunk.choices[0].delta if chunk.choices else None
        thought += getattr(delta, "reasoning_content", None) or ""
        content += (delta.content or "") if delta else ""
    assert (thought, content) == expected


def test_enable_thinking_false_reaches_the_template_and_the_answer_is_content(thinking_server):
    client = thinking_server.openai()
    model = client.models.list().data[0].id
    raw = completion_text(thinking_server, "<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
                                           "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not raw.lstrip().startswith("<think>")
    message = client.chat.completions.create(model=model, messages=ASK, **GREEDY, extra_body={
        "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert message.content == raw and "reasoning_content" not in (message.model_extra or {})


def test_chat_template_kwargs_cannot_override_what_the_server_sets(thinking_server):
    import httpx

    response = httpx.post(f"{thinking_server.url}/v1/chat/completions", timeout=30, json={
        "messages": ASK, "max_tokens": 2, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs" and "add_generation_prompt" in error["message"]


def raw_tokens(client, model: str, **kwargs) -> list[str]:
    """The tokens the chat request for ASK writes, read raw through /v1/completions (one string per token)."""
    return client.completions.create(model=model, prompt=THINKING_PROMPT, logprobs=0, **kwargs,
                                     extra_body={"ignore_eos": True}).choices[0].logprobs.tokens


def thinking_tokens(tokens: list[str]) -> int:
    """`</think>` is one token of this tokenizer: it and the tokens before it are the thinking part."""
    return tokens.index("</think>") + 1 if "</think>" in tokens else len(tokens)


def closing_sampler(client, model: str) -> dict:
    """Sampling under which the tiny model thinks a few tokens, then closes its thinking and answers: a bias
    on `</think>` and a seed, found by trying (greedy, it never closes or closes at once; its logits are
    near flat over a 151k vocabulary, so the bias that makes `</think>` likely is about 10)."""
    from tests.fixtures.tokenizers import build_tokenizer

    close = build_tokenizer("qwen3_thinking").convert_tokens_to_ids("</think>")
    for bias in (10, 9, 11):
        for seed in range(10):
            sampler = {"max_tokens": 12, "temperature": 1.0, "seed": seed, "logit_bias": {str(close): bias}}
            if 2 < thinking_tokens(raw_tokens(client, model, **sampler)) < sampler["max_tokens"] - 1:
                return sampler
    pytest.fail("no bias and seed make the tiny model close its thinking after it began")


def test_reasoning_tokens_count_the_tokens_up_to_the_end_of_the_thinking(thinking_server):
    client = thinking_server.openai()
    model = client.models.list().data[0].id
    sampler = closing_sampler(client, model)
    raw = raw_tokens(client, model, **sampler)
    kwargs = {"model": model, "messages": ASK, **sampler, "extra_body": {"ignore_eos": True}}

    response = client.chat.completions.create(**kwargs)
    assert response.choices[0].message.reasoning_content and response.usage.completion_tokens == len(raw)
    assert response.usage.completion_tokens_details.reasoning_tokens == thinking_tokens(raw)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thinking_tokens(raw)

    both = client.chat.completions.create(**kwargs, n=2)  # choice 1 samples with seed + 1
    second = raw_tokens(client, model, **{**sampler, "seed": sampler["seed"] + 1})
    assert both.usage.completion_tokens_details.reasoning_tokens == thinking_tokens(raw) + thinking_tokens(second)

    greedy = raw_tokens(client, model, **GREEDY)
    assert "</think>" not in greedy  # greedy, it thinks up to max_tokens: all of it is thinking
    unclosed = client.chat.completions.create(model=model, messages=ASK, **GREEDY, extra_body={"ignore_eos": True})
    assert unclosed.usage.completion_tokens_details.reasoning_tokens == len(greedy)


def test_reasoning_tokens_are_0_with_thinking_off_and_left_out_where_no_parser_reads(thinking_server):
    import httpx

    response = httpx.post(f"{thinking_server.url}/v1/chat/completions", timeout=30, json={
        "messages": ASK, **GREEDY, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert response["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}  # read, and none found
    plain = httpx.post(f"{thinking_server.url}/v1/completions", timeout=30, json={"prompt": "Hi", "max_tokens": 2})
    assert "completion_tokens_details" not in plain.json()["usage"]  # completions are not read for thinking


# -- what reaches the template ------------------------------------------------------------------
class TemplateRecorder(ScriptedEngine):
    """Records what the chat template is given; answers as the fault tests' scripted engine."""

    def __init__(self) -> None:
        super().__init__(fail=False)
        self.messages: list[dict] = []
        self.template_kwargs: dict | None = None

    def apply_chat_template(self, messages, tools=None, template_kwargs=None, continue_final=False) -> list[int]:
        self.messages, self.template_kwargs = prepare_messages(messages, tool_template=False), template_kwargs
        return [1, 2, 3]


def test_past_thinking_and_reasoning_effort_reach_the_template():
    engine = TemplateRecorder()
    with InProcessServer(lambda: engine) as srv:
        wait_for_health(srv.url, 200)
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        history = [{"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "4.", "reasoning_content": "Two and two make four."},
                   {"role": "user", "content": "And 3+3?"}]
        client.chat.completions.create(model="scripted", messages=history, reasoning_effort="high")
        assert engine.template_kwargs == {"reasoning_effort": "high"}
        assert engine.messages[1] == {"role": "assistant", "content": "4.", "reasoning_content": "Two and two make four.",
                                      "thinking": "Two and two make four."}  # Qwen3's name and GPT-OSS's
        client.chat.completions.create(model="scripted", messages=history[:1], reasoning_effort="low",
                                       extra_body={"chat_template_kwargs": {"reasoning_effort": "medium", "x": 1}})
        assert engine.template_kwargs == {"reasoning_effort": "medium", "x": 1}  # the explicit variable wins


def test_json_output_of_a_thinking_model_follows_its_thinking(thinking_server):
    from tests.fixtures.tokenizers import build_tokenizer

    close = build_tokenizer("qwen3_thinking").convert_tokens_to_ids("</think>")
    schema = {"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"], "additionalProperties": False}
    client = thinking_server.openai()
    response = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=ASK, max_tokens=30, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        logit_bias={str(close): 100})  # the tiny model closes its (empty) thinking at once
    message = response.choices[0].message
    assert json.loads(message.content) == {"a": 1} and response.choices[0].finish_reason == "stop"
    assert "reasoning_content" not in (message.model_extra or {})  # nothing thought: no field
    # `</think>` (free: a grammar from the first token would forbid it), the JSON, the end of sequence
    assert response.usage.completion_tokens == 1 + len(build_tokenizer("qwen3_thinking").encode(message.content)) + 1


def test_an_unknown_reasoning_effort_is_a_400(thinking_server):
    import httpx

    response = httpx.post(f"{thinking_server.url}/v1/chat/completions", timeout=30,
                          json={"messages": ASK, "max_tokens": 2, "reasoning_effort": "extreme"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "reasoning_effort"
