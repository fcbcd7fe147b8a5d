"""Which web pages may call the server from a browser (CORS, `--allowed-origins`).

A browser sends the page's origin with every cross-site request and lets the page read the answer
only if the server names that origin in `Access-Control-Allow-Origin`. Chat pages opened from
local files or local dev servers, editor webviews (VS Code), and desktop apps built on Electron or
Tauri (Obsidian's plugins, ...) call a local model server straight from such a page. By default the
server allows them, and only them, as Ollama does: any other web site the user happens to visit must
not be able to drive the local model. `*` allows every origin (vLLM's and llama.cpp's default).

A pattern is an origin in which `*` stands for any run of characters (`https://*.example.com`,
`chrome-extension://*`); comparison ignores case.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from starlette.datastructures import Headers

LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]", "0.0.0.0")
APP_SCHEMES = ("app", "file", "tauri", "vscode-webview", "vscode-file")  # desktop apps' and editors' pages
LOCAL_ORIGINS = tuple(
    [f"{scheme}://{host}{port}" for host in LOCAL_HOSTS for scheme in ("http", "https") for port in ("", ":*")]
    + [f"{scheme}://*" for scheme in APP_SCHEMES]
)
ANY_ORIGIN = "*"


@dataclass(frozen=True)
class OriginPolicy:
    patterns: tuple[str, ...]

    @classmethod
    def from_setting(cls, setting: str | None) -> OriginPolicy:
        """`--allowed-origins`: None is the local default; otherwise comma-separated patterns."""
        if setting is None:
            return cls(LOCAL_ORIGINS)
        return cls(tuple(pattern.strip() for pattern in setting.split(",") if pattern.strip()))

    @property
    def allows_any(self) -> bool:
        return ANY_ORIGIN in self.patterns

    @property
    def regex(self) -> str:
        """One regular expression that matches exactly the allowed origins (fully, case-insensitively)."""
        alternatives = "|".join(re.escape(pattern.lower()).replace(r"\*", ".*") for pattern in self.patterns)
        return f"(?i:{alternatives})" if alternatives else "(?!)"

    def allows(self, origin: str) -> bool:
        return self.allows_any or re.fullmatch(self.regex, origin) is not None


def refused_origin(headers: Headers, policy: OriginPolicy) -> str | None:
    """The request's `Origin` if the policy refuses it; a page served by this server itself (its
    origin's host is the request's Host, as for /docs) is always let through."""
    origin = headers.get("origin")
    if origin is None or policy.allows(origin):
        return None
    host = headers.get("host", "")
    if host and origin.partition("://")[2].lower() == host.lower():
        return None
    return origin
