"""Open WebUI in a real headless browser, chatting with moe-serve's built-in demo model (issue 16).

Not a pytest test and not imported by the suite: it needs Open WebUI, Chromium and Playwright,
which the project's CI does not have. Run it by hand:

    /tmp/owui-venv/bin/python bench/open_webui_browser.py --moe-python /work/main/.venv/bin/python \
        --open-webui /tmp/owui-venv/bin/open-webui --chromium /usr/bin/chromium \
        --screenshot bench/out/open_webui_chat.png

(the interpreter that runs it needs Playwright; --moe-python is the one with moe-serve installed;
bench/RESULTS.md, "Open WebUI in a real browser", has the install commands and a recorded run.)

It starts moe-serve (`python -m server`, the demo model) and Open WebUI on free ports (connected to
moe-serve's OpenAI API, or with `--connection ollama` to its Ollama API), with a
small recording proxy in between so that every request Open WebUI sends to moe-serve is logged
(path, whether the body carried `tools`, the status and moe-serve's warning header). It then opens
Open WebUI in headless Chromium (Playwright), asks "What is the capital of France?", waits for the
answer to finish streaming, reads it off the page, then (with `--follow-up`, after Open WebUI's
background requests) asks a second question in the same chat. Each request's prompt tokens, and how
many of them came from moe-serve's kept KV cache, are read from moe-serve's log. It takes a
screenshot, stops everything, and prints one JSON object. Playwright is imported from the
interpreter that runs this script.

With `--rag` (documents), Open WebUI's embedding engine is moe-serve too, set as a user sets it in Admin →
Settings → Documents (its env vars: engine `openai` with `RAG_OPENAI_API_BASE_URL` = moe-serve's /v1, or with
`--connection ollama` engine `ollama` with `RAG_OLLAMA_BASE_URL`; model moe-serve/smollm2-moe-demo). A small
text file with one distinctive fact (or `--attach FILE`) is attached in the chat; once Open WebUI has processed
it (its chip stops spinning), the question is about it. The proxy then also records, per request, how many
inputs an embedding request carried and whether a body carried the fact (the document reached the prompt),
and writes every body to request_bodies.jsonl in --logs.

With `--knowledge` (implies `--rag`'s embedding settings), the file goes into a Knowledge collection instead:
Workspace → Knowledge → create a collection, upload the file into it (wait for "File added successfully." or
an error toast), then in a new chat type `#`, pick the collection from the list, and ask the question.

With `--actions`, after the first answer, in the same chat, what a user clicks: Regenerate (→ "Try Again"),
Edit on the question and Send, a long answer stopped midway (Stop), "Continue Response" on it (stopped again
once it has gone on), a next question, a small PNG attached to a question; then a temporary chat
(`?temporary-chat=true`), and prompt autocompletion (the admin's switch on, the user's setting turned on)
while typing. Each action lists the requests it caused (indexes into `moe_serve_requests`), the answer and
the errors and toasts the page showed; every body goes to request_bodies.jsonl in --logs, and
moe-serve's `moe_requests_total` by outcome is read before it stops (a stopped answer counts as aborted).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MODEL = "moe-serve/smollm2-moe-demo"
QUESTION = "What is the capital of France?"
# --rag: a document with one distinctive fact, attached to the chat, and a question about it
FACT = "The secret launch code of Project Heron is 4417."
FACT_MARK = b"Project Heron is 4417"  # in a request body: the document's text reached moe-serve
RAG_QUESTION = "What is the secret launch code of Project Heron?"
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "date", "server"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until `url` answers 200 (or raise if `proc` exits or time runs out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")


def start(cmd: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> subprocess.Popen:
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --- the recording proxy between Open WebUI and moe-serve -------------------------------------

def summarize_body(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    tools = data.get("tools") or []
    summary = {"model": data.get("model"), "stream": data.get("stream"), "has_tools": "tools" in data,
               "tool_names": [t.get("function", {}).get("name") for t in tools if isinstance(t, dict)],
               "n_messages": len(data.get("messages") or []), "keys": sorted(data),
               "carries_fact": FACT_MARK in body}
    given = data.get("input", data.get("prompt")) if "messages" not in data else None
    if given is not None:  # an embedding request: how many inputs, how many characters
        texts = [given] if isinstance(given, str) else given
        summary.update({"n_inputs": len(texts), "input_chars": sum(len(t) for t in texts if isinstance(t, str))})
    return summary


def response_id(body: bytes, stream: bool) -> str | None:
    """The completion's id: the JSON body's, or the first SSE chunk's."""
    try:
        if not stream:
            return json.loads(body).get("id")
        for line in body.decode().splitlines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                return json.loads(line[5:]).get("id")
    except (ValueError, TypeError, AttributeError):
        return None
    return None


