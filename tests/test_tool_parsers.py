"""Tool-call parsers on recorded outputs of each format (whole, malformed, cut short), read at once
and token by token: the streamed pieces must add up to the same content and calls, and no content
may ever show a marker that later turns out to be a call."""

from __future__ import annotations

import json

import pytest

from engine.api import ChatTemplateInfo
from server.tool_parsers import PARSERS, ToolCall, ToolCallStream, detect_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "options": {"type": "object"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
NAMES = frozenset({"get_weather", "get_time"})


def read(parser_name: str, pieces: list[str], max_calls: int | None = None) -> tuple[list, ToolCallStream]:
    stream = ToolCallStream(PARSERS[parser_name](TOOLS), NAMES, max_calls)
    out = [p for piece in pieces for p in stream.feed(piece)] + stream.finish()
    return out, stream


def summary(out: list) -> tuple[str, list[tuple[str, dict]]]:
    content = "".join(p for p in out if isinstance(p, str))
    calls = [(p.name, json.loads(p.arguments)) for p in out if isinstance(p, ToolCall)]
    return content, calls


def splits(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and in chunks of 2, 3 and 7."""
    return [[text], list(text)] + [[text[i: i + n] for i in range(0, len(text), n)] for n in (2, 3, 7)]


# (parser, recorded output, expected content, expected calls)
CASES = [
    # Hermes (Qwen2.5 / Qwen3)
    ("hermes", 'The weather:\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "The weather:", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    ("hermes", '<tool_call>\n{"name": "get_time", "parameters": {}}\n</tool_call>', "", [("get_time", {})]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>', "",
     [("get_time", {"tz": "UTC"})]),
    ("hermes", 'No tools needed: 2 < 3 and <b>bold</b>.', "No tools needed: 2 < 3 and <b>bold</b>.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by max_tokens
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', []),
    ("hermes", '<tool_call>\n{"name": get_weather}\n</tool_call> then text',  # not JSON
     '<tool_call>\n{"name": get_weather}\n</tool_call> then text', []),
    ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not offered
     '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n',  # unclosed at the end, yet whole
     "", [("get_time", {})]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>',  # arguments not an object
     '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>', []),
    ("hermes", 'Ends with a partial marker <tool_ca', "Ends with a partial marker <tool_ca", []),
    # Mistral
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {}}]', "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Oslo"}', "",
     [("get_weather", {"city": "Oslo"})]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Pa',
     'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Pa', []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather"}, 7]', '[TOOL_CALLS] [{"name": "get_weather"}, 7]', []),
    ("mistral", '[TOOL_CALLS] no call here', '[TOOL_CALLS] no call here', []),
    # DeepSeek-V3 and V3.1
    ("deepseek_v3", "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
     '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
     "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome"}'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", [("get_weather", {"city": "Rome"})]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"city": "Par', "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"city": "Par', []),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>garbage<｜tool▁calls▁end｜> after",
     "<｜tool▁calls▁begin｜>garbage<｜tool▁calls▁end｜> after", []),
    # GPT-OSS harmony
    ("harmony", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Tokyo"}', "",
     [("get_weather", {"city": "Tokyo"})]),
    ("harmony", '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>', "",
     [("get_time", {})]),
    ("harmony", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
     "It is sunny.", "It is sunny.", []),
    ("harmony", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": ',
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": ', []),
    ("harmony", "<|channel|>analysis<|start|>", "<|channel|>analysis<|start|>", []),
    # GLM-4.5
    ("glm45", "I will look it up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>"
     "\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
     "I will look it up.", [("get_weather", {"city": "Beijing", "days": 3})]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>1984</arg_value>\n</tool_call>"
     "<tool_call>get_time\n</tool_call>", "", [("get_weather", {"city": "1984"}), ("get_time", {})]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Bei",
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Bei", []),
    ("glm45", "<tool_call>get weather now\n</tool_call>", "<tool_call>get weather now\n</tool_call>", []),
    # Qwen3-Coder, Qwen3.5 MoE, Nemotron 3 Nano
    ("qwen3_coder", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
     "Let me check.", [("get_weather", {"city": "Paris", "days": 2})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n1984\n</parameter>\n</function>\n"
     "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     "", [("get_weather", {"city": "1984"}), ("get_time", {})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n\nSão\nPaulo\n\n</parameter>\n"
     '<parameter=options>\n{"units": "metric", "alerts": true}\n</parameter>\n</function>\n</tool_call>',
     "", [("get_weather", {"city": "\nSão\nPaulo\n", "options": {"units": "metric", "alerts": True}})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",  # cut by max_tokens
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", []),
    ("qwen3_coder", "<tool_call>\n<function=get weather>\n</function>\n</tool_call> then text",
     "<tool_call>\n<function=get weather>\n</function>\n</tool_call> then text", []),
    ("qwen3_coder", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # Hermes' form
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', []),
    # MiniMax-M2
    ("minimax_m2", 'Sure.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
     '<parameter name="days">2</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>',
     "Sure.", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Rio de\nJaneiro'
     '</parameter>\n<parameter name="options">{"units": "metric"}</parameter>\n</invoke>\n</minimax:tool_call>',
     "", [("get_weather", {"city": "Rio de\nJaneiro", "options": {"units": "metric"}})]),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">2049</parameter>\n'
     '</invoke>\n</minimax:tool_call>', "", [("get_weather", {"city": "2049"})]),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Par',
     '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Par', []),
    ("minimax_m2", "<minimax:tool_call>\n<invoke>get_weather</invoke>\n</minimax:tool_call> then text",
     "<minimax:tool_call>\n<invoke>get_weather</invoke>\n</minimax:tool_call> then text", []),
    # Kimi-K2, Kimi-Linear
    ("kimi_k2", "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|><|tool_call_begin|>'
     "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
     "Checking.", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    ("kimi_k2", "<|tool_calls_section_begin|>\n<|tool_call_begin|>get_weather<|tool_call_argument_begin|>"
     '{\n  "city": "Oslo\\nNorway",\n  "options": {"units": "metric"}\n}<|tool_call_end|>\n<|tool_calls_section_end|>',
     "", [("get_weather", {"city": "Oslo\nNorway", "options": {"units": "metric"}})]),
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
     '{"city": "1984"}<|tool_call_end|><|tool_calls_section_end|>', "", [("get_weather", {"city": "1984"})]),
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
     '{"city": "Pa', '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
     '<|tool_call_argument_begin|>{"city": "Pa', []),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
     "{city: Paris}<|tool_call_end|><|tool_calls_section_end|> then text",
     "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
     "{city: Paris}<|tool_call_end|><|tool_calls_section_end|> then text", []),
    # Gemma 4
    ("gemma4", 'Let me check.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>'
     "<|tool_call>call:get_time{}<tool_call|>",
     "Let me check.", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,options:{units:<|"|>metric<|"|>,alerts:true,'
     'levels:[1,2.5,-3e2],tags:[<|"|>a<|"|>,{k:null}],extra:false}}<tool_call|>', "",
     [("get_weather", {"city": "Oslo", "options": {"units": "metric", "alerts": True, "levels": [1, 2.5, -300.0],
                                                    "tags": ["a", {"k": None}], "extra": False}})]),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>a, b: {c} [d] "e"<|"|>}<tool_call|>', "",
     [("get_weather", {"city": 'a, b: {c} [d] "e"'})]),
    ("gemma4", "<|tool_call>call:get_weather{city:1984, days:3}<tool_call|>", "",  # a bare number for a string
     [("get_weather", {"city": "1984", "days": 3})]),
    ("gemma4", '<|tool_call>call:get_weather{city: "São Paulo", "days": 2}<tool_call|>', "",  # plain quotes
     [("get_weather", {"city": "São Paulo", "days": 2})]),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Par',  # cut by max_tokens
     '<|tool_call>call:get_weather{city:<|"|>Par', []),
    ("gemma4", "<|tool_call>call:get_weather{city:Paris}<tool_call|> then text",  # a bare word
     "<|tool_call>call:get_weather{city:Paris}<tool_call|> then text", []),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,}<tool_call|>',  # a trailing comma
     '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,}<tool_call|>', []),
    ("gemma4", '<|tool_call>get_weather{city:<|"|>Paris<|"|>}<tool_call|>',  # no `call:`
     '<|tool_call>get_weather{city:<|"|>Paris<|"|>}<tool_call|>', []),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>} and more<tool_call|>',
     '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>} and more<tool_call|>', []),
    ("gemma4", "Plain <tool_call> text and a partial <|tool_ca", "Plain <tool_call> text and a partial <|tool_ca", []),
    # Granite 3: a JSON list after <|tool_call|>; Granite 3.1 may write it in an unclosed <tool_call> (hermes)
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
     '"arguments": {}}]', "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("granite", 'Checking.<|tool_call|>{"name": "get_time", "arguments": {}}', "Checking.", [("get_time", {})]),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Par', '<|tool_call|>[{"name": '
     '"get_weather", "arguments": {"city": "Par', []),
    ("granite", '<|tool_call|>[{"name": "get_time", "arguments": {}}, 3]', '<|tool_call|>[{"name": "get_time", '
     '"arguments": {}}, 3]', []),
    ("hermes", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", '
     '"arguments": {}}]', "", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    # LFM2: a Python list of calls between two special tokens; a JSON list between them too
    ("lfm2", 'Sure.<|tool_call_start|>[get_weather(city="Paris", days=2), get_time()]<|tool_call_end|>', "Sure.",
     [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    ("lfm2", '<|tool_call_start|>[{"name": "get_time", "arguments": {}}]<|tool_call_end|>', "", [("get_time", {})]),
    ("lfm2", '<|tool_call_start|>[get_weather(city=Paris)]<|tool_call_end|> then', '<|tool_call_start|>'
     '[get_weather(city=Paris)]<|tool_call_end|> then', []),  # a bare name: text
    ("lfm2", '<|tool_call_start|>[get_weather(city="Par', '<|tool_call_start|>[get_weather(city="Par', []),
    # Hunyuan-A13B: a JSON list in a <tool_calls> block
    ("hunyuan", 'I will check.\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": '
     '"get_time", "arguments": {}}]</tool_calls>', "I will check.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hunyuan", '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Par', '<tool_calls>[{"name": '
     '"get_weather", "arguments": {"city": "Par', []),
    ("hunyuan", '<tool_calls>[{"name": "get_time"}] and more</tool_calls>', '<tool_calls>[{"name": "get_time"}] and '
     'more</tool_calls>', []),
    # Llama 4: JSON as its shipped template asks (the <|python_start|> tokens around it are dropped by the
    # decoder), and the Python-style list of Meta's prompt format
    ("llama4", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "",
     [("get_weather", {"city": "Paris", "days": 2})]),
    ("llama4", 'Let me look.\n\n{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", '
     '"parameters": {}}', "Let me look.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("llama4", '{"name": "get_time", "parameters": {}}\n{ "name": "get_weather", "arguments": {"city": "Rome"}}', "",
     [("get_time", {}), ("get_weather", {"city": "Rome"})]),
    ("llama4", '{"type": "function", "name": "get_time", "parameters": {}}', "", [("get_time", {})]),
    ("llama4", '[get_weather(city="San Francisco", days=3, options={"units": "metric", "alerts": true}), get_time()]',
     "", [("get_weather", {"city": "San Francisco", "days": 3, "options": {"units": "metric", "alerts": True}}),
          ("get_time", {})]),
    ("llama4", "[get_weather(city='O\\'Hare (ORD)', days=-1, options={'list': [1, 2.5, None, False]})]", "",
     [("get_weather", {"city": "O'Hare (ORD)", "days": -1, "options": {"list": [1, 2.5, None, False]}})]),
    ("llama4", "See [1] and [the docs](x), a list [a, b] and [f(x)].", "See [1] and [the docs](x), a list [a, b] and "
     "[f(x)].", []),  # brackets that are not calls, one a call with a positional argument
    ("llama4", "[get_weather(city=Paris)]", "[get_weather(city=Paris)]", []),  # a bare name as a value
    ("llama4", "[get_weather(city=open('/etc/passwd').read())]", "[get_weather(city=open('/etc/passwd').read())]",
     []),  # an expression is never run
    ("llama4", '[rm_rf(path="/")]', '[rm_rf(path="/")]', []),  # not offered
    ("llama4", '{"name": "get_weather", "parameters": {"city": "Par', '{"name": "get_weather", "parameters": '
     '{"city": "Par', []),  # cut by max_tokens
    ("llama4", '[get_weather(city="Par', '[get_weather(city="Par', []),
    ("llama4", '{"name": get_weather} and {"name": "x"} then', '{"name": get_weather} and {"name": "x"} then', []),
    ("llama4", 'The JSON {"name": "Ada", "age": 36} is a person.', 'The JSON {"name": "Ada", "age": 36} is a person.',
     []),
]
KIMI = {c[1]: c for c in CASES if c[0] == "kimi_k2"}


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_recorded_output_read_whole_and_piece_by_piece(parser, text, content, calls):
    for pieces in splits(text):
        out, stream = read(parser, pieces)
        assert summary(out) == (content, calls), pieces[:3]
        assert [c.index for c in stream.calls] == list(range(len(calls)))


@pytest.mark.parametrize("parser, text, content, calls", [c for c in CASES if c[3]])
def test_no_marker_is_shown_as_content_before_the_call_is_decided(parser, text, content, calls):
    shown = ""
    stream = ToolCallStream(PARSERS[parser](TOOLS), NAMES)
    for char in text:
        shown += "".join(p for p in stream.feed(char) if isinstance(p, str))
        assert content.startswith(shown)  # never more than the final content: nothing to retract


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = CASES[1][1]
    out, stream = read("hermes", [text], max_calls=1)
    assert summary(out) == ("", [("get_weather", {"city": "Paris", "days": 2})])


def test_call_ids_are_unique_and_mistral_ids_have_nine_alphanumerics():
    _, stream = read("hermes", [CASES[1][1]])
    assert len({c.id for c in stream.calls}) == 2 and all(c.id.startswith("call_") for c in stream.calls)
    _, stream = read("mistral", [CASES[12][1]])
    assert all(len(c.id) == 9 and c.id.isalnum() for c in stream.calls)


def test_kimi_call_ids_are_the_ones_the_model_wrote_unless_repeated():
    two = next(text for text, case in KIMI.items() if len(case[3]) == 2)
    _, stream = read("kimi_k2", [two])
    assert [c.id for c in stream.calls] == ["functions.get_weather:0", "functions.get_time:1"]
    _, stream = read("kimi_k2", list(two.replace("functions.get_time:1", "functions.get_weather:0")))  # repeated
    first, second = stream.calls
    assert first.id == "functions.get_weather:0" and second.id.startswith("call_")


def test_trailing_blanks_of_plain_content_are_kept():
    out, _ = read("hermes", ["Hello ", "world \n"])
    assert summary(out) == ("Hello world \n", [])


@pytest.mark.parametrize("source, model_type, expected", [
    ("... <tool_call>\n{{ tool | tojson }} ... tools", "qwen3_moe", "hermes"),
    ("{{ tools }} <tool_call>{{ name }}<arg_key>", "glm4_moe", "glm45"),
    ("{{ tools }} [TOOL_CALLS]", "mixtral", "mistral"),
    ("{{ tools }} <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", "deepseek_v3", "deepseek_v3"),
    ("{{ tools }} to=functions.", "gpt_oss", "harmony"),
    ("{{ tools }} <tool_call>\n<function=example_function_name>\n<parameter=", "qwen3_moe", "qwen3_coder"),
    ("{{ tools }}", "qwen3_5_moe", "qwen3_coder"),
    ("{{ tools }}", "qwen3_5_moe_text", "qwen3_coder"),
    ("{{ tools }}", "nemotron_h", "qwen3_coder"),
    ("{{ tools }} <minimax:tool_call>\n<invoke name=", "minimax_m2", "minimax_m2"),
    ("{{ tools }}", "minimax_m2", "minimax_m2"),
    ("{{ tools }} <|tool_calls_section_begin|><|tool_call_begin|>", "deepseek_v3", "kimi_k2"),
    ("{{ tools }}", "kimi_k2", "kimi_k2"),
    ("{{ tools }}", "kimi_linear", "kimi_k2"),
    ("{{ tools }}<|tool_call>call:{{ name }}{<|\"|>...<tool_call|> <tool_call>", "gemma4_text", "gemma4"),
    ("{{ tools }}<|tool_call>call:", "qwen3_moe", "gemma4"),
    ("{{ tools }}", "gemma4", "gemma4"),
    ("{{ tools }}", "gemma4_text", "gemma4"),
    ("{{ tools }}<|python_start|>{{- '{\"name\": \"' }}", "llama4", "llama4"),
    ("{{ tools }} Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
     "value}.", "qwen3_moe", "llama4"),
    ("{{ tools }}", "llama4_text", "llama4"),
    ("{{ tools }} respond with <|tool_call|> followed by a JSON list", "granitemoe", "granite"),
    ("{{ tools }}", "granitemoeshared", "granite"),
    ("{{ tools }}", "granitemoehybrid", "hermes"),
    ("{{ tools }} <tool_calls>[{{ call | tojson }}]</tool_calls> <tool_call>", "qwen3_moe", "hunyuan"),
    ("{{ tools }}", "hunyuan_v1_moe", "hunyuan"),
    ("List of tools: <|tool_list_start|>{{ tools | tojson }}<|tool_list_end|>", "qwen3_moe", "lfm2"),
    ("{{ tools }}", "lfm2_moe", "lfm2"),
    ("{{ tools }}", "qwen2_moe", "hermes"),
    ("{{ tools }}", "qwen3_vl_moe", "hermes"),  # multimodal models: their language model's format
    ("{{ tools }}", "glm4v_moe", "glm45"),
    ("{{ tools }}", "kimi_k25", "kimi_k2"),
    ("{{ tools }}", "mistral3", "mistral"),
    ("{{ tools }}", "mistral_large4", "mistral"),
    ("{{ tools }}", "olmoe", None),
])
def test_parser_detected_from_template_then_model_type(source, model_type, expected):
    assert detect_parser(ChatTemplateInfo(True, source, model_type)) == expected


def test_a_tool_list_written_into_the_prompt_shows_the_parameters_as_declared():
    """The model reads the schema the request sent; the grammar's reading of it (objects closed, integers
    bounded) is for decoding only."""
    declared = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    tools = [{"type": "function", "function": {"name": "count", "description": "Counts", "parameters": declared}}]
    text = PARSERS["deepseek_v3"]().prompt_tools(tools)
    assert f"Parameters: {json.dumps(declared)}\n" in text
