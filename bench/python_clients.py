"""The Python client libraries users reach local servers with, against real moe-serve processes, end to end.

Install the clients (not the project's venv; aider pins its own litellm and openai, so it gets a venv apart):
    python3 -m venv /tmp/clients-venv && /tmp/clients-venv/bin/pip install litellm langchain-openai \
        langchain-ollama ollama llm
    /tmp/clients-venv/bin/pip install 'pydantic-ai-slim[openai]' instructor dspy 'smolagents[openai]' \
        openai-agents llama-index-core llama-index-llms-openai-like llama-index-llms-ollama \
        llama-index-embeddings-openai llama-index-embeddings-ollama
    /tmp/clients-venv/bin/pip install haystack-ai ollama-haystack
    /tmp/clients-venv/bin/pip install autogen-agentchat 'autogen-ext[openai]'
    /tmp/clients-venv/bin/pip install semantic-kernel langgraph
(one group at a time: all at once, pip backtracks through litellm releases for a long while)
    python3 -m venv /tmp/aider-venv && /tmp/aider-venv/bin/pip install aider-chat
shell-gpt, gptme and CrewAI pin openai<3 (and CrewAI an older pydantic), so each gets a venv apart too:
    python3 -m venv /tmp/sgpt-venv && /tmp/sgpt-venv/bin/pip install shell-gpt click
    python3 -m venv /tmp/gptme-venv && /tmp/gptme-venv/bin/pip install gptme
    python3 -m venv /tmp/crewai-venv && /tmp/crewai-venv/bin/pip install crewai
Run (from the repository root; the clients run in /tmp/clients-venv, each server is a subprocess of the project's
.venv running this file with --serve):
    /tmp/clients-venv/bin/python bench/python_clients.py [--only litellm,ollama,...] [--out FILE]

Two servers: the built-in demo model (plain chat, streamed and not) and a scripted engine on a Qwen2.5 tool
template (tool calls and structured output: the demo model never calls a tool), which calls `get_weather` when the
prompt offers it, quotes a tool result when the last turn is one (or calls `final_answer` with it, smolagents'
way to end), calls `Person` (or `PartialPerson`) when offered (a structured output by function calling) and
otherwise writes a Person as JSON under a grammar (a JSON schema), or where the prompt asks for it the way DSPy's
adapters and instructor's MD_JSON do (without a grammar, as a model would follow its prompt). Each server
is wrapped in a recorder that keeps every request's method, path, status, JSON body keys and (non-2xx) the
answer's start; it is read from `GET /_bench/requests`. Prints one JSON object: per library and call, passed,
the detail or the exception, and the requests seen.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = "moe-serve/smollm2-moe-demo"
SCRIPTED = "scripted-qwen"
ASK = [{"role": "user", "content": "Say hello in five words."}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"name": "Ada", "age": 36}
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_RESULT = "sunny, 21 C"
N = 16  # tokens the demo model writes per answer


# ---------------------------------------------------------------- the servers (run with the project's venv)

def tool_call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def scripted_answer(prompt: str, grammar: str | None) -> str:
    last = prompt.rsplit("<|im_start|>", 2)[-2:][0]  # the turn before the generation prompt (or a raw prompt)
    # smolagents sends a tool's result as a user turn, "Observation:\n..." (its design, vLLM gets the same)
    result = (re.search(r"<tool_response>\n(.*?)\n</tool_response>", last, re.S)
              or re.search(r"Observation:\n(.*?)\s*<\|im_end\|>", last, re.S))
    if result:
        if '"name": "final_answer"' in prompt:  # smolagents ends a run only by this tool
            return tool_call("final_answer", {"answer": f"The tool said: {result.group(1)}"})
        return f"The tool said: {result.group(1)}"
    # (instructor's streamed Partial offers the Person function as "PartialPerson", Semantic Kernel its
    # kernel functions as "plugin-function")
    calls = {r"[\w-]*get_weather": {"city": "Paris"}, r"\w*Person": PERSON}
    # only the functions offered now (LangGraph's last, structured step has an earlier call in its history)
    tools = "".join(re.findall(r"<tools>(.*?)</tools>", prompt, re.S))
    for name, arguments in calls.items():
        if offered := re.search(f'"name": "({name})"', tools):
            return tool_call(offered.group(1), arguments)
    if "[[ ## completed ## ]]" in last:  # DSPy's ChatAdapter: each output field under its marker
        return "".join(f"[[ ## {k} ## ]]\n{v}\n\n" for k, v in PERSON.items()) + "[[ ## completed ## ]]"
    if "Respond with a JSON object" in last:  # DSPy's JSONAdapter, which sends no response_format here
        return json.dumps(PERSON)
    if "```json" in last:  # asked for a JSON code block (instructor's MD_JSON): a model writes one
        return f"```json\n{json.dumps(PERSON)}\n```"
    return json.dumps(PERSON) if grammar else "Hello from the scripted model."


def scripted_engine():
    from bench.scripted_engine import ScriptedEngine
    from tests.fixtures.tokenizers import QWEN_TOOLS_TEMPLATE

    class Scripted(ScriptedEngine):
        grammar: str | None = None

        def answer(self, prompt: str) -> str:
            return scripted_answer(prompt, self.grammar)

        def generate(self, request, should_abort):
            self.grammar = request.params.grammar
            return super().generate(request, should_abort)

    return Scripted(SCRIPTED, "qwen", QWEN_TOOLS_TEMPLATE)


class Recorder:
    """ASGI middleware: each request's method, path, status, JSON body keys; `GET /_bench/requests` lists them."""

    def __init__(self, app) -> None:
        self.app = app
        self.seen: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] == "/_bench/requests":
            body = json.dumps(self.seen).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            return await send({"type": "http.response.body", "body": body})
        chunks: list[bytes] = []
        headers = dict(scope["headers"])
        row: dict = {"method": scope["method"], "path": scope["path"],
                     "type": headers.get(b"content-type", b"").decode(errors="replace")}

        async def receive_body():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        async def record(message) -> None:
            if message["type"] == "http.response.start":
                try:
                    body = json.loads(b"".join(chunks) or b"null")
                    row["keys"] = sorted(body) if isinstance(body, dict) else None
                except ValueError:
                    row["keys"] = "not JSON"
                row["status"] = message["status"]
                self.seen.append(row)
            elif message["type"] == "http.response.body" and row.get("status", 200) >= 400 and "answer" not in row:
                row["answer"] = message.get("body", b"")[:300].decode(errors="replace")
                row["body"] = b"".join(chunks)[:600].decode(errors="replace")
            await send(message)

        await self.app(scope, receive_body, record)


