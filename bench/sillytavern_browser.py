"""SillyTavern in a real headless browser, chatting with moe-serve's built-in demo model.

Not a pytest test and not imported by the suite: it needs SillyTavern (Node.js), Chromium and Playwright,
which the project's CI does not have. Install and run it by hand:

    mkdir -p /tmp/st-app && npm install --prefix /tmp/st-app sillytavern      # 1.19.0 when this was written
    /tmp/owui-venv/bin/python bench/sillytavern_browser.py --moe-python .venv/bin/python \
        --sillytavern /tmp/st-app/node_modules/sillytavern --chromium /usr/bin/chromium \
        --screenshot bench/out/sillytavern_chat.png

(the interpreter that runs it needs Playwright; --moe-python is the one with moe-serve installed, run with the
repository as its working directory.)

It starts moe-serve (`python -m server`, the demo model), a recording proxy in front of it (the one of
bench/open_webui_browser.py: every request's path, status and body keys) and SillyTavern
(`node server.js --listen false --whitelist false --browserLaunchEnabled false`, its config and data folder in a
fresh temporary folder). Then, in headless Chromium, for each connection (`--connections`, by default all):

- openai: Chat Completion, source "Custom (OpenAI-compatible)", URL http://127.0.0.1:P/v1
- llamacpp, ollama, vllm, generic: Text Completion with that API type, URL http://127.0.0.1:P (vLLM's and
  Generic's with /v1, as SillyTavern's placeholders show)

it sets the connection up in the API Connections panel as a user does, turns streaming on (AI Response
Configuration panel), clicks Connect, picks the model, opens the default character Seraphina, sends a message
and waits for the streamed reply, then Continue, Regenerate, a message stopped mid-stream with the stop
button, and one more message that must be answered. It records the requests SillyTavern made to moe-serve
through the proxy, any error toast, and whether each reply appeared, then prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench.open_webui_browser as owui  # noqa: E402 - the path above first
from bench.open_webui_browser import (  # noqa: E402
    MODEL,
    REPO,
    free_port,
    start,
    start_moe_serve,
    start_proxy,
    stop,
    wait_http,
)

CONNECTIONS = ["openai", "llamacpp", "ollama", "vllm", "generic"]
# per Text Completion API type: the URL input, the model <select> (None: none to pick) and the URL's path
TEXTGEN = {
    "llamacpp": ("#llamacpp_api_url_text", "#llamacpp_model", ""),
    "ollama": ("#ollama_api_url_text", "#ollama_model", ""),
    "vllm": ("#vllm_api_url_text", "#vllm_model", "/v1"),
    "generic": ("#generic_api_url_text", "#generic_model_select", "/v1"),
}


def start_sillytavern(app: Path, port: int, run_dir: Path, log_path: Path) -> subprocess.Popen:
    """SillyTavern's own server on loopback, its default config.yaml and a fresh data folder (the first
    start copies its default content: the character Seraphina, presets)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text((app / "default" / "config.yaml").read_text())
    cmd = ["node", "server.js", "--configPath", str(run_dir / "config.yaml"), "--dataRoot", str(run_dir / "data"),
           "--port", str(port), "--listen", "false", "--whitelist", "false", "--browserLaunchEnabled", "false"]
    proc = start(cmd, dict(os.environ), log_path, app)
    wait_http(f"http://127.0.0.1:{port}/", 600, proc)
    return proc


# --- the browser -------------------------------------------------------------------------------

def toasts(page: Any) -> list[str]:
    """The error and warning toasts SillyTavern shows (toastr)."""
    out = []
    for el in page.locator("#toast-container .toast-error, #toast-container .toast-warning").all():
        try:
            out.append(el.inner_text().strip()[:300])
        except Exception:  # noqa: BLE001 - a toast that faded while read
            pass
    return out


def dismiss_welcome(page: Any) -> None:
    """The first visit's "Welcome to SillyTavern!" dialog asks for a persona name: keep "User"."""
    dialog = page.locator("dialog[open]", has_text="Persona Name")
    try:
        dialog.first.wait_for(timeout=15_000)
    except Exception:  # noqa: BLE001 - not a first visit
        return
    dialog.first.locator(".popup-button-ok").click()
    page.wait_for_timeout(1000)


def toggle_drawer(page: Any, icon: str, want_open: bool) -> None:
    el = page.locator(icon)
    is_open = "openIcon" in (el.get_attribute("class") or "")
    if is_open != want_open:
        el.click()
        page.wait_for_timeout(800)


