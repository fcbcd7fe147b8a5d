"""`moe-serve` / `python -m server`: parse the configuration, build the app, run uvicorn."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

from server.config import ConfigError, ServerConfig, build_parser, load_config

log = logging.getLogger("moe_serve")

STARTUP_FAILURE = 3  # uvicorn's exit status when it cannot start


def main(argv: Sequence[str] | None = None) -> None:
    try:
        server_config, engine_config = load_config(argv)
    except ConfigError as e:
        build_parser().error(str(e))  # exits 2 with the usage line
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    warn_if_exposed(server_config)

    import uvicorn  # after parsing, so that `--help` and bad flags answer at once

    from server.app import create_app
    from server.serving import SHUTDOWN_GRACE_S

    failures: list[str] = []

    def stop_on_load_failure(reason: str) -> None:
        failures.append(reason)  # /health would answer 503 forever: a dead end, so exit
        server.should_exit = True

    app = create_app(server_config, engine_config, on_load_failure=stop_on_load_failure)
    # past the drain, aborted streams need a moment for their error event and [DONE]
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level="info",
                            timeout_graceful_shutdown=server_config.drain_timeout + SHUTDOWN_GRACE_S)
    server = uvicorn.Server(config)
    server.handle_exit = _draining(server.handle_exit, app)
    listening = _listen(config, server_config)
    log.info("serving %s on http://%s:%d/v1", engine_config.model or "the built-in demo model",
             _url_host(server_config.host), listening.getsockname()[1])
    try:
        server.run(sockets=[listening])
    except KeyboardInterrupt:
        pass
    if failures:
        log.error("moe-serve: could not load the model: %s", failures[0])
        sys.exit(1)
    if not server.started:  # e.g. the port is taken; uvicorn has said why
        sys.exit(STARTUP_FAILURE)


def _listen(config, server_config: ServerConfig):
    """The bound listening socket. Bound before uvicorn starts the app, which starts loading the
    model: a port in use ends the start at once instead of after a load of minutes."""
    try:
        return config.bind_socket()  # uvicorn's own binding (address family, SO_REUSEADDR)
    except SystemExit:  # uvicorn has logged the OSError
        log.error("moe-serve: cannot listen on %s:%d; if another server uses that port, stop it or pick "
                  "another --port", _url_host(server_config.host), server_config.port)
        raise


def _draining(handle_exit: Callable, app) -> Callable:
    """uvicorn's signal handler, which also starts the drain: uvicorn stops accepting, and running
    requests get --drain-timeout to finish."""

    def handle(sig, frame) -> None:
        serving = getattr(app.state, "serving", None)  # none before the app has started
        if serving is not None:
            serving.begin_drain()
        handle_exit(sig, frame)

    return handle


def warn_if_exposed(config: ServerConfig) -> None:
    if config.is_loopback or config.api_key is not None:
        return
    bar = "!" * 78
    for line in (
        bar,
        f"moe-serve is binding {config.host}:{config.port}, which other machines can reach,",
        "and no API key is set: ANYONE on the network can use this server and its GPU.",
        "Set --api-key KEY (or MOE_SERVE_API_KEY), or bind --host 127.0.0.1.",
        bar,
    ):
        log.warning(line)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


if __name__ == "__main__":
    main()
