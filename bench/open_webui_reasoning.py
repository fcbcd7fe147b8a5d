"""Open WebUI (headless Chromium) against moe-serve's real app over a scripted Qwen3-thinking engine:
does the thinking show as Open WebUI's reasoning block, apart from the answer? (bench/RESULTS.md)

Run with the Open WebUI venv's python (Playwright), from the repo root:
  /tmp/owui-venv/bin/python -m bench.open_webui_reasoning --moe-python .venv/bin/python

Reuses bench/open_webui_browser.py: the recording proxy, the
Open WebUI start-up and env, the page helpers. Adds: the scripted server, reasoning in the
proxy's reply record, reading the thinking block off the page, and a second screenshot with it
expanded.
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

import bench.open_webui_browser as base

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"  # logs and screenshots
base.MODEL = "qwen3-thinking-scripted"


def reply_text(body: bytes, stream: bool) -> Any:
    """content and reasoning of a chat completion (JSON body, or SSE chunks)."""
    try:
        if not stream:
            msg = json.loads(body)["choices"][0]["message"]
            return {"finish_reason": json.loads(body)["choices"][0].get("finish_reason"),
                    "content": (msg.get("content") or "")[:300],
                    "reasoning_content": msg.get("reasoning_content"), "reasoning": msg.get("reasoning")}
        content, rc, r, keys = [], [], [], set()
        for line in body.decode().splitlines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                choices = json.loads(line[5:]).get("choices") or [{}]
                d = choices[0].get("delta", {}) if choices else {}
                keys |= set(d)
                content.append(d.get("content") or "")
                rc.append(d.get("reasoning_content") or "")
                r.append(d.get("reasoning") or "")
        return {"content": "".join(content)[:300], "reasoning_content": "".join(rc)[:300],
                "reasoning": "".join(r)[:300], "delta_keys": sorted(keys)}
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


base.reply_text = reply_text
_orig_summarize = base.summarize_body


def summarize_body(body: bytes) -> dict[str, Any]:
    out = _orig_summarize(body)
    try:
        data = json.loads(body)
        for k in ("max_tokens", "max_completion_tokens", "chat_template_kwargs", "reasoning_effort"):
            if k in data:
                out[k] = data[k]
        out["first_user_text"] = str(data["messages"][-1].get("content"))[:120]
    except Exception:
        pass
    return out


base.summarize_body = summarize_body


def start_scripted(python: str, port: int, delay: float, log_path: Path) -> subprocess.Popen:
    proc = base.start([python, "-m", "bench.scripted_thinking_server", "--port", str(port), "--delay", str(delay)],
                      dict(os.environ), log_path, REPO)
    base.wait_http(f"http://127.0.0.1:{port}/health", 120, proc)
    return proc


def run_browser(args: argparse.Namespace, url: str, in_flight: list[int]) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    out: dict[str, Any] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        console: list[str] = []
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"[:400]) if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: console.append(f"pageerror: {e}"[:400]))
        page.goto(url, wait_until="load", timeout=120_000)
        page.locator("#chat-input").wait_for(timeout=60_000)
        base.dismiss_popups(page)
        out["model_selected"] = base.ensure_model(page)
        t0 = time.monotonic()
        base.send_question(page)
        # while streaming: snapshot what the thinking block says (e.g. "Thinking...")
        mid = []
        for _ in range(40):
            page.wait_for_timeout(250)
            t = base.last_answer(page)
            if t and (not mid or mid[-1] != t):
                mid.append(t)
            if page.locator("button[aria-label='Regenerate']").count():
                break
        out["texts_while_streaming"] = mid[:12]
        out["answer_container_text"] = base.wait_answer(page, args.answer_timeout)
        out["seconds_to_answer"] = round(time.monotonic() - t0, 1)
        base.wait_quiet(in_flight, args.settle)
        page.wait_for_timeout(2000)
        out["errors_seen"] = base.error_texts(page)
        page.screenshot(path=str(OUT / "open_webui_reasoning.png"))
        container = page.locator("#response-content-container").last
        out["container_html_collapsed"] = container.inner_html()[:8000]
        # the thinking block: a collapsible whose header reads "Thought for ..." / "Thinking..."
        header = container.get_by_text("Thought for", exact=False)
        if not header.count():
            header = container.get_by_text("Thinking", exact=False)
        out["thinking_header_count"] = header.count()
        if header.count():
            out["thinking_header_text"] = header.first.inner_text().strip()
            header.first.click()
            page.wait_for_timeout(1500)
        out["answer_container_text_expanded"] = container.inner_text().strip()
        out["container_html_expanded"] = container.inner_html()[:8000]
        page.screenshot(path=str(OUT / "open_webui_reasoning_expanded.png"))
        out["errors_seen_after_expand"] = base.error_texts(page)
        out["console"] = console[:50]
        out["page_title"] = page.title()
        browser.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--open-webui", default="/tmp/owui-venv/bin/open-webui")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--moe-python", default=sys.executable, help="python with moe-serve installed")
    ap.add_argument("--delay", type=float, default=0.1, help="seconds per scripted token")
    ap.add_argument("--answer-timeout", type=float, default=300)
    ap.add_argument("--settle", type=float, default=300)
    args = ap.parse_args()
    logs = OUT
    logs.mkdir(parents=True, exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="owui-data-"))
    moe_port, webui_port = base.free_port(), base.free_port()
    records: list[dict[str, Any]] = []
    in_flight = [0]
    procs: list[subprocess.Popen] = []
    result: dict[str, Any] = {}
    try:
        procs.append(start_scripted(args.moe_python, moe_port, args.delay, logs / "moe_serve_reasoning.log"))
        proxy = base.start_proxy(moe_port, records, in_flight)
        procs.append(base.start_open_webui(args.open_webui, webui_port, proxy.server_port, data_dir,
                                           logs / "open_webui_reasoning.log"))
        result = run_browser(args, f"http://127.0.0.1:{webui_port}", in_flight)
    except Exception as e:
        import traceback
        result["failure"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    finally:
        for proc in reversed(procs):
            base.stop(proc)
    result["moe_serve_status_codes"] = [r["status"] for r in records]
    for r in records:
        if len(r.get("tool_names") or []) > 3:
            r["tool_names"] = f"{len(r['tool_names'])} tools"
    result["moe_serve_requests"] = records
    result["data_dir"] = str(data_dir)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