def set_response(page: Any, checkbox: str, length_input: str, tokens: int) -> None:
    """In the AI Response Configuration panel: streaming on, and the response length (tokens)."""
    toggle_drawer(page, "#leftNavDrawerIcon", True)
    box = page.locator(checkbox)
    box.scroll_into_view_if_needed()
    box.check()
    length = page.locator(length_input)
    length.scroll_into_view_if_needed()
    length.fill(str(tokens))
    length.dispatch_event("input")
    toggle_drawer(page, "#leftNavDrawerIcon", False)


def status_text(page: Any, block: str) -> str:
    return page.locator(f"{block} .online_status_text").first.inner_text().strip()


def wait_connected(page: Any, block: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = status_text(page, block)
        if text and not text.startswith(("No connection", "Not connected", "Connecting")):
            return text
        page.wait_for_timeout(500)
    return text


def connect(page: Any, kind: str, base: str, tokens: int) -> dict[str, Any]:
    """Set the connection up in the API Connections panel and press Connect; pick the model."""
    toggle_drawer(page, "#API-status-top", True)
    out: dict[str, Any] = {}
    if kind == "openai":
        page.locator("#main_api").select_option("openai")
        page.locator("#chat_completion_source").select_option("custom")
        page.locator("#custom_api_url_text").fill(f"{base}/v1")
        page.locator("#custom_model_id").fill("")
        page.locator("#api_button_openai").click()
        out["status"] = wait_connected(page, "#openai_api")
        select = page.locator("#model_custom_select")
        options = select.locator("option").all_inner_texts()
        out["models_offered"] = options
        if any(MODEL in o for o in options):
            select.select_option(MODEL)
        page.wait_for_timeout(500)
        out["model"] = page.locator("#custom_model_id").input_value()
        toggle_drawer(page, "#API-status-top", False)
        set_response(page, "#stream_toggle", "#openai_max_tokens", tokens)
        return out
    url_input, model_select, suffix = TEXTGEN[kind]
    page.locator("#main_api").select_option("textgenerationwebui")
    page.locator("#textgen_type").select_option(kind)
    page.locator(url_input).fill(f"{base}{suffix}")
    page.locator("#api_button_textgenerationwebui").click()
    out["status"] = wait_connected(page, "#kobold_horde")
    select = page.locator(model_select)
    options = select.locator("option").all_inner_texts()
    out["models_offered"] = options
    if any(MODEL in o for o in options):
        select.select_option(MODEL)
        page.wait_for_timeout(500)
    out["model"] = select.input_value()
    toggle_drawer(page, "#API-status-top", False)
    set_response(page, "#streaming_textgenerationwebui", "#amount_gen_counter", tokens)
    return out


def open_character(page: Any, name: str = "Seraphina") -> None:
    toggle_drawer(page, "#rightNavDrawerIcon", True)
    page.locator("#rm_button_characters").click()
    page.locator(".character_select", has_text=name).first.click()
    page.wait_for_timeout(1500)
    toggle_drawer(page, "#rightNavDrawerIcon", False)


def last_reply(page: Any) -> str:
    mes = page.locator("#chat .mes[is_user='false'] .mes_text")
    return mes.last.inner_text().strip() if mes.count() else ""


def generating(page: Any) -> bool:
    return page.locator("#mes_stop").is_visible()


def wait_reply(page: Any, before: str, timeout_s: float) -> dict[str, Any]:
    """Wait until the generation ends (the stop button goes) and say whether a new reply text shows."""
    t0 = time.monotonic()
    page.wait_for_timeout(1000)
    while time.monotonic() - t0 < timeout_s and generating(page):
        page.wait_for_timeout(500)
    text = last_reply(page)
    return {"reply": text[:300], "new_text_shown": bool(text) and text != before,
            "seconds": round(time.monotonic() - t0, 1), "timed_out": generating(page)}


def send(page: Any, text: str, timeout_s: float) -> dict[str, Any]:
    before = last_reply(page)
    page.locator("#send_textarea").fill(text)
    page.locator("#send_but").click()
    return wait_reply(page, before, timeout_s)


def option(page: Any, item: str, timeout_s: float) -> dict[str, Any]:
    before = last_reply(page)
    page.locator("#options_button").click()
    page.wait_for_timeout(300)
    page.locator(item).click()
    return wait_reply(page, before, timeout_s)


def stop_mid_stream(page: Any, text: str) -> dict[str, Any]:
    before = last_reply(page)
    page.locator("#send_textarea").fill(text)
    page.locator("#send_but").click()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60 and (last_reply(page) == before or not generating(page)):
        page.wait_for_timeout(200)
    streaming_seen = generating(page) and last_reply(page) != before
    if generating(page):
        page.locator("#mes_stop").click()
    page.wait_for_timeout(2000)
    return {"streaming_seen": streaming_seen, "partial": last_reply(page)[:200], "stopped": not generating(page)}


def run_connection(page: Any, kind: str, base: str, records: list[dict[str, Any]], timeout_s: float,
                   tokens: int) -> dict[str, Any]:
    first = len(records)
    result: dict[str, Any] = {"connection": kind}
    try:
        result.update(connect(page, kind, base, tokens))
        result["connect_requests"] = [(r["method"], r["path"], r["status"]) for r in records[first:]]
        open_character(page)
        result["send"] = send(page, "Hello! Who are you?", timeout_s)
        result["continue"] = option(page, "#option_continue", timeout_s)
        result["regenerate"] = option(page, "#option_regenerate", timeout_s)
        result["stop"] = stop_mid_stream(page, "Tell me a long story about the forest.")
        result["after_stop"] = send(page, "Thank you. Where are we?", timeout_s)
    except Exception as e:  # noqa: BLE001 - report what broke with what was recorded
        result["failure"] = f"{type(e).__name__}: {str(e)[:500]}"
    result["toasts"] = toasts(page)
    result["requests"] = [{k: r.get(k) for k in ("method", "path", "status", "stream", "keys", "error_body",
                                                  "failure")} for r in records[first:]]
    result["requests"] = [{k: v for k, v in r.items() if v is not None} for r in result["requests"]]
    return result


def run_browser(args: argparse.Namespace, url: str, base: str, records: list[dict[str, Any]]
                ) -> list[dict[str, Any]]:
    from playwright.sync_api import sync_playwright

    results = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, headless=True)
        for kind in args.connections:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url, wait_until="load", timeout=120_000)
            page.locator("#send_textarea").wait_for(timeout=60_000)
            page.wait_for_timeout(3000)
            dismiss_welcome(page)
            results.append(run_connection(page, kind, base, records, args.answer_timeout, args.tokens))
            args.screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.screenshot.with_name(f"{args.screenshot.stem}_{kind}.png")))
            if kind == args.connections[0]:
                page.screenshot(path=str(args.screenshot))
            page.close()
        browser.close()
    return results


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sillytavern", type=Path, default=Path("/tmp/st-app/node_modules/sillytavern"))
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("--moe-python", default=sys.executable, help="python with moe-serve installed")
    p.add_argument("--moe-port", type=int, default=0, help="0: a free port")
    p.add_argument("--st-port", type=int, default=0, help="0: a free port")
    p.add_argument("--run-dir", type=Path, default=None, help="SillyTavern's config and data; default: a fresh one")
    p.add_argument("--logs", type=Path, default=REPO / "bench" / "out")
    p.add_argument("--screenshot", type=Path, default=REPO / "bench" / "out" / "sillytavern_chat.png")
    p.add_argument("--answer-timeout", type=float, default=180)
    p.add_argument("--tokens", type=int, default=48, help="the response length set in SillyTavern")
    p.add_argument("--connections", nargs="+", choices=CONNECTIONS, default=CONNECTIONS)
    p.add_argument("--attach", action="store_true",
                   help="use a moe-serve and a SillyTavern already running on --moe-port and --st-port")
    p.add_argument("--server-repo", type=Path, default=REPO, help="checkout whose server runs (e.g. an older commit)")
    return p.parse_args()


