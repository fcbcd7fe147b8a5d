"""Real coding agents (Claude Code, Codex CLI, opencode, Qwen Code, Continue CLI) against moe-serve's real
app, end to end.

Run: python -m bench.agent_clients [--clients claude-code,codex,...] [--bin DIR] [--out FILE] [--bodies DIR]
Install the clients first (they are not Python packages): `npm install --prefix /tmp/agents
@anthropic-ai/claude-code @openai/codex opencode-ai @qwen-code/qwen-code @continuedev/cli`; the default --bin
is /tmp/agents/node_modules/.bin. Each client is configured as its docs tell a user of a local
OpenAI-compatible (or Anthropic-compatible) server.

The engine is scripted (a random model would never call a tool): on a Qwen2.5-style tool template it
answers the client's first request with one call of the client's own shell tool (Claude Code's and
Continue's `Bash`, Codex's `exec_command`, opencode's `bash`, Qwen Code's `run_shell_command`), and the request that carries the tool's result with a sentence quoting that
result. So a run passes only if the whole loop works: the client's request is read (its system turns, tool
list and options), the call streams back in the client's API shape, the client runs it, and its result
reaches the template in the next request. Every request's route, status and body keys are recorded
(--bodies keeps the bodies).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import uvicorn

from bench.scripted_engine import ScriptedEngine
from engine.config import EngineConfig
from server.app import create_app
from server.config import ServerConfig
from server.testing import free_port
from tests.fixtures.tokenizers import QWEN_TOOLS_TEMPLATE
from tests.fixtures.tool_templates import HARMONY_TOOLS_TEMPLATE

MODEL = "agent-scripted"
MARK = "moe-serve-agent-ok"
COMMAND = f"echo {MARK} > agent_check.txt && cat agent_check.txt"
TASK = "Write the check file with the shell tool, then tell me what it printed."
SHELL_CALLS = {  # each client's shell tool and the arguments that run COMMAND
    "Bash": {"command": COMMAND, "description": "Write the check file"},
    "exec_command": {"cmd": COMMAND},
    "bash": {"command": COMMAND, "description": "Write the check file"},
    "run_shell_command": {"command": COMMAND, "is_background": False, "description": "Write the check file"},
}
DEFAULT_BIN = Path("/tmp/agents/node_modules/.bin")
CLIENT_TIMEOUT_S = 300


class ScriptedAgentEngine(ScriptedEngine):
    """Calls the client's shell tool once, then quotes what the tool returned; keeps every prompt.
    `style`: "qwen" (Qwen2.5's tool calls) or "harmony" (GPT-OSS: thinking, then a call or an answer)."""

    def __init__(self, style: str) -> None:
        super().__init__(MODEL, style, TEMPLATES[style])
        self.style = style
        self.prompts: list[str] = []
        self.answers: list[str] = []

    def answer(self, prompt: str) -> str:
        self.prompts.append(prompt)
        self.answers.append(scripted_answer(prompt, self.style))
        return self.answers[-1]


TEMPLATES = {"qwen": QWEN_TOOLS_TEMPLATE, "harmony": HARMONY_TOOLS_TEMPLATE}
QUOTE = "The command printed: "
HARMONY_RESULT = re.compile(r"functions\.\w+ to=assistant<\|channel\|>commentary<\|message\|>(.*)<\|end\|>", re.S)
QWEN_RESULT = re.compile(r"user\n<tool_response>\n(.*)\n</tool_response><\|im_end\|>\n", re.S)


def scripted_answer(prompt: str, style: str) -> str:
    """What the scripted model writes after `prompt` (the rendered chat, special tokens kept)."""
    result = tool_result(prompt, style)
    if result is not None:
        return written_as(style, f"{QUOTE}{printed(result)}")
    for tool, arguments in SHELL_CALLS.items():
        if f'"name": "{tool}"' in prompt or f"type {tool} = " in prompt:
            return written_as(style, json.dumps(arguments), call_of=tool)
    return written_as(style, "Agent check.")  # a request without the tools: a title or a summary


def printed(result: str) -> str:
    """The line the command printed in a tool result: Codex puts a header (exit code, wall time) before it,
    Qwen Code labels it (`Output: ...`, between `Command:` and `Exit Code:` lines). The last line ending with the
    mark, less its label; else the last line."""
    lines = result.strip().splitlines()
    return next((line.rsplit(": ", 1)[-1] for line in reversed(lines) if line.endswith(MARK)), lines[-1])


def tool_result(prompt: str, style: str) -> str | None:
    """The tool's output when the prompt's last turn is a tool result, else None."""
    opening, pattern = ("<|start|>", HARMONY_RESULT) if style == "harmony" else ("<|im_start|>", QWEN_RESULT)
    found = pattern.fullmatch(prompt.rsplit(opening, 2)[-2])  # the turn before the generation prompt
    return found.group(1) if found else None


def written_as(style: str, text: str, call_of: str | None = None) -> str:
    """An answer `text`, or a call of `call_of` with `text` as its JSON arguments, in the template's format."""
    if style == "qwen":
        return f'<tool_call>\n{{"name": "{call_of}", "arguments": {text}}}\n</tool_call>' if call_of else text
    thought = "<|channel|>analysis<|message|>The user wants the check file written.<|end|><|start|>assistant"
    if call_of:
        return f"{thought}<|channel|>commentary to=functions.{call_of} <|constrain|>json<|message|>{text}<|call|>"
    return f"{thought}<|channel|>final<|message|>{text}<|return|>"


class RouteLog:
    """ASGI middleware: each HTTP request's method, path and status, and its JSON body (None if none)."""

    def __init__(self, app) -> None:
        self.app = app
        self.seen: list[tuple[str, str, int]] = []
        self.bodies: list[dict | None] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []

        async def read():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        async def record(message) -> None:
            if message["type"] == "http.response.start":
                self.seen.append((scope["method"], scope["path"], message["status"]))
                try:
                    body = json.loads(b"".join(chunks))
                except ValueError:
                    body = None
                self.bodies.append(body if isinstance(body, dict) else None)
            await send(message)

        await self.app(scope, read, record)


def start_server(engine: ScriptedAgentEngine) -> tuple[str, RouteLog, uvicorn.Server]:
    port = free_port()
    routes = RouteLog(create_app(ServerConfig(port=port), EngineConfig(), load_engine=lambda: engine))
    server = uvicorn.Server(uvicorn.Config(routes, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", routes, server


def claude_code_run(binary: Path, url: str, home: Path, workdir: Path, prompt: str,
                    resume: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": "unused",
           "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    return subprocess.run([str(binary), "-p", prompt, *["--continue"] * resume, "--allowedTools", "Bash",
                           "--output-format", "json"],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)


def codex_run(binary: Path, url: str, home: Path, workdir: Path, prompt: str,
              resume: bool) -> subprocess.CompletedProcess:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "moe"\n\n[model_providers.moe]\nname = "moe-serve"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\n', encoding="utf-8")
    env = {**os.environ, "HOME": str(home), "CODEX_HOME": str(codex_home)}
    # the sandbox needs user namespaces, which containers often lack; the command only writes in workdir
    command = ["exec", *["resume", "--last"] * resume, "--skip-git-repo-check",
               "--dangerously-bypass-approvals-and-sandbox", prompt]
    return subprocess.run([str(binary), *command], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=CLIENT_TIMEOUT_S, stdin=subprocess.DEVNULL)


def opencode_run(binary: Path, url: str, home: Path, workdir: Path, prompt: str,
                 resume: bool) -> subprocess.CompletedProcess:
    """opencode's docs for a local server (Ollama, LM Studio): a provider using `@ai-sdk/openai-compatible`
    with `options.baseURL` and the model ids under `models`, in opencode.json."""
    config = {"$schema": "https://opencode.ai/config.json", "model": f"moe/{MODEL}", "autoupdate": False,
              "permission": {"bash": "allow"},  # else `opencode run` asks, and with no terminal denies
              "provider": {"moe": {"npm": "@ai-sdk/openai-compatible", "name": "moe-serve",
                                   "options": {"baseURL": f"{url}/v1"}, "models": {MODEL: {"name": MODEL}}}}}
    config_dir = home / ".config" / "opencode"
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "opencode.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_DATA_HOME": str(home / ".local" / "share"), "XDG_CACHE_HOME": str(home / ".cache"),
           "XDG_STATE_HOME": str(home / ".local" / "state"), "OPENCODE_DISABLE_AUTOUPDATE": "1",
           "PWD": str(workdir)}  # its project directory (where the shell runs) is $PWD, not the process's cwd
    return subprocess.run([str(binary), "run", *["--continue"] * resume, prompt], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, stdin=subprocess.DEVNULL)


def qwen_code_run(binary: Path, url: str, home: Path, workdir: Path, prompt: str,
                  resume: bool) -> subprocess.CompletedProcess:
    """Qwen Code's docs for an OpenAI-compatible server: OPENAI_API_KEY, OPENAI_BASE_URL, OPENAI_MODEL."""
    env = {**os.environ, "HOME": str(home), "OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": "unused",
           "OPENAI_MODEL": MODEL}
    return subprocess.run([str(binary), *["--continue"] * resume, "--auth-type", "openai", "--yolo", "-p", prompt],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


def continue_run(binary: Path, url: str, home: Path, workdir: Path, prompt: str,
                 resume: bool) -> subprocess.CompletedProcess:
    """Continue's docs for an OpenAI-compatible server: a config.yaml model with `provider: openai` and
    `apiBase`."""
    config = home / ".continue" / "config.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(f"name: moe-serve\nversion: 0.0.1\nschema: v1\nmodels:\n  - name: moe-serve\n"
                      f"    provider: openai\n    model: {MODEL}\n    apiBase: {url}/v1\n    apiKey: unused\n"
                      "    roles: [chat, edit, apply]\n", encoding="utf-8")
    env = {**os.environ, "HOME": str(home), "CONTINUE_GLOBAL_DIR": str(home / ".continue")}
    return subprocess.run([str(binary), "-p", *["--resume"] * resume, "--config", str(config), "--allow", "Bash",
                           prompt], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=CLIENT_TIMEOUT_S, stdin=subprocess.DEVNULL)


CLIENTS = {"claude-code": claude_code_run, "codex": codex_run, "opencode": opencode_run,
           "qwen-code": qwen_code_run, "continue": continue_run}
BINARIES = {"claude-code": "claude", "codex": "codex", "opencode": "opencode", "qwen-code": "qwen",
            "continue": "cn"}


def version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "?"


def check_client(name: str, binary: Path, engine: ScriptedAgentEngine, url: str, routes: RouteLog,
                 bodies: Path | None = None) -> dict:
    """Two turns in one session: the task, then the same again after resuming (the first turn's call and
    result go back as history)."""
    run = CLIENTS[name]
    first_route = len(routes.seen)
    quoted = f"{QUOTE}{MARK}"
    turns = []
    with tempfile.TemporaryDirectory(prefix=f"agent-{name}-") as tmp:
        home, workdir = Path(tmp, "home"), Path(tmp, "work")
        home.mkdir()
        workdir.mkdir()
        for resume in (False, True):
            first_answer = len(engine.answers)
            started = time.monotonic()
            done = run(binary, url, home, workdir, TASK if not resume else f"Again: {TASK}", resume)
            check_file = workdir / "agent_check.txt"
            written = check_file.read_text(encoding="utf-8") if check_file.exists() else None
            check_file.unlink(missing_ok=True)
            answers = engine.answers[first_answer:]
            history = engine.prompts[first_answer] if answers else ""
            turns.append({
                "resumed": resume, "exit_code": done.returncode, "seconds": round(time.monotonic() - started, 1),
                # the resumed turn's first prompt holds the first turn's call and result
                "history_sent": "agent_check.txt" in history and MARK in history if resume else None,
                "tool_called": any("<tool_call>" in a or "<|call|>" in a for a in answers),
                "file_written": written == f"{MARK}\n",
                "result_reached_model": any(quoted in a for a in answers),
                "final_output_quotes_result": quoted in done.stdout,
                "stdout_tail": done.stdout[-400:], "stderr_tail": done.stderr[-400:],
            })
    requests = Counter(f"{m} {p} {s}" for m, p, s in routes.seen[first_route:])
    body_keys: dict[str, list[str]] = {}
    for (m, p, _), body in zip(routes.seen[first_route:], routes.bodies[first_route:], strict=True):
        keys = body_keys.setdefault(f"{m} {p}", [])
        keys += [key for key in body or {} if key not in keys]
    if bodies:
        bodies.mkdir(parents=True, exist_ok=True)
        for n, ((_, p, s), body) in enumerate(zip(routes.seen[first_route:], routes.bodies[first_route:],
                                                  strict=True)):
            route = p.strip("/").replace("/", "_")
            (bodies / f"{name}_{engine.style}_{n:02d}_{route}_{s}.json").write_text(json.dumps(body, indent=1))
    return {"client": name, "version": version(binary), "template": engine.style, "requests": dict(requests),
            "body_keys": body_keys, "turns": turns}


def passed(row: dict) -> bool:
    statuses_ok = all(key.rsplit(" ", 1)[1].startswith("2") for key in row["requests"])
    return statuses_ok and all(
        turn["exit_code"] == 0 and turn["history_sent"] is not False and turn["tool_called"] and turn["file_written"] and turn["result_reached_model"]
        and turn["final_output_quotes_result"] for turn in row["turns"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default=",".join(CLIENTS), help="which clients, in turn")
    ap.add_argument("--bin", type=Path, default=DEFAULT_BIN, help="where the clients' executables are")
    ap.add_argument("--templates", default="qwen,harmony", help="the scripted model's formats, in turn")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON lines here")
    ap.add_argument("--bodies", type=Path, default=None, help="write every request's JSON body here")
    args = ap.parse_args()
    binaries = {name: args.bin / BINARIES[name] for name in args.clients.split(",")}
    missing = [str(b) for b in binaries.values() if not shutil.which(str(b))]
    if missing:
        sys.exit(f"not found: {', '.join(missing)} (npm install --prefix /tmp/agents @anthropic-ai/claude-code "
                 "@openai/codex opencode-ai @qwen-code/qwen-code @continuedev/cli)")
    rows = []
    for style in args.templates.split(","):
        engine = ScriptedAgentEngine(style)
        url, routes, server = start_server(engine)
        rows += [check_client(name, binary, engine, url, routes, args.bodies) for name, binary in binaries.items()]
        server.should_exit = True
    for row in rows:
        row["passed"] = passed(row)
        print(json.dumps(row, indent=1))
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print("\n| client | version | template | requests (route status: count) | turn 1: tool ran, result reached the "
          "model | turn 2 (resumed): the same | passed |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        requests = ", ".join(f"{k}: {v}" for k, v in row["requests"].items())
        cells = [f"{t['file_written']}, {t['result_reached_model']}" for t in row["turns"]]
        print(f"| {row['client']} | {row['version']} | {row['template']} | {requests} | {' | '.join(cells)} | "
              f"{row['passed']} |")
    sys.exit(0 if all(r["passed"] for r in rows) else 1)


if __name__ == "__main__":
    main()