def prompt_reuse(log_path: Path) -> dict[str, dict[str, int]]:
    """Per request id, its prompt tokens and how many were reused, from moe-serve's log (Open WebUI
    does not ask for usage in its streams)."""
    found = {}
    for match in re.finditer(r"request (\S+): (\d+) prompt tokens \((\d+) reused\)", log_path.read_text()):
        found[match[1]] = {"prompt_tokens": int(match[2]), "reused": int(match[3])}
    return found


def reply_text(body: bytes, stream: bool) -> str | None:
    """The assistant text of a chat answer: a JSON body, SSE `data:` chunks when streamed, or, from
    Ollama's `/api/chat`, NDJSON lines (streamed or not, a `message` each)."""
    try:
        lines = body.decode().splitlines()
        if lines and lines[0].startswith("{") and '"message"' in lines[0]:  # Ollama's
            return "".join(json.loads(line)["message"].get("content") or "" for line in lines if line)[:300]
        if not stream:
            return json.loads(body)["choices"][0]["message"]["content"][:300]
        parts = []
        for line in lines:
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                choices = json.loads(line[5:]).get("choices") or [{}]
                parts.append(choices[0].get("delta", {}).get("content") or "")
        return "".join(parts)[:300]
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


def make_proxy(upstream_port: int, records: list[dict[str, Any]], in_flight: list[int],
               body_log: Path | None = None) -> type[BaseHTTPRequestHandler]:
    """A handler that forwards to moe-serve, streaming the answer back, and records each request
    in `records` (status None while it runs); in_flight[0] counts the unfinished ones. With `body_log`,
    each request's path and body go to that file, one JSON line each (to replay one in a test)."""
    lock = threading.Lock()

    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends when the connection closes: fine for SSE

        def log_message(self, fmt: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self.forward()

        def do_POST(self) -> None:
            self.forward()

        def forward(self) -> None:
            with lock:
                in_flight[0] += 1
            try:
                self.relay()
            finally:
                with lock:
                    in_flight[0] -= 1

        def relay(self) -> None:
            t0 = time.monotonic()
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            record: dict[str, Any] = {"method": self.command, "path": self.path, "status": None,
                                      **summarize_body(body)}
            records.append(record)  # at once, so that one still running at the end shows
            if body_log is not None and body:
                with lock, open(body_log, "a") as f:
                    f.write(json.dumps({"path": self.path, "body": body.decode("utf-8", "replace")}) + "\n")
            try:
                out = self.pass_on(body, record)
            except OSError as e:
                record["failure"] = f"{type(e).__name__}: {e}"
                return
            finally:
                record["seconds"] = round(time.monotonic() - t0, 1)
            if record["status"] >= 400 or b'"error"' in out:
                record["error_body"] = out[:2000].decode("utf-8", "replace")
            elif self.command == "POST":
                record["reply"] = reply_text(out, bool(record.get("stream")))
                record["id"] = response_id(out, bool(record.get("stream")))

        def pass_on(self, body: bytes, record: dict[str, Any]) -> bytes:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=900)
            try:
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                record["status"] = resp.status
                record["warning"] = resp.getheader("X-Moe-Serve-Warning")
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_HEADERS:
                        self.send_header(k, v)
                self.end_headers()
                out = bytearray()
                while chunk := resp.read1(65536):
                    out += chunk
                    self.wfile.write(chunk)
                    self.wfile.flush()
                return bytes(out)
            finally:
                conn.close()

    return Proxy


class ProxyServer(ThreadingHTTPServer):
    request_queue_size = 1024  # Open WebUI opens one connection per document chunk, all at once (the default is 5)


def start_proxy(upstream_port: int, records: list[dict[str, Any]], in_flight: list[int],
                body_log: Path | None = None) -> ThreadingHTTPServer:
    handler = make_proxy(upstream_port, records, in_flight, body_log)
    server = ProxyServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# --- the two servers ---------------------------------------------------------------------------