def keep_bodies(path: Path) -> None:
    """Also write each request's whole body to `path` (JSON lines), to replay it in a test."""
    summarize = owui.summarize_body

    def summarize_and_keep(body: bytes) -> dict[str, Any]:
        if body:
            with open(path, "a") as f:
                f.write(body.decode("utf-8", "replace").replace("\n", " ") + "\n")
        return summarize(body)

    owui.summarize_body = summarize_and_keep


def main() -> None:
    args = parse_args()
    args.run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="st-run-"))
    args.logs.mkdir(parents=True, exist_ok=True)
    moe_port, st_port = args.moe_port or free_port(), args.st_port or free_port()
    keep_bodies(args.logs / "sillytavern_bodies.jsonl")
    records: list[dict[str, Any]] = []
    procs: list[subprocess.Popen] = []
    result: dict[str, Any] = {}
    try:
        if not args.attach:
            procs.append(start_moe_serve(args.moe_python, moe_port, args.logs / "moe_serve.log", [],
                                         args.server_repo))
        proxy = start_proxy(moe_port, records, [0])
        if not args.attach:
            procs.append(start_sillytavern(args.sillytavern, st_port, args.run_dir, args.logs / "sillytavern.log"))
        result["connections"] = run_browser(args, f"http://127.0.0.1:{st_port}/",
                                            f"http://127.0.0.1:{proxy.server_port}", records)
    except Exception as e:  # noqa: BLE001 - report what broke, with what was recorded up to then
        result["failure"] = f"{type(e).__name__}: {e}"
    finally:
        for proc in reversed(procs):
            stop(proc)
    result["moe_serve_status_codes"] = [r["status"] for r in records]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
