"""`--chat-template`: a template file or text in place of the model's own, for prompts, the tool and
reasoning parsers' auto-detection and Ollama's /api/show; a bad one ends the start with exit 1.

The model is a tiny random Mixtral, whose own template cannot take tools (like the demo model's).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from engine.api import GenerationRequest, InvalidRequestError, SamplingParams
from engine.chat_messages import prepare_messages
from engine.chat_template import ChatTemplateError, read_chat_template
from engine.config import EngineConfig
from server.config import load_config
from server.reasoning import detect_reasoning
from server.testing import RemoteServer
from server.tools import WARNING_HEADER
from tests.fixtures.models import build_checkpoint
from tests.fixtures.tokenizers import QWEN_TOOLS_TEMPLATE
from tests.test_cli import run_cli
from tests.test_server_tools import ASK, ONE_THREAD, TOOLS

# recognisably not Mixtral's [INST] ... [/INST]; <think> makes `--reasoning-parser auto` pick think
THINKING_TEMPLATE = ("{%- for m in messages %}<<{{ m.role }}>>{{ m.content }}{%- endfor %}"
                     "{%- if add_generation_prompt %}<<assistant>><think>{%- endif %}")


def rendered_ids(tokenizer, template: str, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    text = tokenizer.apply_chat_template(prepare_messages(messages, tool_template=True), tools=tools,
                                         chat_template=template, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    return build_checkpoint("mixtral", tmp_path_factory.mktemp("tiny-mixtral"), num_layers=1)


# -- reading the value --------------------------------------------------------------------------
def test_a_file_is_read_and_text_is_taken_as_is(tmp_path):
    file = tmp_path / "tools.jinja"
    file.write_text(QWEN_TOOLS_TEMPLATE, encoding="utf-8")
    assert read_chat_template(str(file)).text == QWEN_TOOLS_TEMPLATE
    assert read_chat_template(THINKING_TEMPLATE).text == THINKING_TEMPLATE
    assert read_chat_template("{{ 'x' * 300 }}" * 40).origin == "(template text)"  # too long to be a file name


@pytest.mark.parametrize("value, needle", [
    ("/no/such/template.jinja", "no such file"),
    ("{% for m in messages %}{{ m.content }}", "Jinja syntax error on line 1"),
    ("{{ messages[0].content }", "Jinja syntax error"),
])
def test_unusable_values_name_the_flag_and_the_reason(value, needle):
    with pytest.raises(ChatTemplateError, match=needle) as raised:
        read_chat_template(value)
    assert str(raised.value).startswith("--chat-template ")


def test_an_unreadable_or_empty_file_is_refused(tmp_path):
    with pytest.raises(ChatTemplateError, match="cannot read the file"):
        read_chat_template(str(tmp_path))  # a folder
    (tmp_path / "latin1.jinja").write_bytes(b"{{ '\xe9' }}")
    with pytest.raises(ChatTemplateError, match="cannot read the file"):
        read_chat_template(str(tmp_path / "latin1.jinja"))
    (tmp_path / "empty.jinja").write_text("\n")
    with pytest.raises(ChatTemplateError, match="empty"):
        read_chat_template(str(tmp_path / "empty.jinja"))


def test_env_and_yaml_forms(tmp_path):
    yaml_file = tmp_path / "config.yaml"
    yaml_file.write_text("chat_template: |\n  {{ messages[0].content }}\n", encoding="utf-8")
    _, engine = load_config(["--config", str(yaml_file)], {})
    assert engine.chat_template == "{{ messages[0].content }}\n"
    _, engine = load_config(["--config", str(yaml_file)], {"MOE_SERVE_CHAT_TEMPLATE": "/t/env.jinja"})
    assert engine.chat_template == "/t/env.jinja"
    _, engine = load_config(["--chat-template", "/t/flag.jinja"], {"MOE_SERVE_CHAT_TEMPLATE": "/t/env.jinja"})
    assert engine.chat_template == "/t/flag.jinja"


# -- start-up failures ------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["flag", "env", "yaml"])
def test_a_bad_template_ends_the_start_with_exit_1_before_the_model_loads(tmp_path, source):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% if messages %}unclosed", encoding="utf-8")
    value, reason = {"flag": (str(tmp_path / "missing.jinja"), "no such file"),
                     "env": (str(bad), "Jinja syntax error"),
                     "yaml": (str(bad), "Jinja syntax error")}[source]
    args, env = ["--model", str(tmp_path / "no-model"), "--port", "0"], {"MOE_SERVE_STATE_DIR": str(tmp_path)}
    if source == "flag":
        args += ["--chat-template", value]
    elif source == "env":
        env["MOE_SERVE_CHAT_TEMPLATE"] = value
    else:
        (tmp_path / "config.yaml").write_text(f"chat_template: {value}\n", encoding="utf-8")
        args += ["--config", str(tmp_path / "config.yaml")]
    result = run_cli(*args, env={**os.environ, **env})
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "--chat-template" in last and reason in last
    assert "does not exist" not in result.stderr  # the missing model was never reached


# -- in the engine ----------------------------------------------------------------------------
def test_inline_text_renders_the_prompt_and_picks_the_reasoning_parser(mixtral):
    from engine.engine import Engine

    engine = Engine.load(EngineConfig(model=str(mixtral), device="cpu", chat_template=THINKING_TEMPLATE))
    own = AutoTokenizer.from_pretrained(mixtral)
    prompt = engine.apply_chat_template(ASK)
    assert prompt == rendered_ids(own, THINKING_TEMPLATE, ASK)
    assert prompt != rendered_ids(own, own.chat_template, ASK)
    assert engine.chat_template_info.source == THINKING_TEMPLATE
    assert detect_reasoning(engine.chat_template_info) == "think"  # Mixtral's own: none
    events = list(engine.generate(GenerationRequest("r", prompt, SamplingParams(max_tokens=3, ignore_eos=True))))
    assert events[-1].finish_reason == "length"


# Mixtral-8x7B-Instruct's structure: one optional leading system message, then strictly alternating turns
STRICT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set turns = messages[1:] %}{%- else %}{%- set turns = messages %}{%- endif %}{{- bos_token }}"
    "{%- for m in turns %}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('roles must alternate user/assistant after an optional system message') }}{%- endif %}"
    "{%- if m['role'] == 'user' and loop.first and system is defined %}"
    "{{- ' [INST] ' + system + '\\n\\n' + m['content'] + ' [/INST]' }}"
    "{%- elif m['role'] == 'user' %}{{- ' [INST] ' + m['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' ' + m['content'] + eos_token }}{%- endif %}{%- endfor %}"
)


def test_a_template_that_refuses_a_late_system_message_gets_it_in_a_user_turn(mixtral):
    from engine.engine import Engine

    engine = Engine.load(EngineConfig(model=str(mixtral), device="cpu", chat_template=STRICT_TEMPLATE))
    own = AutoTokenizer.from_pretrained(mixtral)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "Name a fruit."}]
    folded = [*messages[:3], {"role": "user", "content": "Answer in French.\n\nName a fruit."}]
    assert engine.apply_chat_template(messages) == rendered_ids(own, STRICT_TEMPLATE, folded)
    with pytest.raises(InvalidRequestError, match="roles must alternate"):  # its other checks still hold
        engine.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


# -- through the server -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(mixtral, tmp_path_factory):
    file = tmp_path_factory.mktemp("templates") / "qwen-tools.jinja"
    file.write_text(QWEN_TOOLS_TEMPLATE, encoding="utf-8")
    srv = RemoteServer(["--model", str(mixtral), "--served-model-name", "tiny", "--device", "cpu",
                        "--chat-template", str(file)], env=ONE_THREAD)
    with srv:
        yield srv, AutoTokenizer.from_pretrained(mixtral), file


def test_the_file_renders_prompts_and_generation_runs(served):
    srv, tokenizer, file = served
    tokens = httpx.post(f"{srv.url}/tokenize", json={"messages": ASK}).json()["tokens"]
    assert tokens == rendered_ids(tokenizer, QWEN_TOOLS_TEMPLATE, ASK)
    assert tokens != rendered_ids(tokenizer, tokenizer.chat_template, ASK)
    answer = srv.openai().chat.completions.create(model="tiny", messages=ASK, max_tokens=3)
    assert answer.usage.prompt_tokens == len(tokens) and answer.choices[0].finish_reason == "length"
    assert f"chat template: {file} (--chat-template)" in srv.log()


def test_a_template_with_tools_takes_tools_and_picks_its_parser(served):
    srv, tokenizer, _ = served
    response = srv.openai().chat.completions.with_raw_response.create(model="tiny", messages=ASK, tools=TOOLS,
                                                                      max_tokens=2)
    assert WARNING_HEADER not in response.headers  # the model's own template cannot take tools
    assert response.parse().usage.prompt_tokens == len(rendered_ids(tokenizer, QWEN_TOOLS_TEMPLATE, ASK, TOOLS))
    shown = httpx.post(f"{srv.url}/api/show", json={"model": "tiny"}).json()
    assert shown["template"] == QWEN_TOOLS_TEMPLATE and "tools" in shown["capabilities"]


def test_auto_tool_parser_reads_the_given_template(served):
    srv, _, _ = served
    forced = srv.openai().chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                                  max_tokens=8, logprobs=True)
    written = "".join(t.token for t in forced.choices[0].logprobs.content)  # the grammar writes the parser's markup
    assert written.startswith("<tool_call>")  # hermes, from the template; by Mixtral's model type: [TOOL_CALLS]
