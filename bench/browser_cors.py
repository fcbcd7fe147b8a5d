"""A web page calling moe-serve straight from a real headless browser (CORS, `--allowed-origins`).

Not a pytest test: it needs Chromium and Playwright, which CI does not have. Run it by hand:

    /tmp/owui-venv/bin/python -m bench.browser_cors --moe-python .venv/bin/python

It starts moe-serve on the demo model (no API key, the default; `--api-key` to set one), and serves one small chat page from two
origins: `http://localhost:P` (a local page, allowed by default) and `http://127.0.0.2:Q` (standing
for any other site). In Chromium each copy of the page streams a chat completion with `fetch`
(a preflighted request: JSON body and `Authorization`), then sends a "simple" cross-site POST that
skips the preflight (`text/plain`), as a hostile page could. It prints one JSON object: what each page
read, the tokens the server generated meanwhile (its /metrics) and the statuses in its access log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench.open_webui_browser import MODEL, QUESTION, REPO, free_port, start, stop, wait_http

API_KEY = "sk-browser-cors"  # sent by the chat page always, required by the server only with --api-key
PAGE = """<!doctype html><html><body><pre id="out">running</pre><script>
CONSTANTS
async function chat() {
  const response = await fetch(SERVER + "/v1/chat/completions", {method: "POST",
    headers: {"Content-Type": "application/json", "Authorization": "Bearer " + KEY},
    body: JSON.stringify({model: MODEL, stream: true, max_tokens: 24, temperature: 0,
                          messages: [{role: "user", content: QUESTION}]})});
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let text = "", buffer = "", chunks = 0;
  for (;;) {
    const {done, value} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    const lines = buffer.split("\\n"); buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
      const delta = JSON.parse(line.slice(6)).choices[0]?.delta?.content; chunks += 1;
      if (delta) text += delta;
    }
  }
  return {status: response.status, chunks, text};
}
async function simplePost() {  // no preflight: the browser sends it whatever the server says
  const response = await fetch(SERVER + "/v1/chat/completions", {method: "POST", mode: "no-cors",
    headers: {"Content-Type": "text/plain"},
    body: JSON.stringify({model: MODEL, messages: [{role: "user", content: QUESTION}]})});
  return {type: response.type};
}
async function attempt(step) {
  try { return await step(); } catch (e) { return {error: String(e)}; }
}
(async () => {
  const result = {chat: await attempt(chat), simple_post: await attempt(simplePost)};
  document.getElementById("out").textContent = JSON.stringify(result);
})();
</script></body></html>"""


def page_server(host: str, port: int, html: str) -> ThreadingHTTPServer:
    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def tokens_generated(server_url: str) -> float:
    """The server's count of generated tokens, from /metrics: it moves only if the model ran."""
    request = urllib.request.Request(f"{server_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return float(re.search(r"^moe_generated_tokens_total (\S+)$", text, re.M).group(1))


def chat_statuses(log_path: Path) -> list[str]:
    """The status of every chat completion in the server's access log, in order."""
    return re.findall(r'"(?:POST|OPTIONS) /v1/chat/completions HTTP/1.1" (\d+)', log_path.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--moe-python", default=str(REPO / ".venv/bin/python"))
    p.add_argument("--server-repo", type=Path, default=REPO, help="checkout whose server runs (e.g. an older commit)")
    p.add_argument("--api-key", action="store_true", help="start the server with an API key")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("--timeout", type=float, default=300, help="seconds for the server to load and each page")
    args = p.parse_args()

    from playwright.sync_api import sync_playwright

    port = free_port()
    server_url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkdtemp()) / "moe-serve.log"
    env = {**os.environ, **({"MOE_SERVE_API_KEY": API_KEY} if args.api_key else {})}
    proc = start([args.moe_python, "-m", "server", "--port", str(port)], env, log_path, args.server_repo)
    constants = {"SERVER": server_url, "KEY": API_KEY, "MODEL": MODEL, "QUESTION": QUESTION}
    html = PAGE.replace("CONSTANTS", "".join(f"const {name} = {json.dumps(value)};\n" for name, value in constants.items()))
    pages = {"local page": ("localhost", free_port()), "other site": ("127.0.0.2", free_port())}
    servers = [page_server("127.0.0.1" if host == "localhost" else host, port_, html) for host, port_ in pages.values()]
    results: dict = {"server": server_url}
    try:
        wait_http(f"{server_url}/health", args.timeout, proc)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=args.chromium, headless=True)
            for name, (host, page_port) in pages.items():
                before = tokens_generated(server_url), len(chat_statuses(log_path))
                page = browser.new_page()
                page.goto(f"http://{host}:{page_port}/")
                page.wait_for_function("document.getElementById('out').textContent !== 'running'",
                                       timeout=args.timeout * 1000)
                results[name] = {"origin": f"http://{host}:{page_port}",
                                 "page_read": json.loads(page.text_content("#out")),
                                 "tokens_generated_by_the_server": tokens_generated(server_url) - before[0],
                                 "statuses_in_the_server_log": chat_statuses(log_path)[before[1]:]}
                page.close()
            browser.close()
    finally:
        stop(proc)
        for server in servers:
            server.shutdown()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
