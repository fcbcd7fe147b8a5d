"""Chat messages with tool calls and tool results, as templates with and without tools get them."""

from __future__ import annotations

import pytest

from engine.api import InvalidRequestError
from engine.chat_messages import fold_late_system_messages, prepare_messages, template_info, with_system_text

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]


def test_tool_template_gets_calls_with_mapping_arguments_and_tool_turns():
    out = prepare_messages(HISTORY, tool_template=True)
    assert out[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert out[2] == {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}


def test_plain_template_gets_calls_and_results_as_alternating_text_turns():
    out = prepare_messages(HISTORY, tool_template=False)
    assert out == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": 'Tool call get_weather({"city": "Paris"})'},
        {"role": "user", "content": "Result of tool call call_1:\n21 C\n\nThanks. And tomorrow?"},
    ]


def test_two_results_in_a_row_are_one_user_turn_named_by_the_function():
    results = [{"role": "tool", "tool_call_id": "a", "name": "f", "content": "1"},
               {"role": "tool", "tool_call_id": "b", "content": "2"}]
    out = prepare_messages(HISTORY[:2] + results, tool_template=False)
    assert out[-1] == {"role": "user", "content": "Result of tool call f:\n1\n\nResult of tool call b:\n2"}


def test_arguments_that_are_not_a_json_object_stay_text():
    call = {**CALL, "function": {"name": "f", "arguments": "not json"}}
    out = prepare_messages([{"role": "assistant", "content": "x", "tool_calls": [call]}], tool_template=True)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == "not json"


@pytest.mark.parametrize("message, param", [
    ({"role": "assistant", "content": None}, "messages[0].content"),  # no content and no calls
    ({"role": "user", "content": None, "tool_calls": [CALL]}, "messages[0].content"),  # only assistants call
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}, "messages[0].tool_calls[0]"),
    ({"role": "tool", "content": 5}, "messages[0].content"),
    ({"role": "function", "content": "x"}, "messages[0].role"),
])
def test_bad_tool_messages_are_refused(message, param):
    with pytest.raises(InvalidRequestError) as e:
        prepare_messages([message], tool_template=True)
    assert e.value.param == param


@pytest.mark.parametrize("template, supports", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", False),
    ("{% if message.tool_calls %}{{ message.tool_calls }}{% endif %}", False),  # history only, no tool list
    ("{% if tools %}{{ tools | tojson }}{% endif %}", True),
    ({"default": "{{ messages }}", "tool_use": "{{ messages }}"}, True),
    ("{{ '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' }}", True),  # DeepSeek-V3: the server adds the list
    (None, False),
])
def test_tool_support_is_read_from_the_template(template, supports):
    assert template_info(template, "any").supports_tools is supports


def test_system_text_joins_the_system_message_or_leads_as_one():
    user = {"role": "user", "content": "Hi"}
    assert with_system_text([user], "TOOLS") == [{"role": "system", "content": "TOOLS"}, user]
    system = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    assert with_system_text([system, user], "TOOLS") == [{"role": "system", "content": "Be brief.\n\nTOOLS"}, user]


def test_late_system_messages_join_the_next_user_turn_or_else_the_last_one():
    first = {"role": "system", "content": "Be brief."}
    ask, answer = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}
    late = {"role": "system", "content": "Tools: none."}
    assert fold_late_system_messages([first, ask, answer]) is None
    assert fold_late_system_messages([first, ask, answer, late, {"role": "user", "content": "Go"}]) == [
        first, ask, answer, {"role": "user", "content": "Tools: none.\n\nGo"}]
    # Claude Code's shape: the instruction after the user turn it belongs to
    assert fold_late_system_messages([ask, late]) == [{"role": "user", "content": "Hi\n\nTools: none."}]
    assert fold_late_system_messages([ask, late, late]) == [
        {"role": "user", "content": "Hi\n\nTools: none.\n\nTools: none."}]
    assert fold_late_system_messages([first, late]) is None  # no user turn to carry it
