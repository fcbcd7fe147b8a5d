"""moe-serve's HTTP server: OpenAI wire types, routes, SSE, configuration and the CLI."""

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("moe-serve")
except PackageNotFoundError:  # running from a source tree that is not installed
    VERSION = "dev"
