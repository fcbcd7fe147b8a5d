"""Real coding agents (Claude Code, Codex CLI) against moe-serve's real app, end to end.

Run: python -m bench.agent_clients [--claude PATH] [--codex PATH] [--out FILE]
Install the clients first (they are not Python packages): `npm install --prefix /tmp/agents
@anthropic-ai/claude-code @openai/codex`; the defaults look in /tmp/agents/node_modules/.bin.

The engine is scripted (a random model would never call a tool): on a Qwen2.5-style tool template it
answers the client's first request with one call of the client's own shell tool (Claude Code's `Bash`,
Codex's `exec_command`), and the request that carries the tool's result with a sentence quoting that
result. So a run passes only if the whole loop works: the client's request is read (its system turns, tool
list and options), the call streams back in the client's API shape, the client runs it, and its result
reaches the template in the next request. Every request's route and status is recorded.
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
    if result is not None:  # Codex puts a header (exit code, wall time) before the output: quote its last line
        return written_as(style, f"{QUOTE}{result.strip().splitlines()[-1]}")
    for tool, arguments in SHELL_CALLS.items():
        if f'"name": "{tool}"' in prompt or f"type {tool} = " in prompt:
            return written_as(style, json.dumps(arguments), call_of=tool)
    return written_as(style, "Agent check.")  # a request without the tools: a title or a summary


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
    """ASGI middleware: each HTTP request's method, path and status."""

    def __init__(self, app) -> None:
        self.app = app
        self.seen: list[tuple[str, str, int]] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def record(message) -> None:
            if message["type"] == "http.response.start":
                self.seen.append((scope["method"], scope["path"], message["status"]))
            await send(message)

        await self.app(scope, receive, record)


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


CLIENTS = {"claude-code": claude_code_run, "codex": codex_run}


def version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "?"


def check_client(name: str, binary: Path, engine: ScriptedAgentEngine, url: str, routes: RouteLog) -> dict:
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
    return {"client": name, "version": version(binary), "template": engine.style, "requests": dict(requests),
            "turns": turns}


def passed(row: dict) -> bool:
    statuses_ok = all(key.rsplit(" ", 1)[1].startswith("2") for key in row["requests"])
    return statuses_ok and all(
        turn["exit_code"] == 0 and turn["history_sent"] is not False and turn["tool_called"] and turn["file_written"] and turn["result_reached_model"]
        and turn["final_output_quotes_result"] for turn in row["turns"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--claude", type=Path, default=DEFAULT_BIN / "claude")
    ap.add_argument("--codex", type=Path, default=DEFAULT_BIN / "codex")
    ap.add_argument("--templates", default="qwen,harmony", help="the scripted model's formats, in turn")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON lines here")
    args = ap.parse_args()
    binaries = {"claude-code": args.claude, "codex": args.codex}
    missing = [str(b) for b in binaries.values() if not shutil.which(str(b))]
    if missing:
        sys.exit(f"not found: {', '.join(missing)} (npm install --prefix /tmp/agents @anthropic-ai/claude-code "
                 "@openai/codex)")
    rows = []
    for style in args.templates.split(","):
        engine = ScriptedAgentEngine(style)
        url, routes, server = start_server(engine)
        rows += [check_client(name, binary, engine, url, routes) for name, binary in binaries.items()]
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