def start_moe_serve(python: str, port: int, log_path: Path, extra_args: list[str], repo: Path = REPO) -> subprocess.Popen:
    proc = start([python, "-m", "server", "--port", str(port), *extra_args], dict(os.environ), log_path, repo)
    wait_http(f"http://127.0.0.1:{port}/health", 300, proc)
    return proc


def open_webui_env(api_port: int, data_dir: Path, connection: str, rag: bool = False,
                   no_tasks: bool = False, autocomplete: bool = False) -> dict[str, str]:
    """`connection`: "openai" (Open WebUI's OpenAI connection to /v1) or "ollama" (its Ollama one, /api).
    `rag`: its embedding engine is moe-serve too, through the same API (as a user sets it in Admin →
    Settings → Documents), with the served model as the embedding model."""
    env = dict(os.environ)
    if connection == "ollama":
        env.update({"OLLAMA_BASE_URL": f"http://127.0.0.1:{api_port}", "ENABLE_OLLAMA_API": "true",
                    "ENABLE_OPENAI_API": "false"})
    else:
        env.update({"OPENAI_API_BASE_URL": f"http://127.0.0.1:{api_port}/v1", "OPENAI_API_KEY": "unused",
                    "ENABLE_OLLAMA_API": "false"})
    env.update({
        "WEBUI_AUTH": "False", "DATA_DIR": str(data_dir),
        # no internet beyond package registries: nothing may be fetched from Hugging Face
        "OFFLINE_MODE": "true", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "RAG_EMBEDDING_ENGINE": "openai", "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "false",
        "RAG_RERANKING_MODEL_AUTO_UPDATE": "false", "WHISPER_MODEL_AUTO_UPDATE": "false",
        "ENABLE_EVALUATION_ARENA_MODELS": "false", "ENABLE_VERSION_UPDATE_CHECK": "false",
        "SCARF_NO_ANALYTICS": "true", "DO_NOT_TRACK": "true", "ANONYMIZED_TELEMETRY": "false",
    })
    if no_tasks:  # Admin → Settings → Interface: no title, tags, follow-ups or retrieval queries from the model
        env.update({name: "false" for name in ("ENABLE_TITLE_GENERATION", "ENABLE_TAGS_GENERATION",
                                               "ENABLE_FOLLOW_UP_GENERATION", "ENABLE_RETRIEVAL_QUERY_GENERATION")})
    if autocomplete:  # Admin → Settings → Interface → Autocomplete Generation (off by default)
        env["ENABLE_AUTOCOMPLETE_GENERATION"] = "true"
    if rag and connection == "ollama":
        env.update({"RAG_EMBEDDING_ENGINE": "ollama", "RAG_OLLAMA_BASE_URL": f"http://127.0.0.1:{api_port}",
                    "RAG_EMBEDDING_MODEL": MODEL})
    elif rag:
        env.update({"RAG_EMBEDDING_ENGINE": "openai", "RAG_OPENAI_API_BASE_URL": f"http://127.0.0.1:{api_port}/v1",
                    "RAG_OPENAI_API_KEY": "unused", "RAG_EMBEDDING_MODEL": MODEL})
    return env


def start_open_webui(exe: str, port: int, api_port: int, data_dir: Path, log_path: Path, connection: str,
                     rag: bool = False, no_tasks: bool = False, autocomplete: bool = False) -> subprocess.Popen:
    data_dir.mkdir(parents=True, exist_ok=True)
    proc = start([exe, "serve", "--host", "127.0.0.1", "--port", str(port)],
                 open_webui_env(api_port, data_dir, connection, rag, no_tasks, autocomplete), log_path, data_dir)
    wait_http(f"http://127.0.0.1:{port}/health", 600, proc)
    return proc


# --- the browser -------------------------------------------------------------------------------

SELECTED_MODEL = "button[aria-label^='Selected model']"


def dismiss_popups(page: Any) -> None:
    """Open WebUI's first-visit "What's new" dialog, if any."""
    button = page.get_by_role("button", name="Okay, Let's Go!")
    if button.count() and button.first.is_visible():
        button.first.click()
        page.wait_for_timeout(500)


