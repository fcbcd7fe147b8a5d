"""A thinking budget: after that many tokens inside a `<think>` block the block is closed for the model
(the sampler writes its end ids), at the sampler, through the engine on a tiny thinking model, and
through the server's three sources (chat's `thinking_token_budget`, Anthropic's `budget_tokens`,
`--reasoning-budget`)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from engine.api import GenerationRequest, InvalidRequestError, SamplingParams
from engine.sampling import Sampler

V = 10
CPU = torch.device("cpu")
OPEN, CLOSE = 4, 6  # `<think>`, `</think>`
END = (5, CLOSE, 7)  # "\n", `</think>`, "\n\n"


def budgeted(budget: int | None, opened: bool = True) -> SamplingParams:
    if budget is None:
        return SamplingParams(temperature=0)
    return SamplingParams(temperature=0, thinking_budget=budget, thinking_end_ids=END, thinking_close=CLOSE,
                          thinking_open=OPEN, thinking_open_at_start=opened)


def run_sampler(params: SamplingParams, favourites: list[int]) -> list[int]:
    """Greedy steps whose logits favour `favourites[i]` at step i."""
    sampler = Sampler(params, [0], V, CPU)
    out = []
    for favourite in favourites:
        logits = torch.zeros(V)
        logits[favourite] = 5.0
        token = sampler.sample(logits)
        sampler.observe(token)
        out.append(token)
    return out


def test_budget_lets_that_many_tokens_through_then_writes_the_end_then_frees_the_model():
    assert run_sampler(budgeted(3), [1] * 9) == [1, 1, 1, *END, 1, 1, 1]


def test_the_model_closing_its_thinking_within_the_budget_is_left_alone():
    assert run_sampler(budgeted(3), [1, CLOSE, 1, 1, 1, 1, 1]) == [1, CLOSE, 1, 1, 1, 1, 1]


def test_budget_0_with_the_block_open_closes_it_at_once():
    assert run_sampler(budgeted(0), [1] * 5) == [*END, 1, 1]


def test_counting_starts_when_the_model_opens_the_block_itself():
    assert run_sampler(budgeted(2, opened=False), [2, OPEN, 1, 1, 1, 1, 1, 1, 1]) == [2, OPEN, 1, 1, *END, 1, 1]
    assert run_sampler(budgeted(0, opened=False), [OPEN, 1, 1, 1, 1]) == [OPEN, *END, 1]
    assert run_sampler(budgeted(1, opened=False), [1] * 6) == [1] * 6  # never opened: nothing to close


def test_no_budget_chooses_as_before_and_forced_tokens_are_observed_by_the_penalties():
    assert run_sampler(budgeted(None), [1] * 6) == [1] * 6
    params = SamplingParams(temperature=0, presence_penalty=2, thinking_budget=0, thinking_end_ids=END,
                            thinking_close=CLOSE, thinking_open_at_start=True)
    sampler = Sampler(params, [0], V, CPU)
    for _ in range(3):
        sampler.observe(sampler.sample(torch.zeros(V)))
    assert sampler.output_counts[list(END)].tolist() == [1, 1, 1]


@pytest.mark.parametrize("kw", [{"thinking_budget": -1, "thinking_end_ids": END, "thinking_close": CLOSE},
                                {"thinking_budget": 2, "thinking_end_ids": (5,), "thinking_close": CLOSE}])
def test_a_budget_below_0_or_without_the_closing_token_is_refused(kw):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == "thinking_budget"


# -- through the engine, on a tiny Qwen3-style thinking model -----------------------------------
THINKING_PROMPT = "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n<think>\n"
PLAIN_PROMPT = "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.fixtures.models import build_checkpoint

    return build_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3-thinking"), tokenizer="qwen3_thinking")


@pytest.fixture(scope="module")
def engine(checkpoint):
    from engine.config import EngineConfig
    from engine.engine import Engine

    return Engine.load(EngineConfig(model=str(checkpoint), device="cpu"))


def markers(engine) -> tuple[int, int, tuple[int, ...]]:
    from engine.constraint import added_token_ids
    from server.reasoning import thinking_end_ids

    added = added_token_ids(engine.tokenizer)
    think, close = added["<think>"], added["</think>"]
    return think, close, thinking_end_ids(engine, close, gated=False)


def generated(engine, prompt: str, budget: int | None = None, opened: bool = True, **params) -> list[int]:
    think, close, end = markers(engine)
    if budget is not None:
        params.update(thinking_budget=budget, thinking_end_ids=end, thinking_close=close, thinking_open=think,
                      thinking_open_at_start=opened)
    request = GenerationRequest("t", engine.encode(prompt), SamplingParams(max_tokens=10, temperature=0,
                                                                           ignore_eos=True, **params))
    return [t for event in engine.generate(request) for t in event.token_ids]


def test_the_end_ids_are_a_newline_the_single_close_token_and_a_blank_line(engine):
    _, close, end = markers(engine)
    assert engine.decode(list(end)) == "\n</think>\n\n" and close in end
    assert engine.encode("\n", add_special_tokens=False) + [close] == list(end[: end.index(close) + 1])


def test_engine_writes_the_budget_of_free_tokens_then_the_end_then_goes_on(engine):
    _, close, end = markers(engine)
    free = generated(engine, THINKING_PROMPT)
    assert close not in free  # greedy, the tiny model never closes its thinking by itself
    assert generated(engine, THINKING_PROMPT, budget=None) == free  # no budget: the same tokens
    out = generated(engine, THINKING_PROMPT, budget=3)
    assert out[:3] == free[:3] and out[3: 3 + len(end)] == list(end) and len(out) == 10
    assert generated(engine, THINKING_PROMPT, budget=0)[: len(end)] == list(end)


def test_engine_leaves_a_closed_block_alone_and_counts_from_the_models_own_open(engine):
    think, close, end = markers(engine)
    closing = generated(engine, THINKING_PROMPT, budget=2, logit_bias={close: 100})
    assert closing == [close] * 10  # closed at once, by the model: nothing forced after it
    opening = generated(engine, PLAIN_PROMPT, budget=2, opened=False, logit_bias={think: 100})
    assert opening == [think] * 3 + list(end) + [think] * (10 - 3 - len(end))


def test_forced_tokens_have_their_logprobs_as_the_chosen_token(engine):
    _, _, end = markers(engine)
    think, close, _ = markers(engine)
    request = GenerationRequest("t", engine.encode(THINKING_PROMPT), SamplingParams(
        max_tokens=len(end), temperature=0, top_logprobs=1, thinking_budget=0, thinking_end_ids=end,
        thinking_close=close, thinking_open=think, thinking_open_at_start=True))
    logprobs = [lp for event in engine.generate(request) for lp in event.logprobs]
    assert [lp.token_id for lp in logprobs] == list(end) and all(lp.logprob <= 0 for lp in logprobs)


# -- through the server --------------------------------------------------------------------------
ASK = [{"role": "user", "content": "What is two plus two?"}]
GREEDY = {"max_tokens": 12, "temperature": 0}
BUDGET = 4


@pytest.fixture(scope="module")
def server(checkpoint):
    """A thinking model served with `--reasoning-budget 0`: no thinking unless a request asks for a budget."""
    from server.testing import RemoteServer

    with RemoteServer(["--model", str(checkpoint), "--device", "cpu", "--reasoning-budget", "0"],
                      env={"OMP_NUM_THREADS": "1"}) as srv:
        yield srv


def free_thinking(srv) -> list[str]:
    """The greedy tokens the model writes in the block the template opened, read raw (no budget there)."""
    client = srv.openai()
    return client.completions.create(model=client.models.list().data[0].id, prompt=THINKING_PROMPT, logprobs=0,
                                     **GREEDY, extra_body={"ignore_eos": True}).choices[0].logprobs.tokens


def test_chat_thinking_token_budget_bounds_the_reasoning_and_the_answer_follows(server):
    client = server.openai()
    model = client.models.list().data[0].id
    expected = "".join(free_thinking(server)[:BUDGET]).strip()
    kwargs = {"model": model, "messages": ASK, **GREEDY,
              "extra_body": {"ignore_eos": True, "thinking_token_budget": BUDGET}}

    response = client.chat.completions.create(**kwargs)
    message = response.choices[0].message
    assert message.reasoning_content == expected and message.content
    newline = len(server_tokenizer().encode("\n"))
    # the budget's tokens, then "\n" and `</think>`: the thinking; the blank line after it is not
    assert response.usage.completion_tokens_details.reasoning_tokens == BUDGET + newline + 1
    assert response.usage.completion_tokens == GREEDY["max_tokens"]

    thought = content = ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        thought += getattr(delta, "reasoning_content", None) or ""
        content += (delta.content or "") if delta else ""
    assert (thought, content) == (expected, message.content)


def server_tokenizer():
    from tests.fixtures.tokenizers import build_tokenizer

    return build_tokenizer("qwen3_thinking")


def test_reasoning_budget_flag_0_answers_without_thinking(server):
    client = server.openai()
    model = client.models.list().data[0].id
    response = client.chat.completions.create(model=model, messages=ASK, **GREEDY, extra_body={"ignore_eos": True})
    message = response.choices[0].message
    assert "reasoning_content" not in (message.model_extra or {}) and message.content
    assert response.usage.completion_tokens_details.reasoning_tokens == len(server_tokenizer().encode("\n")) + 1

    with server.http() as http:  # the Responses API and Ollama's take the server's budget too
        out = http.post("/v1/responses", json={"input": "What is two plus two?", "max_output_tokens": 12,
                                               "temperature": 0}).json()["output"]
        assert [item["type"] for item in out] == ["message"]
        reply = http.post("/api/chat", json={"model": model, "messages": ASK, "stream": False,
                                             "options": {"num_predict": 12, "temperature": 0}}).json()
        assert not reply["message"].get("thinking") and reply["message"]["content"]


def test_anthropic_budget_tokens_ends_the_thinking_block_before_the_text(server):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    expected = "".join(free_thinking(server)[:BUDGET]).strip()
    model = server.openai().models.list().data[0].id
    message = client.messages.create(model=model, messages=ASK, max_tokens=12, extra_body={"temperature": 0},
                                     thinking={"type": "enabled", "budget_tokens": BUDGET})
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == expected and message.content[1].text
    with client.messages.stream(model=model, messages=ASK, max_tokens=12, extra_body={"temperature": 0},
                                thinking={"type": "enabled", "budget_tokens": BUDGET}) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None)) for b in streamed.content] == [("thinking", expected),
                                                                                  ("text", None)]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 2, "thinking_token_budget": -1}, "thinking_token_budget"),
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 2, "thinking_token_budget": "5"},
     "thinking_token_budget"),
    ("/v1/messages", {"messages": ASK, "max_tokens": 2, "thinking": {"type": "enabled", "budget_tokens": 0}},
     "thinking.budget_tokens"),
    ("/v1/messages", {"messages": ASK, "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 8}},
     "thinking.budget_tokens"),
])
def test_a_bad_budget_is_a_400_naming_its_field(server, path, body, param):
    response = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"].get("param", param) == param and param in response.text


def test_a_budget_for_a_model_without_a_think_block_is_ignored_with_a_warning():
    from server.tools import WARNING_HEADER
    from tests.test_server_faults import InProcessServer, ScriptedEngine, wait_for_health

    with InProcessServer(lambda: ScriptedEngine(fail=False)) as srv:
        wait_for_health(srv.url, 200)
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(model="scripted", messages=ASK,
                                                               extra_body={"thinking_token_budget": 8})
        assert "thinking token budget was ignored" in raw.headers[WARNING_HEADER]
        assert raw.parse().choices[0].message.content == "ab"
        plain = client.chat.completions.with_raw_response.create(model="scripted", messages=ASK)
        assert WARNING_HEADER not in plain.headers


# -- the plan: when a budget holds, and what closes the block ---------------------------------------
class MarkerEngine:
    """What `plan_reasoning` asks of the engine, with `<think>` = 7, `</think>` = 8, "\\n" = 1, "\\n\\n" = 2."""

    def __init__(self, source: str = "<think></think>", markers: bool = True) -> None:
        from engine.api import ChatTemplateInfo

        self.chat_template_info = ChatTemplateInfo(False, source, "qwen3_moe")
        added = {7: type("T", (), {"content": "<think>"}), 8: type("T", (), {"content": "</think>"})}
        self.tokenizer = type("Tokenizer", (), {"added_tokens_decoder": added if markers else {}})()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "<think>" if ids == [7] else "assistant\n<think>\n"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return [{"\n": 1, "\n\n": 2}[text]]


def test_the_plan_carries_the_budget_and_the_end_ids_into_the_sampling():
    from server.reasoning import plan_reasoning

    plan = plan_reasoning("auto", MarkerEngine(), SamplingParams(), [1], budget=5)
    params = plan.sampling_params(SamplingParams())
    assert (params.thinking_budget, params.thinking_end_ids, params.thinking_open, params.thinking_close,
            params.thinking_open_at_start) == (5, (1, 8, 2), 7, 8, True)
    gated = plan_reasoning("auto", MarkerEngine(), SamplingParams(grammar='start: "x"'), [1], budget=5)
    assert gated.thinking_end_ids == (1, 8)  # the grammar decides what follows `</think>`
    assert plan_reasoning("auto", MarkerEngine(), SamplingParams(), [1]).sampling_params(
        SamplingParams()).thinking_budget is None


@pytest.mark.parametrize("engine, parser", [(MarkerEngine(), "harmony"), (MarkerEngine(""), "auto"),
                                            (MarkerEngine(markers=False), "auto"), (MarkerEngine(), "none")])
def test_a_budget_is_ignored_and_said_so_without_a_think_block_of_single_tokens(engine, parser):
    from server.reasoning import plan_reasoning

    plan = plan_reasoning(parser, engine, SamplingParams(), [1], budget=5)
    assert plan.budget_ignored and plan.sampling_params(SamplingParams()).thinking_budget is None
    assert not plan_reasoning(parser, engine, SamplingParams(), [1]).budget_ignored


def test_the_server_budget_is_minus_1_for_unlimited_or_at_least_0():
    from server.config import ServerConfig

    assert ServerConfig().reasoning_budget == -1 and ServerConfig(reasoning_budget=0).reasoning_budget == 0
    with pytest.raises(ValueError, match="reasoning-budget"):
        ServerConfig(reasoning_budget=-2)