def serve(kind: str, port: int) -> None:
    import logging

    import uvicorn

    from engine.config import EngineConfig
    from server.app import create_app
    from server.config import ServerConfig, load_config

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if kind == "demo":
        server_config, engine_config = load_config(["--port", str(port)])
        app = create_app(server_config, engine_config)
    else:
        engine = scripted_engine()
        app = create_app(ServerConfig(port=port), EngineConfig(), load_engine=lambda: engine)
    uvicorn.run(Recorder(app), host="127.0.0.1", port=port, log_level="warning")


# ---------------------------------------------------------------- the clients (run with /tmp/clients-venv)

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def start(kind: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(Path(tempfile.gettempdir()) / f"python_clients_{kind}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([str(ROOT / ".venv/bin/python"), str(Path(__file__).resolve()), "--serve", kind,
                             "--port", str(port)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if get_json(f"{url}/health") is not None:
                return proc, url
        except Exception:  # noqa: BLE001 - not up yet
            if proc.poll() is not None:
                sys.exit(f"the {kind} server exited; see {log.name}")
            time.sleep(0.5)
    sys.exit(f"the {kind} server did not get ready; see {log.name}")


def person_class():
    from pydantic import BaseModel, ConfigDict

    class Person(BaseModel):
        """A person."""
        model_config = ConfigDict(extra="forbid")
        name: str
        age: int

    return Person


def expect(ok: bool, detail) -> str:
    if not ok:
        raise AssertionError(f"unexpected: {detail!r}"[:500])
    return str(detail)[:300]


def unit_vectors(vectors: list[list[float]], count: int) -> str:
    """`count` distinct vectors of the demo model's hidden size, each of length 1 (the API normalizes them)."""
    norms = [sum(x * x for x in v) ** 0.5 for v in vectors]
    ok = (len(vectors) == count and all(len(v) == len(vectors[0]) > 0 for v in vectors)
          and all(abs(n - 1) < 1e-4 for n in norms) and len({tuple(v) for v in vectors}) == count)
    return expect(ok, (len(vectors), [len(v) for v in vectors], norms))


TEXTS = ["A cat sat on the mat.", "The stock market fell today."]


def litellm_checks(demo: str, scripted: str) -> dict:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list (offline machines)
    import litellm

    def chat(model, base, stream=False, **kw):
        out = litellm.completion(model=model, api_base=base, api_key="unused", stream=stream, **kw)
        if not stream:
            return out.choices[0].message
        chunks = list(out)
        return litellm.stream_chunk_builder(chunks, messages=kw.get("messages")).choices[0].message

    def text(model, base, stream):
        message = chat(model, base, stream, messages=ASK, max_tokens=N, temperature=0)
        return expect(bool(message.content), message.content)

    def tools(model, base, stream):
        message = chat(model, base, stream, messages=WEATHER_ASK, tools=[WEATHER_TOOL])
        call = (message.tool_calls or [None])[0]
        return expect(call is not None and call.function.name == "get_weather"
                      and json.loads(call.function.arguments) == {"city": "Paris"}, message)

    def schema(stream, response_format):
        message = chat(f"openai/{SCRIPTED}", f"{scripted}/v1", stream, messages=ASK, response_format=response_format)
        return expect(json.loads(message.content) == PERSON, message.content)

    json_schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    checks = {}
    for stream in (False, True):
        s = "stream" if stream else "no stream"
        checks[f"openai/ chat, {s}"] = lambda st=stream: text(f"openai/{DEMO}", f"{demo}/v1", st)
        checks[f"openai/ tools, {s}"] = lambda st=stream: tools(f"openai/{SCRIPTED}", f"{scripted}/v1", st)
        checks[f"openai/ response_format json_schema, {s}"] = lambda st=stream: schema(st, json_schema)
        checks[f"openai/ response_format pydantic, {s}"] = lambda st=stream: schema(st, person_class())
        checks[f"ollama_chat/ chat, {s}"] = lambda st=stream: text(f"ollama_chat/{DEMO}", demo, st)
        checks[f"ollama_chat/ tools, {s}"] = lambda st=stream: tools(f"ollama_chat/{SCRIPTED}", scripted, st)
        checks[f"ollama/ generate, {s}"] = lambda st=stream: text(f"ollama/{DEMO}", demo, st)
        checks[f"hosted_vllm/ chat, {s}"] = lambda st=stream: text(f"hosted_vllm/{DEMO}", f"{demo}/v1", st)
        checks[f"hosted_vllm/ tools, {s}"] = lambda st=stream: tools(f"hosted_vllm/{SCRIPTED}", f"{scripted}/v1", st)

    def embedding(model, base):
        out = litellm.embedding(model=model, api_base=base, api_key="unused", input=TEXTS)
        return unit_vectors([row["embedding"] for row in out.data], len(TEXTS))

    checks["openai/ embedding"] = lambda: embedding(f"openai/{DEMO}", f"{demo}/v1")
    checks["ollama/ embedding"] = lambda: embedding(f"ollama/{DEMO}", demo)
    checks["hosted_vllm/ embedding"] = lambda: embedding(f"hosted_vllm/{DEMO}", f"{demo}/v1")
    return checks


def langchain_tool_round_trip(chat_model, streamed: bool) -> str:
    """A LangChain chat model calls get_weather (invoked, or streamed and its chunks added up), then quotes the
    tool's result."""
    from langchain_core.messages import HumanMessage, ToolMessage

    bound = chat_model.bind_tools([WEATHER_TOOL])
    history = [HumanMessage(WEATHER_ASK[0]["content"])]
    if streamed:
        first = None
        for chunk in bound.stream(history):
            first = chunk if first is None else first + chunk
    else:
        first = bound.invoke(history)
    expect(len(first.tool_calls) == 1 and first.tool_calls[0]["args"] == {"city": "Paris"}, first)
    history += [first, ToolMessage(TOOL_RESULT, tool_call_id=first.tool_calls[0]["id"])]
    second = bound.invoke(history)
    return expect(TOOL_RESULT in second.content, second.content)


def langchain_openai_checks(demo: str, scripted: str) -> dict:
    from langchain_openai import ChatOpenAI, OpenAI, OpenAIEmbeddings

    Person = person_class()
    plain = ChatOpenAI(model=DEMO, base_url=f"{demo}/v1", api_key="unused", max_tokens=N, temperature=0)
    scripted_llm = ChatOpenAI(model=SCRIPTED, base_url=f"{scripted}/v1", api_key="unused")
    embedder = OpenAIEmbeddings(model=DEMO, base_url=f"{demo}/v1", api_key="unused", check_embedding_ctx_length=False)

    def invoke():
        return expect(bool((message := plain.invoke(ASK)).content), message.content)

    def stream():
        pieces = [c.content for c in plain.stream(ASK)]
        return expect(bool("".join(pieces)), pieces)

    def round_trip(streamed: bool):
        return langchain_tool_round_trip(scripted_llm, streamed)

    def structured(**kw):
        out = scripted_llm.with_structured_output(Person, **kw).invoke(ASK)
        return expect(isinstance(out, Person) and out.model_dump() == PERSON, out)

    def completions(streamed: bool):
        llm = OpenAI(model=DEMO, base_url=f"{demo}/v1", api_key="unused", max_tokens=N, temperature=0)
        out = "".join(llm.stream("Once upon a time")) if streamed else llm.invoke("Once upon a time")
        return expect(bool(out), out)

    return {
        "ChatOpenAI invoke": invoke, "ChatOpenAI stream": stream,
        "bind_tools round trip, invoke": lambda: round_trip(False),
        "bind_tools round trip, stream": lambda: round_trip(True),
        "with_structured_output default": structured,
        "with_structured_output json_schema": lambda: structured(method="json_schema"),
        "with_structured_output function_calling": lambda: structured(method="function_calling"),
        "with_structured_output json_mode": lambda: structured(method="json_mode"),
        "OpenAI (completions) invoke": lambda: completions(False),
        "OpenAI (completions) stream": lambda: completions(True),
        # its default tokenizes with tiktoken (a download, and ids of another vocabulary): the README says to turn it off
        "OpenAIEmbeddings embed_documents, embed_query": lambda: unit_vectors(
            [*embedder.embed_documents(TEXTS[:1]), embedder.embed_query(TEXTS[1])], len(TEXTS)),
    }


def langchain_ollama_checks(demo: str, scripted: str) -> dict:
    from langchain_ollama import ChatOllama, OllamaEmbeddings

    Person = person_class()
    plain = ChatOllama(model=DEMO, base_url=demo, num_predict=N, temperature=0)

    def tools(streamed: bool):
        return langchain_tool_round_trip(ChatOllama(model=SCRIPTED, base_url=scripted), streamed)

    def formatted():
        out = ChatOllama(model=SCRIPTED, base_url=scripted, format=PERSON_SCHEMA).invoke(ASK)
        return expect(json.loads(out.content) == PERSON, out.content)

    def structured(**kw):
        out = ChatOllama(model=SCRIPTED, base_url=scripted).with_structured_output(Person, **kw).invoke(ASK)
        return expect(isinstance(out, Person) and out.model_dump() == PERSON, out)

    return {
        "ChatOllama invoke": lambda: expect(bool((m := plain.invoke(ASK)).content), m.content),
        "ChatOllama stream": lambda: expect(bool(p := "".join(c.content for c in plain.stream(ASK))), p),
        "bind_tools round trip, invoke": lambda: tools(False),
        "bind_tools round trip, stream": lambda: tools(True),
        "format=json schema": formatted,
        "with_structured_output default": structured,
        "with_structured_output function_calling": lambda: structured(method="function_calling"),
        "OllamaEmbeddings embed_documents": lambda: unit_vectors(
            OllamaEmbeddings(model=DEMO, base_url=demo).embed_documents(TEXTS), len(TEXTS)),
    }


def ollama_checks(demo: str, scripted: str) -> dict:
    import ollama

    client, tool_client = ollama.Client(host=demo), ollama.Client(host=scripted)
    options = {"num_predict": N, "temperature": 0}

    def tools(streamed: bool):
        messages = list(WEATHER_ASK)
        if streamed:
            calls = [c for part in tool_client.chat(SCRIPTED, messages=messages, tools=[WEATHER_TOOL], stream=True)
                     for c in part.message.tool_calls or []]
        else:
            calls = tool_client.chat(SCRIPTED, messages=messages, tools=[WEATHER_TOOL]).message.tool_calls or []
        expect(len(calls) == 1 and calls[0].function.arguments == {"city": "Paris"}, calls)
        messages += [{"role": "assistant", "content": "", "tool_calls": [c.model_dump() for c in calls]},
                     {"role": "tool", "content": TOOL_RESULT, "tool_name": "get_weather"}]
        second = tool_client.chat(SCRIPTED, messages=messages, tools=[WEATHER_TOOL])
        return expect(TOOL_RESULT in second.message.content, second.message.content)

    def names(listing):
        return [m.model for m in listing.models]

    return {
        "chat": lambda: expect(bool((r := client.chat(DEMO, messages=ASK, options=options)).message.content), r),
        "chat stream": lambda: expect(bool(t := "".join(p.message.content for p in client.chat(
            DEMO, messages=ASK, options=options, stream=True))), t),
        "generate": lambda: expect(bool((r := client.generate(DEMO, "Once upon a time", options=options)).response),
                                   r.response),
        "generate stream": lambda: expect(bool(t := "".join(p.response for p in client.generate(
            DEMO, "Once upon a time", options=options, stream=True))), t),
        "list": lambda: expect(DEMO in (n := names(client.list())) or f"{DEMO}:latest" in n, n),
        "show": lambda: expect(bool((r := client.show(DEMO)).modelinfo) and r.details is not None, r.details),
        "ps": lambda: expect(len(n := names(client.ps())) == 1, n),
        "tools round trip": lambda: tools(False),
        "tools round trip, stream": lambda: tools(True),
        "format=json schema": lambda: expect(json.loads((r := tool_client.chat(
            SCRIPTED, messages=ASK, format=PERSON_SCHEMA)).message.content) == PERSON, r.message.content),
        "embed": lambda: unit_vectors(client.embed(DEMO, input=TEXTS).embeddings, len(TEXTS)),
        # the older route: one vector, not normalized (as Ollama's)
        "embeddings": lambda: expect(len(v := client.embeddings(DEMO, prompt=TEXTS[0]).embedding) > 0
                                     and abs(sum(x * x for x in v) - 1) > 1e-3, len(v)),
    }


def run_cli(args: list[str], env: dict | None = None, cwd=None, stdin: str | None = None,
            timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, env={**os.environ, **(env or {})}, cwd=cwd, input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def llm_checks(demo: str, scripted: str) -> dict:
    home = Path(tempfile.mkdtemp(prefix="llm-home-"))
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: moe-demo\n  model_name: {DEMO}\n  api_base: {demo}/v1\n", encoding="utf-8")
    binary = str(Path(sys.executable).with_name("llm"))
    env = {"LLM_USER_PATH": str(home), "OPENAI_API_KEY": "unused"}

    def prompt(*extra: str):
        done = run_cli([binary, "-m", "moe-demo", *extra, "-o", "max_tokens", str(N), "Say hello"], env)
        return expect(done.returncode == 0 and done.stdout.strip(), (done.returncode, done.stdout, done.stderr))

    def chat():
        done = run_cli([binary, "chat", "-m", "moe-demo", "-o", "max_tokens", str(N)], env, stdin="Say hello\nexit\n")
        return expect(done.returncode == 0 and "Error" not in done.stdout + done.stderr,
                      (done.returncode, done.stdout[-300:], done.stderr[-300:]))

    return {"llm prompt (streamed)": prompt, "llm prompt --no-stream": lambda: prompt("--no-stream"), "llm chat": chat}


def aider_checks(demo: str, scripted: str) -> dict:
    binary = "/tmp/aider-venv/bin/aider"

    def run(streamed: bool):
        work = Path(tempfile.mkdtemp(prefix="aider-work-"))
        (work / "hello.py").write_text("print('hello')\n", encoding="utf-8")
        done = run_cli([binary, "--model", f"openai/{DEMO}", "--openai-api-base", f"{demo}/v1",
                        "--openai-api-key", "unused", "--no-git", "--yes", "--no-check-update", "--no-analytics",
                        "--no-pretty", "--stream" if streamed else "--no-stream", "hello.py", "--message",
                        "Change the greeting to say goodbye."],
                       {"HOME": str(work), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}, cwd=work, timeout=600)
        # aider fetches litellm's model price list from GitHub itself: offline, that fails apart from the server
        bad = [line for line in re.findall(r".*(?:Error|Traceback|Exception).*", done.stdout + done.stderr)
               if "raw.githubusercontent.com" not in line]
        expect(done.returncode == 0 and not bad, (done.returncode, bad[:5], done.stdout[-600:]))
        return done.stdout[-600:]

    checks = {"aider --message, stream": lambda: run(True), "aider --message, no stream": lambda: run(False)}
    return checks if Path(binary).exists() else {}


def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city
    """
    return TOOL_RESULT


def run_async(coroutine):
    import asyncio

    return asyncio.run(coroutine)


def pydantic_ai_checks(demo: str, scripted: str) -> dict:
    from pydantic_ai import Agent, Embedder, NativeOutput, PromptedOutput
    from pydantic_ai.embeddings.openai import OpenAIEmbeddingModel
    from pydantic_ai.models.ollama import OllamaModel
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.ollama import OllamaProvider
    from pydantic_ai.providers.openai import OpenAIProvider

    Person = person_class()
    settings = {"max_tokens": N, "temperature": 0}
    models = {"OpenAIChatModel": lambda base, name: OpenAIChatModel(
                  name, provider=OpenAIProvider(base_url=f"{base}/v1", api_key="unused")),
              "OllamaModel": lambda base, name: OllamaModel(name, provider=OllamaProvider(base_url=f"{base}/v1")),
              "OpenAIResponsesModel": lambda base, name: OpenAIResponsesModel(
                  name, provider=OpenAIProvider(base_url=f"{base}/v1", api_key="unused"))}

    def plain(make):
        out = Agent(make(demo, DEMO), model_settings=settings).run_sync(ASK[0]["content"]).output
        return expect(bool(out), out)

    def streamed(make):
        with Agent(make(demo, DEMO), model_settings=settings).run_stream_sync(ASK[0]["content"]) as result:
            pieces = list(result.stream_text(delta=True))
        return expect(bool("".join(pieces)), pieces)

    def tools(make):
        agent = Agent(make(scripted, SCRIPTED), tools=[get_weather])
        out = agent.run_sync(WEATHER_ASK[0]["content"]).output
        return expect(TOOL_RESULT in out, out)

    def structured(make, wrap, streamed: bool = False):
        agent = Agent(make(scripted, SCRIPTED), output_type=wrap(Person))
        if streamed:
            with agent.run_stream_sync(ASK[0]["content"]) as result:
                out = list(result.stream_output())[-1]
        else:
            out = agent.run_sync(ASK[0]["content"]).output
        return expect(isinstance(out, Person) and out.model_dump() == PERSON, out)

    def streamed_tools(make):
        with Agent(make(scripted, SCRIPTED), tools=[get_weather]).run_stream_sync(WEATHER_ASK[0]["content"]) as r:
            out = "".join(r.stream_text(delta=True))
        return expect(TOOL_RESULT in out, out)

    checks = {}
    for label, make in models.items():
        checks[f"{label} run"] = lambda m=make: plain(m)
        checks[f"{label} run_stream"] = lambda m=make: streamed(m)
        checks[f"{label} tool round trip"] = lambda m=make: tools(m)
        checks[f"{label} output_type (tool)"] = lambda m=make: structured(m, lambda t: t)
        checks[f"{label} NativeOutput"] = lambda m=make: structured(m, NativeOutput)
        checks[f"{label} PromptedOutput"] = lambda m=make: structured(m, PromptedOutput)
        checks[f"{label} run_stream tool round trip"] = lambda m=make: streamed_tools(m)
        checks[f"{label} run_stream output_type (tool)"] = lambda m=make: structured(m, lambda t: t, True)
        checks[f"{label} run_stream NativeOutput"] = lambda m=make: structured(m, NativeOutput, True)

    def embed():
        provider = OpenAIProvider(base_url=f"{demo}/v1", api_key="unused")
        embedder = Embedder(OpenAIEmbeddingModel(DEMO, provider=provider))
        return unit_vectors([list(v) for v in embedder.embed_documents_sync(TEXTS).embeddings], len(TEXTS))

    checks["Embedder (OpenAIEmbeddingModel) embed_documents"] = embed
    return checks


def instructor_checks(demo: str, scripted: str) -> dict:
    import instructor
    from openai import OpenAI

    Person = person_class()

    def extract(mode):
        client = instructor.from_openai(OpenAI(base_url=f"{scripted}/v1", api_key="unused"), mode=mode)
        out = client.chat.completions.create(model=SCRIPTED, response_model=Person, messages=ASK, max_retries=0)
        return expect(isinstance(out, Person) and out.model_dump() == PERSON, out)

    def partial(mode):  # streamed: the model as it fills in, the last one whole
        client = instructor.from_openai(OpenAI(base_url=f"{scripted}/v1", api_key="unused"), mode=mode)
        parts = list(client.chat.completions.create_partial(model=SCRIPTED, response_model=Person, messages=ASK))
        return expect(parts and parts[-1].model_dump() == PERSON, parts[-3:])

    modes = ("TOOLS", "JSON", "JSON_SCHEMA", "MD_JSON")
    checks = {f"from_openai {m}": lambda m=m: extract(getattr(instructor.Mode, m)) for m in modes}
    checks |= {f"from_openai {m}, create_partial": lambda m=m: partial(getattr(instructor.Mode, m))
               for m in ("TOOLS", "JSON_SCHEMA")}
    return checks


def llama_index_checks(demo: str, scripted: str) -> dict:
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.llms import ChatMessage
    from llama_index.core.prompts import PromptTemplate
    from llama_index.core.tools import FunctionTool
    from llama_index.embeddings.ollama import OllamaEmbedding
    from llama_index.embeddings.openai import OpenAIEmbedding
    from llama_index.llms.ollama import Ollama
    from llama_index.llms.openai_like import OpenAILike

    Person = person_class()
    llms = {
        "OpenAILike": lambda base, name, **kw: OpenAILike(
            model=name, api_base=f"{base}/v1", api_key="unused", is_chat_model=True,
            is_function_calling_model=True, context_window=8192, **kw),
        "Ollama": lambda base, name, **kw: Ollama(model=name, base_url=base, request_timeout=120,
                                                  context_window=8192, **kw)}
    weather = FunctionTool.from_defaults(fn=get_weather)

    def text(out) -> str:
        return expect(bool(str(out).strip()), str(out))

    def agent(make):
        async def run():  # a workflow needs a running event loop from its start
            return await FunctionAgent(tools=[weather], llm=make(scripted, SCRIPTED)).run(
                user_msg=WEATHER_ASK[0]["content"])

        out = run_async(run())
        return expect(TOOL_RESULT in str(out), str(out))

    def structured(make, streamed: bool = False):
        llm, prompt = make(scripted, SCRIPTED), PromptTemplate("Describe {who}.")
        if streamed:
            out = list(llm.stream_structured_predict(Person, prompt, who="Ada"))[-1]
            out = Person.model_validate(out.model_dump())  # the last partial, whole
        else:
            out = llm.structured_predict(Person, prompt, who="Ada")
        return expect(isinstance(out, Person) and out.model_dump() == PERSON, out)

    async def astream(llm) -> str:
        return "".join([c.delta or "" async for c in await llm.astream_chat(ask)])

    ask = [ChatMessage(role="user", content=ASK[0]["content"])]
    demo_llms = {"OpenAILike": lambda: llms["OpenAILike"](demo, DEMO, max_tokens=N, temperature=0),
                 "Ollama": lambda: llms["Ollama"](demo, DEMO, temperature=0, additional_kwargs={"num_predict": N})}

    def call(make):
        out = str(make(scripted, SCRIPTED).predict_and_call([weather], WEATHER_ASK[0]["content"]))
        return expect(TOOL_RESULT in out, out)

    checks = {}
    for label, make in llms.items():
        plain = demo_llms[label]
        checks[f"{label} complete"] = lambda d=plain: text(d().complete("Once upon a time"))
        checks[f"{label} chat"] = lambda d=plain: text(d().chat(ask).message.content)
        checks[f"{label} stream_chat"] = lambda d=plain: text("".join(c.delta or "" for c in d().stream_chat(ask)))
        checks[f"{label} predict_and_call"] = lambda m=make: call(m)
        checks[f"{label} FunctionAgent round trip (streamed)"] = lambda m=make: agent(m)
        checks[f"{label} structured_predict"] = lambda m=make: structured(m)
        checks[f"{label} stream_structured_predict"] = lambda m=make: structured(m, True)
        checks[f"{label} astream_chat"] = lambda d=plain: text(run_async(astream(d())))
    checks["OpenAIEmbedding"] = lambda: unit_vectors(OpenAIEmbedding(
        model_name=DEMO, api_base=f"{demo}/v1", api_key="unused").get_text_embedding_batch(TEXTS), len(TEXTS))
    checks["OllamaEmbedding"] = lambda: unit_vectors(OllamaEmbedding(
        model_name=DEMO, base_url=demo).get_text_embedding_batch(TEXTS), len(TEXTS))
    return checks


def dspy_checks(demo: str, scripted: str) -> dict:
    import dspy

    class Describe(dspy.Signature):
        """Describe the person asked about."""
        question: str = dspy.InputField()
        name: str = dspy.OutputField()
        age: int = dspy.OutputField()

    def predict(adapter):
        lm = dspy.LM(f"openai/{SCRIPTED}", api_base=f"{scripted}/v1", api_key="unused", cache=False)
        with dspy.context(lm=lm, adapter=adapter):
            out = dspy.Predict(Describe)(question="Who is Ada?")
        return expect({"name": out.name, "age": out.age} == PERSON, out)

    return {"Predict, ChatAdapter": lambda: predict(dspy.ChatAdapter(use_json_adapter_fallback=False)),
            "Predict, JSONAdapter": lambda: predict(dspy.JSONAdapter())}


def smolagents_checks(demo: str, scripted: str) -> dict:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    def run(streamed: bool):
        model = OpenAIServerModel(model_id=SCRIPTED, api_base=f"{scripted}/v1", api_key="unused")
        agent = ToolCallingAgent(tools=[tool(get_weather)], model=model, max_steps=3, verbosity_level=0,
                                 stream_outputs=streamed)
        out = agent.run(WEATHER_ASK[0]["content"])
        return expect(TOOL_RESULT in str(out), out)

    return {"OpenAIServerModel ToolCallingAgent round trip": lambda: run(False),
            "OpenAIServerModel ToolCallingAgent round trip, stream_outputs": lambda: run(True)}


def openai_agents_checks(demo: str, scripted: str) -> dict:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no upload of traces to OpenAI

    async def run(model_class, ask: str, streamed: bool, **agent_kw):
        # the client is made and closed on the run's own event loop (else its close fails once that loop is gone)
        async with AsyncOpenAI(base_url=f"{scripted}/v1", api_key="unused") as client:
            agent = Agent(name="agent", model=model_class(model=SCRIPTED, openai_client=client), **agent_kw)
            if not streamed:
                return (await Runner.run(agent, ask)).final_output, None
            result = Runner.run_streamed(agent, ask)
            kinds = [event.type async for event in result.stream_events()]
            return result.final_output, sorted(set(kinds))

    def tools(model_class, streamed: bool = False):
        out, kinds = run_async(run(model_class, WEATHER_ASK[0]["content"], streamed,
                                   instructions="Answer with the tool.", tools=[function_tool(get_weather)]))
        return expect(TOOL_RESULT in str(out), (out, kinds))

    def structured(model_class):
        out, _ = run_async(run(model_class, ASK[0]["content"], False, output_type=person_class()))
        return expect(out.model_dump() == PERSON, out)

    checks = {}
    for label, model_class in (("OpenAIChatCompletionsModel", OpenAIChatCompletionsModel),
                               ("OpenAIResponsesModel", OpenAIResponsesModel)):
        checks[f"{label} function tool"] = lambda m=model_class: tools(m)
        checks[f"{label} function tool, run_streamed"] = lambda m=model_class: tools(m, True)
        checks[f"{label} output_type"] = lambda m=model_class: structured(m)
    return checks


def haystack_checks(demo: str, scripted: str) -> dict:
    from haystack import Document
    from haystack.components.agents import Agent
    from haystack.components.embedders import OpenAIDocumentEmbedder, OpenAITextEmbedder
    from haystack.components.generators.chat import OpenAIChatGenerator
    from haystack.dataclasses import ChatMessage
    from haystack.tools import create_tool_from_function
    from haystack.utils import Secret

    key = Secret.from_token("unused")
    weather = create_tool_from_function(get_weather)
    ask, weather_ask = ChatMessage.from_user(ASK[0]["content"]), ChatMessage.from_user(WEATHER_ASK[0]["content"])

    def plain(**kw):
        gen = OpenAIChatGenerator(api_key=key, model=DEMO, api_base_url=f"{demo}/v1",
                                  generation_kwargs={"max_tokens": N, "temperature": 0}, **kw)
        return gen.run([ask])["replies"][0].text

    def streamed():
        pieces: list[str] = []
        out = plain(streaming_callback=lambda chunk: pieces.append(chunk.content))
        return expect(bool("".join(pieces)) and "".join(pieces) == out, (pieces, out))

    def tool_round_trip(gen):
        # Haystack 3 has no ToolInvoker: the reply's calls are run by hand and answered with tool messages
        reply = gen.run([weather_ask])["replies"][0]
        expect(len(reply.tool_calls) == 1 and reply.tool_calls[0].arguments == {"city": "Paris"}, reply)
        results = [ChatMessage.from_tool(weather.invoke(**c.arguments), origin=c) for c in reply.tool_calls]
        second = gen.run([weather_ask, reply, *results])["replies"][0]
        return expect(TOOL_RESULT in (second.text or ""), second)

    def round_trip(streamed: bool):
        kw = {"streaming_callback": lambda chunk: None} if streamed else {}
        return tool_round_trip(OpenAIChatGenerator(api_key=key, model=SCRIPTED, api_base_url=f"{scripted}/v1",
                                                   tools=[weather], **kw))

    def agent():
        gen = OpenAIChatGenerator(api_key=key, model=SCRIPTED, api_base_url=f"{scripted}/v1")
        out = Agent(chat_generator=gen, tools=[weather]).run([weather_ask])["messages"][-1]
        return expect(TOOL_RESULT in (out.text or ""), out)

    def embed():
        query = OpenAITextEmbedder(api_key=key, model=DEMO, api_base_url=f"{demo}/v1").run(TEXTS[0])["embedding"]
        documents = OpenAIDocumentEmbedder(api_key=key, model=DEMO, api_base_url=f"{demo}/v1").run(
            [Document(content=TEXTS[1])])["documents"]
        return unit_vectors([query, documents[0].embedding], len(TEXTS))

    checks = {"OpenAIChatGenerator run": lambda: expect(bool(out := plain()), out),
              "OpenAIChatGenerator streaming_callback": streamed,
              "OpenAIChatGenerator tools round trip": lambda: round_trip(False),
              "OpenAIChatGenerator tools round trip, streaming_callback": lambda: round_trip(True),
              "Agent with a tool": agent,
              "OpenAITextEmbedder, OpenAIDocumentEmbedder": embed}
    try:
        from haystack_integrations.components.embedders.ollama import (
            OllamaDocumentEmbedder,
            OllamaTextEmbedder,
        )
        from haystack_integrations.components.generators.ollama import OllamaChatGenerator
    except ImportError:  # ollama-haystack is optional
        return checks

    def ollama_plain(**kw):
        gen = OllamaChatGenerator(model=DEMO, url=demo, generation_kwargs={"num_predict": N, "temperature": 0}, **kw)
        return gen.run([ask])["replies"][0].text

    def ollama_streamed():
        pieces: list[str] = []
        out = ollama_plain(streaming_callback=lambda chunk: pieces.append(chunk.content))
        return expect(bool("".join(pieces)), (pieces, out))

    def ollama_schema():
        out = OllamaChatGenerator(model=SCRIPTED, url=scripted, response_format=PERSON_SCHEMA).run([ask])
        return expect(json.loads(out["replies"][0].text) == PERSON, out)

    def ollama_embed():
        query = OllamaTextEmbedder(model=DEMO, url=demo).run(TEXTS[0])["embedding"]
        documents = OllamaDocumentEmbedder(model=DEMO, url=demo).run([Document(content=TEXTS[1])])["documents"]
        return unit_vectors([query, documents[0].embedding], len(TEXTS))

    return checks | {"OllamaChatGenerator run": lambda: expect(bool(out := ollama_plain()), out),
                     "OllamaChatGenerator streaming_callback": ollama_streamed,
                     "OllamaChatGenerator tools round trip":
                         lambda: tool_round_trip(OllamaChatGenerator(model=SCRIPTED, url=scripted, tools=[weather])),
                     "OllamaChatGenerator response_format json schema": ollama_schema,
                     "OllamaTextEmbedder, OllamaDocumentEmbedder": ollama_embed}


def autogen_checks(demo: str, scripted: str) -> dict:
    from autogen_agentchat.agents import AssistantAgent
    from autogen_core.models import CreateResult, UserMessage
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    Person = person_class()
    # a model name it does not know needs its capabilities spelled out
    info = {"vision": False, "function_calling": True, "json_output": True, "family": "unknown",
            "structured_output": True}
    ask = [UserMessage(content=ASK[0]["content"], source="user")]

    def client(base: str, name: str, **kw) -> OpenAIChatCompletionClient:
        return OpenAIChatCompletionClient(model=name, base_url=f"{base}/v1", api_key="unused", model_info=info, **kw)

    async def create(streamed: bool):
        llm = client(demo, DEMO, max_tokens=N, temperature=0)
        try:
            if not streamed:
                return (await llm.create(ask)).content
            items = [item async for item in llm.create_stream(ask)]
            expect(isinstance(items[-1], CreateResult) and len(items) > 2, items[-1])
            return "".join(i for i in items[:-1] if isinstance(i, str))
        finally:
            await llm.close()

    async def structured():
        llm = client(scripted, SCRIPTED)
        try:
            return Person.model_validate_json((await llm.create(ask, json_output=Person)).content)
        finally:
            await llm.close()

    async def agent(streamed: bool = False, **kw):
        llm = client(scripted, SCRIPTED)
        try:
            assistant = AssistantAgent("assistant", model_client=llm, model_client_stream=streamed, **kw)
            task = WEATHER_ASK[0]["content"] if "tools" in kw else ASK[0]["content"]
            if not streamed:
                return (await assistant.run(task=task)).messages[-1]
            return [item async for item in assistant.run_stream(task=task)][-1].messages[-1]
        finally:
            await llm.close()

    def tools(streamed: bool):
        out = run_async(agent(streamed, tools=[get_weather], reflect_on_tool_use=True))
        return expect(TOOL_RESULT in str(out.content), out)

    def agent_structured():
        out = run_async(agent(output_content_type=Person))
        return expect(out.content.model_dump() == PERSON, out)

    return {"OpenAIChatCompletionClient create": lambda: expect(bool(t := run_async(create(False))), t),
            "OpenAIChatCompletionClient create_stream": lambda: expect(bool(t := run_async(create(True))), t),
            "OpenAIChatCompletionClient create json_output=Person": lambda: expect(
                (p := run_async(structured())).model_dump() == PERSON, p),
            "AssistantAgent tool, reflect_on_tool_use": lambda: tools(False),
            "AssistantAgent tool, reflect_on_tool_use, model_client_stream": lambda: tools(True),
            "AssistantAgent output_content_type": agent_structured}


def semantic_kernel_checks(demo: str, scripted: str) -> dict:
    from openai import AsyncOpenAI
    from semantic_kernel import Kernel
    from semantic_kernel.connectors.ai.function_choice_behavior import FunctionChoiceBehavior
    from semantic_kernel.connectors.ai.open_ai import OpenAIChatCompletion, OpenAIChatPromptExecutionSettings
    from semantic_kernel.contents import ChatHistory
    from semantic_kernel.functions import kernel_function

    class Weather:
        @kernel_function(name="get_weather", description="The weather in a city")
        def get_weather(self, city: str) -> str:
            return TOOL_RESULT

    async def chat(base: str, name: str, ask: str, streamed: bool = False, with_kernel: bool = False, **settings):
        # the client is made and closed on the run's own event loop
        async with AsyncOpenAI(base_url=f"{base}/v1", api_key="unused") as client:
            service = OpenAIChatCompletion(ai_model_id=name, async_client=client)
            history, kernel = ChatHistory(), Kernel()
            history.add_user_message(ask)
            kernel.add_plugin(Weather(), plugin_name="weather")  # offered as "weather-get_weather"
            kw = {"kernel": kernel} if with_kernel else {}
            execution = OpenAIChatPromptExecutionSettings(**settings)
            if not streamed:
                return str(await service.get_chat_message_content(history, execution, **kw))
            return "".join([str(c) async for c in service.get_streaming_chat_message_content(history, execution, **kw)])

    def plain(streamed: bool):
        out = run_async(chat(demo, DEMO, ASK[0]["content"], streamed, max_tokens=N, temperature=0))
        return expect(bool(out), out)

    def tools(streamed: bool):
        out = run_async(chat(scripted, SCRIPTED, WEATHER_ASK[0]["content"], streamed, with_kernel=True,
                             function_choice_behavior=FunctionChoiceBehavior.Auto()))
        return expect(TOOL_RESULT in out, out)

    def structured():
        out = run_async(chat(scripted, SCRIPTED, ASK[0]["content"], response_format=person_class()))
        return expect(json.loads(out) == PERSON, out)

    return {"OpenAIChatCompletion get_chat_message_content": lambda: plain(False),
            "OpenAIChatCompletion get_streaming_chat_message_content": lambda: plain(True),
            "auto function calling (kernel_function)": lambda: tools(False),
            "auto function calling, streamed": lambda: tools(True),
            "response_format pydantic": structured}


def langgraph_checks(demo: str, scripted: str) -> dict:
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    Person = person_class()
    ask = {"messages": [("user", WEATHER_ASK[0]["content"])]}

    def agent(**kw):
        return create_react_agent(ChatOpenAI(model=SCRIPTED, base_url=f"{scripted}/v1", api_key="unused"),
                                  [get_weather], **kw)

    def invoke():
        out = agent().invoke(ask)["messages"]
        return expect(TOOL_RESULT in out[-1].content and [m.type for m in out] == ["human", "ai", "tool", "ai"],
                      [(m.type, m.content) for m in out])

    def stream():  # token by token, as a chat UI shows it
        pieces = [chunk.content for chunk, _ in agent().stream(ask, stream_mode="messages")
                  if chunk.type == "AIMessageChunk"]
        return expect(TOOL_RESULT in "".join(pieces), pieces)

    def structured():
        out = agent(response_format=Person).invoke(ask)
        return expect(out["structured_response"].model_dump() == PERSON, out["structured_response"])

    return {"create_react_agent invoke": invoke, "create_react_agent stream_mode=messages": stream,
            "create_react_agent response_format": structured}


def shell_gpt_checks(demo: str, scripted: str) -> dict:
    binary = "/tmp/sgpt-venv/bin/sgpt"  # shell-gpt pins openai<3: a venv apart
    home = Path(tempfile.mkdtemp(prefix="sgpt-home-"))
    # without OPENAI_API_KEY its first run asks for a key on the terminal
    env = {"HOME": str(home), "OPENAI_API_KEY": "unused", "API_BASE_URL": f"{demo}/v1", "DEFAULT_MODEL": DEMO,
           "CHAT_CACHE_PATH": str(home / "chats"), "CACHE_PATH": str(home / "cache"),
           "REQUEST_TIMEOUT": "600"}  # its 60 s default, on a loaded CPU, ends in retries of a request still running

    def sgpt(*args: str, **extra: str) -> str:
        done = run_cli([binary, "--no-cache", *args], env | extra)
        return expect(done.returncode == 0 and done.stdout.strip() and "Error" not in done.stderr,
                      (done.returncode, done.stdout[-300:], done.stderr[-300:]))

    def chat() -> str:
        sgpt("--no-functions", "--chat", "greetings", "Say hello")
        out = sgpt("--no-functions", "--chat", "greetings", "Say it again")
        turns = json.loads((home / "chats" / "greetings").read_text(encoding="utf-8"))
        return expect([t["role"] for t in turns][-4:] == ["user", "assistant", "user", "assistant"], (turns, out))

    # (functions on, its default, offer only those installed by --install-functions: none here)
    checks = {"sgpt prompt (streamed)": lambda: sgpt("Say hello"),
              "sgpt prompt, DISABLE_STREAMING": lambda: sgpt("--no-functions", "Say hello", DISABLE_STREAMING="true"),
              "sgpt --code": lambda: sgpt("--no-functions", "--code", "print hello in python"),
              "sgpt --shell --no-interaction": lambda: sgpt("--no-functions", "--shell", "--no-interaction",
                                                            "list files"),
              "sgpt --chat, two turns": chat}
    return checks if Path(binary).exists() else {}


def gptme_checks(demo: str, scripted: str) -> dict:
    binary = "/tmp/gptme-venv/bin/gptme"  # gptme pins openai<3 too

    def run(base: str, name: str, *args: str) -> str:
        home = Path(tempfile.mkdtemp(prefix="gptme-home-"))
        # the "local" provider: any OpenAI-compatible server at OPENAI_BASE_URL. After its answer it asks for a
        # title in a background thread that -n does not wait for: on a slow model the server sees the client
        # leave mid-request (a 499, so those checks fail on a client quirk)
        done = run_cli([binary, "-n", "--model", f"local/{name}", "--no-workspace", *args, "Say hello"],
                       {"HOME": str(home), "OPENAI_BASE_URL": f"{base}/v1", "OPENAI_API_KEY": "unused"},
                       cwd=home, timeout=600)
        # it fetches tiktoken's encoding from openaipublic.blob.core.windows.net to count tokens: offline, that fails
        # apart from the server (and it goes on)
        bad = [line for line in re.findall(r".*(?:Error|Traceback|Exception).*", done.stdout + done.stderr)
               if "openaipublic" not in line and "tiktoken" not in line]
        return expect(done.returncode == 0 and not bad, (done.returncode, bad[:5], done.stdout[-400:],
                                                          done.stderr[-400:]))

    checks = {"gptme -n, no tools, stream": lambda: run(demo, DEMO, "--tools", "none", "--stream"),
              "gptme -n, no tools, no stream": lambda: run(demo, DEMO, "--tools", "none", "--no-stream"),
              "gptme -n, shell tool, tool-format tool": lambda: run(scripted, SCRIPTED, "--tools", "shell",
                                                                   "--tool-format", "tool")}
    return checks if Path(binary).exists() else {}


CREW_SCRIPT = """
import sys
from crewai import LLM, Agent, Crew, Task
from crewai.tools import tool

base, model, with_tool, streamed = sys.argv[1], sys.argv[2], sys.argv[3] == "tool", sys.argv[4] == "stream"


@tool("get_weather")
def get_weather(city: str) -> str:
    \"\"\"The weather in a city.\"\"\"
    return "sunny, 21 C"


llm = LLM(model="openai/" + model, base_url=base + "/v1", api_key="unused", stream=streamed,
          **({} if with_tool else {"max_tokens": 16, "temperature": 0}))
agent = Agent(role="Helper", goal="Answer the question", backstory="A helpful assistant.", llm=llm,
              tools=[get_weather] if with_tool else [], max_iter=3, verbose=False)
task = Task(description="What is the weather in Paris?" if with_tool else "Say hello in five words.",
            expected_output="A short answer.", agent=agent)
print("RESULT:", Crew(agents=[agent], tasks=[task]).kickoff().raw)
"""


def crewai_checks(demo: str, scripted: str) -> dict:
    python = "/tmp/crewai-venv/bin/python"  # CrewAI pins openai<3 and an older pydantic: a venv apart

    def run(base: str, name: str, with_tool: bool, streamed: bool = False) -> str:
        home = Path(tempfile.mkdtemp(prefix="crewai-home-"))
        done = run_cli([python, "-c", CREW_SCRIPT, base, name, "tool" if with_tool else "plain",
                        "stream" if streamed else "no stream"],
                       {"HOME": str(home), "CREWAI_DISABLE_TELEMETRY": "true", "OTEL_SDK_DISABLED": "true",
                        "CREWAI_TRACING_ENABLED": "false"}, cwd=home, timeout=600)
        out = done.stdout.rpartition("RESULT:")[2].strip()
        expect(done.returncode == 0 and out and (TOOL_RESULT in out or not with_tool),
               (done.returncode, done.stdout[-400:], done.stderr[-400:]))
        return out

    checks = {"LLM(openai/...) Crew kickoff": lambda: run(demo, DEMO, False),
              "LLM(openai/...) Crew kickoff, stream": lambda: run(demo, DEMO, False, True),
              "LLM(openai/...) Crew kickoff with a tool": lambda: run(scripted, SCRIPTED, True)}
    return checks if Path(python).exists() else {}


LIBRARIES = {"litellm": litellm_checks, "langchain-openai": langchain_openai_checks,
             "langchain-ollama": langchain_ollama_checks, "ollama": ollama_checks, "llm": llm_checks,
             "aider": aider_checks, "pydantic-ai": pydantic_ai_checks, "instructor": instructor_checks,
             "llama-index": llama_index_checks, "dspy": dspy_checks, "smolagents": smolagents_checks,
             "openai-agents": openai_agents_checks,
             "haystack": haystack_checks, "autogen": autogen_checks,
             "semantic-kernel": semantic_kernel_checks, "langgraph": langgraph_checks,
             "shell-gpt": shell_gpt_checks, "gptme": gptme_checks,
             "crewai": crewai_checks}


def run_check(check, urls: list[str], expect_4xx: bool = False) -> dict:
    """Run one check; it passes if it returns, and its requests were answered 2xx (or, `expect_4xx`, at least one
    4xx and no 5xx: a check of how the client reads an error)."""
    before = [len(get_json(f"{u}/_bench/requests")) for u in urls]
    started = time.monotonic()
    try:
        row = {"passed": True, "detail": str(check())[:600]}
    except Exception as e:  # noqa: BLE001 - a client's exception is a result
        row = {"passed": False, "error": f"{type(e).__name__}: {e}"[:600],
               "where": traceback.format_exc().strip().splitlines()[-3:-1]}
    row["seconds"] = round(time.monotonic() - started, 1)
    seen = [r for u, n in zip(urls, before) for r in get_json(f"{u}/_bench/requests")[n:]]
    row["requests"] = [f"{r['method']} {r['path']} {r['status']} keys={r['keys']}" + (
        f" content-type={r['type']}" if r["type"] not in ("", "application/json") else "") + (
        f" answer={r['answer']} body={r['body']}" if "answer" in r else "") for r in seen]
    statuses = [r["status"] for r in seen]
    row["passed"] = row["passed"] and (all(s < 400 for s in statuses) if not expect_4xx else
                                       all(s < 500 for s in statuses) and any(s >= 400 for s in statuses))
    return row


def run_libraries(libraries: dict, names: list[str], out: Path | None) -> None:
    """Start both servers, run each library's checks (`libraries[name](demo_url, scripted_url)` gives
    {call: check}), print the JSON object (and write it to `out`), exit 1 if any check failed."""
    (demo_proc, demo), (scripted_proc, scripted) = start("demo"), start("scripted")
    results = {}
    try:
        for name in names:
            checks = libraries[name](demo, scripted)
            # a call named "error: ..." checks how the client reads an error answer
            results[name] = {call: run_check(check, [demo, scripted], call.startswith("error:"))
                             for call, check in checks.items()}
            print(f"{name}: {sum(r['passed'] for r in results[name].values())}/{len(checks)} passed", file=sys.stderr)
    finally:
        for proc in (demo_proc, scripted_proc):
            proc.terminate()
            proc.wait(timeout=60)
    text = json.dumps(results, indent=1)
    print(text)
    if out:
        out.write_text(text, encoding="utf-8")
    sys.exit(0 if all(r["passed"] for rows in results.values() for r in rows.values()) else 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", choices=["demo", "scripted"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--only", default=",".join(LIBRARIES), help="libraries to run, comma-separated")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON object here")
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve, args.port)
    run_libraries(LIBRARIES, args.only.split(","), args.out)


if __name__ == "__main__":
    main()