def ensure_model(page: Any) -> str:
    """Pick MODEL in the model selector unless it is already the selected one; return the label."""
    selector = page.locator(SELECTED_MODEL).first
    selector.wait_for(timeout=30_000)
    if MODEL not in (selector.get_attribute("aria-label") or ""):
        selector.click()
        page.get_by_text(MODEL, exact=True).last.click()
        page.wait_for_timeout(500)
    return page.locator(SELECTED_MODEL).first.get_attribute("aria-label") or ""


def send_question(page: Any, text: str = QUESTION) -> None:
    page.locator("#chat-input").click()
    page.keyboard.type(text)
    page.locator("#send-message-button").click()


def last_answer(page: Any) -> str:
    answers = page.locator("#response-content-container")
    return answers.last.inner_text().strip() if answers.count() else ""


def wait_answer(page: Any, timeout_s: float, answers_before: int = 0) -> str:
    """Wait until a new answer has finished (its Regenerate button shows) or an error shows."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        new = page.locator("#response-content-container").count() > answers_before
        if new and page.locator("button[aria-label='Regenerate']").count() and last_answer(page):
            break
        if error_texts(page):
            break
        page.wait_for_timeout(500)
    return last_answer(page)


def error_texts(page: Any) -> list[str]:
    """Error (and warning) toasts and in-chat error boxes Open WebUI shows."""
    texts = []
    for sel in ("[data-sonner-toast][data-type='error']", "[data-sonner-toast][data-type='warning']",
                "[role='alert']", ".text-red-500",
                "div[class*='border-red']", "div[class*='bg-red']"):
        for el in page.locator(sel).all():
            text = el.inner_text().strip()
            if text and el.is_visible():
                texts.append(text)
    return texts


def write_document(folder: Path) -> Path:
    """A small text file of a few paragraphs, FACT in the middle one."""
    filler = ("Project Heron is a fictional programme used to test document retrieval. Its team meets on "
              "Tuesdays in the north building, and its reports are filed in the blue cabinet. ")
    paragraphs = [filler * 3, "Among its records one line matters more than the rest. " + FACT + " "
                  "Nobody outside the team is supposed to know it.", filler * 2
                  + "The programme's mascot is a grey heron called Horace, painted on the door."]
    path = folder / "project_heron.txt"
    path.write_text("\n\n".join(paragraphs) + "\n")
    return path


def attach_file(page: Any, path: Path, timeout_s: float) -> dict[str, Any]:
    """Attach `path` through the chat's file input, as a file picked in the + menu, and wait until Open
    WebUI has processed it (its chip in the message input shows and no spinner turns) or an error shows."""
    inputs = page.locator("input[type='file'][multiple]")
    t0 = time.monotonic()
    inputs.first.set_input_files(str(path))
    chip = page.locator("#message-input-container").get_by_text(path.name)
    spinner = page.locator("#message-input-container .spinner_ajPY")
    deadline = time.monotonic() + timeout_s
    processed = False
    while time.monotonic() < deadline:
        if chip.count() and not spinner.count():
            processed = True
            break
        if error_texts(page):
            break
        page.wait_for_timeout(250)
    return {"file": path.name, "bytes": path.stat().st_size, "file_inputs_on_page": inputs.count(),
            "processed": processed, "chip_shown": bool(chip.count()),
            "seconds_attach_to_processed": round(time.monotonic() - t0, 1), "errors_after_attach": error_texts(page)}


KNOWLEDGE_NAME = "Heron records"


def toasts(page: Any) -> list[str]:
    """Every toast Open WebUI shows now (success ones too), as "type: text"."""
    return [f"{el.get_attribute('data-type')}: {el.inner_text().strip()}"
            for el in page.locator("[data-sonner-toast]").all() if el.is_visible()]


def create_knowledge(page: Any, url: str, path: Path, timeout_s: float) -> dict[str, Any]:
    """Workspace → Knowledge → create a collection named KNOWLEDGE_NAME, upload `path` into it through the
    collection page's file input, and wait for Open WebUI's "File added successfully." (or an error) toast."""
    seen: list[str] = []
    page.goto(f"{url}/workspace/knowledge/create", wait_until="load", timeout=120_000)
    name = page.get_by_placeholder("Name your knowledge base")
    name.wait_for(timeout=120_000)
    name.fill(KNOWLEDGE_NAME)
    page.get_by_placeholder("Describe your knowledge base and objectives").fill("Records of Project Heron")
    page.get_by_role("button", name="Create Knowledge").click()
    page.wait_for_url(re.compile(r".*/workspace/knowledge/(?!create)[^/]+$"), timeout=120_000)
    knowledge_id = page.url.rstrip("/").rsplit("/", 1)[-1]
    seen += toasts(page)
    page.locator("#files-input").wait_for(state="attached", timeout=60_000)
    t0 = time.monotonic()
    page.locator("#files-input").set_input_files(str(path))
    deadline = time.monotonic() + timeout_s
    added = False
    while time.monotonic() < deadline:
        now = toasts(page)
        seen += [t for t in now if t not in seen]
        if any("File added successfully" in t for t in now):
            added = True
            break
        if any(t.startswith(("error", "warning")) for t in now):
            break
        page.wait_for_timeout(250)
    seconds = round(time.monotonic() - t0, 1)
    page.wait_for_timeout(2000)
    seen += [t for t in toasts(page) if t not in seen]
    return {"knowledge_id": knowledge_id, "file": path.name, "bytes": path.stat().st_size, "added": added,
            "seconds_upload_to_added": seconds, "file_listed": bool(page.get_by_text(path.name).count()),
            "toasts": seen, "errors_after_upload": error_texts(page)}


def reference_knowledge(page: Any) -> dict[str, Any]:
    """In the chat input type `#` and the collection's first word, pick the collection from the list."""
    page.locator("#chat-input").click()
    page.keyboard.type("#" + KNOWLEDGE_NAME.split()[0])
    option = page.locator("button[data-selected]").filter(has_text=KNOWLEDGE_NAME).first
    option.wait_for(timeout=60_000)
    options = [b.inner_text().strip() for b in page.locator("button[data-selected]").all()]
    option.click()
    page.wait_for_timeout(1000)
    chip = page.locator("#message-input-container").get_by_text(KNOWLEDGE_NAME)
    return {"options_after_hash": options, "chip_shown": bool(chip.count()),
            "input_after_pick": page.locator("#chat-input").inner_text().strip()}


def wait_quiet(in_flight: list[int], max_s: float) -> None:
    """Let the requests Open WebUI sends after an answer (title, tags, follow-ups) finish."""
    deadline = time.monotonic() + max_s
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        if in_flight[0]:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > 10:
            return
        time.sleep(1)


# --- --actions: what a user clicks in a chat after the first answer -------------------------------

LONG_QUESTION = "Write a very long story about a dragon who learns to cook, in at least twenty paragraphs."
EDITED_QUESTION = "What is the capital of Italy?"
AFTER_STOP_QUESTION = "What is the capital of Spain?"
IMAGE_QUESTION = "What colour is this picture?"


def write_png(folder: Path) -> Path:
    """An 8×8 red PNG (no imaging library needed)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + b"\xff\x00\x00" * 8 for _ in range(8))
    path = folder / "red.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    return path


def answer_texts(page: Any) -> list[str]:
    return [el.inner_text().strip() for el in page.locator("#response-content-container").all()]


def wait_streamed(page: Any, timeout_s: float) -> str:
    """After a click that starts an answer in place (regenerate, continue, an edited question): wait for the
    stream to begin (the Stop button shows) and end (it goes, the Regenerate button is back)."""
    stop_button = page.locator("button[aria-label='Stop']")
    with contextlib.suppress(Exception):
        stop_button.first.wait_for(timeout=20_000)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and stop_button.count() and not error_texts(page):
        page.wait_for_timeout(500)
    page.wait_for_timeout(1000)
    return last_answer(page)


def click_last(page: Any, selector: str) -> bool:
    """Hover the last answer (its action buttons may show on hover only) and click the last `selector`."""
    answers = page.locator("#response-content-container")
    if answers.count():
        answers.last.hover()
    buttons = page.locator(selector)
    if not buttons.count():
        return False
    buttons.last.click()
    return True


def edit_question(page: Any, question: str, text: str) -> dict[str, Any]:
    """Hover the user message `question`, click its Edit button, replace the text and press Send. Every message
    has an Edit button (shown on hover): from the last, the first whose edit box holds `question` is its."""
    edits = page.locator("button[aria-label='Edit']")
    n = edits.count()
    for i in reversed(range(n)):
        page.get_by_text(question, exact=True).last.hover()
        edits.nth(i).click(force=True)
        box = page.locator("[id^='message-edit-']").first  # the user message's edit box
        with contextlib.suppress(Exception):
            box.wait_for(timeout=5_000)
        if not box.count() or box.evaluate("e => e.value ?? e.innerText").strip() != question:  # an answer's
            cancel = page.get_by_role("button", name="Cancel", exact=True)
            if cancel.count():
                cancel.last.click()
            page.wait_for_timeout(500)
            continue
        box.fill(text)
        page.get_by_role("button", name="Send", exact=True).last.click()
        return {"edit_buttons": n, "edited": True, "edit_button_index": i}
    return {"edit_buttons": n, "edited": False}


def run_actions(page: Any, args: argparse.Namespace, url: str, records: list[dict[str, Any]],
                in_flight: list[int]) -> list[dict[str, Any]]:
    """Regenerate, edit the question, stop a long answer, continue it, ask again, attach an image, and a
    temporary chat: each with the requests it caused (indexes into `records`) and what the page showed."""
    done: list[dict[str, Any]] = []

    def step(name: str, act: Any) -> None:
        first = len(records)
        t0 = time.monotonic()
        try:
            shown = act()
        except Exception as e:  # noqa: BLE001 - record what broke and go on with the next action
            shown = {"failure": f"{type(e).__name__}: {e}"}
        wait_quiet(in_flight, args.settle)
        done.append({"action": name, "seconds": round(time.monotonic() - t0, 1), **shown,
                     "requests": list(range(first, len(records))), "errors_seen": error_texts(page),
                     "toasts": toasts(page)})

    def regenerate() -> dict[str, Any]:
        before = last_answer(page)
        clicked = click_last(page, "button[aria-label='Regenerate']")
        page.get_by_text("Try Again", exact=True).last.click()  # the button opens a menu (or a suggestion)
        return {"clicked": clicked, "answer_before": before, "answer": wait_streamed(page, args.answer_timeout)}

    def edit() -> dict[str, Any]:
        shown = edit_question(page, QUESTION, EDITED_QUESTION)
        return {**shown, "answer": wait_streamed(page, args.answer_timeout), "answers_on_page": answer_texts(page)}

    def stop_after(words: int) -> dict[str, Any]:
        """Once the streaming answer has `words` words, click Stop (the story would run to max_tokens)."""
        stop_button = page.locator("button[aria-label='Stop']")
        stop_button.first.wait_for(timeout=60_000)
        deadline = time.monotonic() + args.answer_timeout
        while time.monotonic() < deadline and len(last_answer(page).split()) < words and stop_button.count():
            page.wait_for_timeout(250)
        partial = last_answer(page)
        if stop_button.count():
            stop_button.first.click()
        page.wait_for_timeout(3000)
        return {"partial_at_stop": partial, "answer_after_stop": last_answer(page),
                "stop_button_gone": not stop_button.count()}

    def stop_midway() -> dict[str, Any]:
        send_question(page, LONG_QUESTION)
        return stop_after(12)

    def continue_response() -> dict[str, Any]:
        before = last_answer(page)
        clicked = click_last(page, "button[aria-label='Continue Response']")
        shown = stop_after(len(before.split()) + 12)  # the user stops it again once it has gone on
        answer = last_answer(page)
        return {"clicked": clicked, "answer_before": before, "answer": answer, **shown,
                "continues_it": answer.startswith(before[:40]) and len(answer) > len(before)}

    def ask_again() -> dict[str, Any]:
        n = page.locator("#response-content-container").count()
        send_question(page, AFTER_STOP_QUESTION)
        return {"answer": wait_streamed(page, args.answer_timeout), "answers_before": n}

    def image() -> dict[str, Any]:
        png = write_png(Path(tempfile.mkdtemp(prefix="owui-img-")))
        page.locator("input[type='file'][multiple]").first.set_input_files(str(png))
        page.wait_for_timeout(3000)
        attached = {"toasts_after_attach": toasts(page), "errors_after_attach": error_texts(page),
                    "image_in_input": bool(page.locator("#message-input-container img").count())}
        n = page.locator("#response-content-container").count()
        send_question(page, IMAGE_QUESTION)
        page.wait_for_timeout(3000)
        return {**attached, "answer": wait_answer(page, args.answer_timeout, n)}

    def temporary_chat() -> dict[str, Any]:
        page.goto(f"{url}/?temporary-chat=true", wait_until="load", timeout=120_000)
        page.locator("#chat-input").wait_for(timeout=180_000)
        dismiss_popups(page)
        ensure_model(page)
        send_question(page)
        return {"answer": wait_answer(page, args.answer_timeout),
                "temporary_shown": bool(page.get_by_text("Temporary Chat").count())}

    def autocomplete() -> dict[str, Any]:
        """The user's Settings → Interface → Prompt Autocompletion on (the admin's switch is the env var), then
        type the start of a question in a new chat and wait for Open WebUI's suggestion."""
        status = page.evaluate("""async () => (await fetch('/api/v1/users/user/settings/update', {method: 'POST',
            headers: {'Content-Type': 'application/json', Authorization: 'Bearer ' + localStorage.token},
            body: JSON.stringify({ui: {promptAutocomplete: true}})})).status""")
        page.goto(url, wait_until="load", timeout=120_000)
        page.locator("#chat-input").wait_for(timeout=180_000)
        dismiss_popups(page)
        ensure_model(page)
        page.locator("#chat-input").click()
        page.keyboard.type("What is the capital of", delay=80)
        page.wait_for_timeout(20_000)
        return {"settings_update_status": status, "input_after": page.locator("#chat-input").inner_text()}

    for name, act in [("regenerate", regenerate), ("edit question and resend", edit),
                      ("stop a streaming answer", stop_midway), ("continue response", continue_response),
                      ("next message after stop", ask_again), ("attach an image", image),
                      ("temporary chat", temporary_chat), ("autocomplete", autocomplete)]:
        step(name, act)
    return done


def run_browser(args: argparse.Namespace, url: str, records: list[dict[str, Any]],
                in_flight: list[int]) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(url, wait_until="load", timeout=120_000)  # socket.io: never "networkidle"
        page.locator("#chat-input").wait_for(timeout=180_000)  # minutes on a loaded CPU
        dismiss_popups(page)
        selected = ensure_model(page)
        attached = None
        if args.knowledge:
            doc = args.attach or write_document(Path(tempfile.mkdtemp(prefix="owui-doc-")))
            attached = create_knowledge(page, url, doc, args.answer_timeout)
            page.goto(url, wait_until="load", timeout=120_000)  # a new chat
            page.locator("#chat-input").wait_for(timeout=180_000)
            dismiss_popups(page)
            selected = ensure_model(page)
            attached["reference"] = reference_knowledge(page)
        elif args.rag:
            attached = attach_file(page, args.attach or write_document(Path(tempfile.mkdtemp(prefix="owui-doc-"))),
                                   args.answer_timeout)
        t0 = time.monotonic()
        send_question(page, RAG_QUESTION if args.rag else QUESTION)
        answer = wait_answer(page, args.answer_timeout)
        seconds = time.monotonic() - t0
        wait_quiet(in_flight, args.settle)
        follow_up = None
        if args.follow_up:
            answers_before = page.locator("#response-content-container").count()
            t1 = time.monotonic()
            send_question(page, args.follow_up)
            page.wait_for_timeout(3000)  # the last answer's Regenerate button goes while the new one streams
            follow_up = {"question": args.follow_up, "answer": wait_answer(page, args.answer_timeout, answers_before),
                         "seconds_to_answer": round(time.monotonic() - t1, 1)}
            wait_quiet(in_flight, args.settle)
        actions = run_actions(page, args, url, records, in_flight) if args.actions else None
        page.wait_for_timeout(2000)
        errors = error_texts(page)
        toasts_at_end = toasts(page)
        args.screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(args.screenshot))
        title = page.title()
        browser.close()
    found = {"contains_4417": "4417" in answer, "attached": attached} if args.rag else {"contains_paris": "Paris" in answer}
    return {"answer": answer, **found, "seconds_to_answer":
            round(seconds, 1), "follow_up": follow_up, "errors_seen": errors, "model_selected": selected,
            "page_title": title, "toasts_at_end": toasts_at_end, **({"actions": actions} if actions else {})}


# --- main --------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--open-webui", default="/tmp/owui-venv/bin/open-webui", help="its executable")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("--moe-python", default=sys.executable, help="python with moe-serve installed")
    p.add_argument("--moe-port", type=int, default=0, help="0: a free port")
    p.add_argument("--webui-port", type=int, default=0, help="0: a free port")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="Open WebUI's DATA_DIR; default: a fresh temporary folder (a first visit)")
    p.add_argument("--logs", type=Path, default=REPO / "bench" / "out")
    p.add_argument("--screenshot", type=Path, default=REPO / "bench" / "out" / "open_webui_chat.png")
    p.add_argument("--answer-timeout", type=float, default=300)
    p.add_argument("--follow-up", default=None, help="a second question in the same chat, after the first answer")
    p.add_argument("--connection", choices=["openai", "ollama"], default="openai",
                   help="Open WebUI's connection to moe-serve: OpenAI's API (/v1) or Ollama's (/api)")
    p.add_argument("--moe-arg", action="append", default=[], metavar="ARG",
                   help="one more moe-serve argument (repeat it: --moe-arg=--max-model-len --moe-arg=96)")
    p.add_argument("--server-repo", type=Path, default=REPO, help="checkout whose server runs (e.g. an older commit)")
    p.add_argument("--rag", action="store_true",
                   help="documents: Open WebUI embeds through moe-serve (same connection); a text file is "
                        "attached to the chat and the question is about it")
    p.add_argument("--knowledge", action="store_true",
                   help="like --rag, but the file goes into a Workspace → Knowledge collection, referenced in the "
                        "chat with #")
    p.add_argument("--attach", type=Path, default=None, help="with --rag, this file instead of a written one")
    p.add_argument("--no-tasks", action="store_true",
                   help="turn off Open WebUI's background tasks (title, tags, follow-ups, retrieval queries): on a "
                        "slow CPU each of them goes before the answer")
    p.add_argument("--actions", action="store_true",
                   help="after the first answer: regenerate, edit the question, stop a long answer, continue it, "
                        "ask again, attach an image, a temporary chat (each with its requests)")
    p.add_argument("--settle", type=float, default=300,
                   help="at most this long after the answer for Open WebUI's background requests")
    args = p.parse_args()
    args.rag = args.rag or args.knowledge
    return args


def main() -> None:
    args = parse_args()
    # a run started in the background ignores SIGINT: on SIGTERM, still stop the servers (the `finally`)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="owui-data-"))
    args.logs.mkdir(parents=True, exist_ok=True)
    moe_port, webui_port = args.moe_port or free_port(), args.webui_port or free_port()
    records: list[dict[str, Any]] = []
    in_flight = [0]
    procs: list[subprocess.Popen] = []
    result: dict[str, Any] = {}
    try:
        procs.append(start_moe_serve(args.moe_python, moe_port, args.logs / "moe_serve.log", args.moe_arg,
                                     args.server_repo))
        body_log = args.logs / "request_bodies.jsonl" if args.rag or args.actions else None
        if body_log is not None:
            body_log.unlink(missing_ok=True)
        proxy = start_proxy(moe_port, records, in_flight, body_log)
        procs.append(start_open_webui(args.open_webui, webui_port, proxy.server_port,
                                      args.data_dir, args.logs / "open_webui.log", args.connection, args.rag,
                                      args.no_tasks, args.actions))
        result = run_browser(args, f"http://127.0.0.1:{webui_port}", records, in_flight)
        if args.actions:  # did a stopped answer stop generating: moe-serve's request outcomes
            with urllib.request.urlopen(f"http://127.0.0.1:{moe_port}/metrics", timeout=10) as r:
                result["moe_requests_total"] = re.findall(r'^moe_requests_total\{status="(\w+)"\} (\S+)',
                                                          r.read().decode(), re.M)
    except Exception as e:  # report what broke, with what was recorded up to then
        result["failure"] = f"{type(e).__name__}: {e}"
    finally:
        for proc in reversed(procs):
            stop(proc)
    reuse = prompt_reuse(args.logs / "moe_serve.log")
    for record in records:
        record.update(reuse.get(record.get("id"), {}))
    result["moe_serve_status_codes"] = [r["status"] for r in records]
    if args.rag:
        embeds = [r for r in records if "embed" in r["path"]]
        result["embedding_requests"] = {"count": len(embeds), "inputs": sum(r.get("n_inputs", 0) for r in embeds),
                                        "statuses": sorted({str(r["status"]) for r in embeds}),
                                        "seconds": [r.get("seconds") for r in embeds]}
        result["chat_requests_carrying_document"] = [r["path"] for r in records
                                                     if r.get("n_messages") and r.get("carries_fact")]
    result["moe_serve_requests"] = records
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
