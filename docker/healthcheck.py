"""Container health check: exit 0 when moe-serve's `/health` answers 200, else 1.

Used by the Dockerfile's HEALTHCHECK and docker/compose*.yaml. It asks 127.0.0.1 on the port the server
listens on inside the container ($MOE_SERVE_PORT, 8000 by default) with plain http.client, which, unlike
urllib, never sends the request to an HTTP(S)_PROXY set for model downloads. `/health` needs no API key.
"""

from __future__ import annotations

import http.client
import os
import sys

TIMEOUT_S = 8  # below the HEALTHCHECK --timeout, so a hung server is reported by us, with a reason


def check(port: int, timeout: float = TIMEOUT_S) -> str | None:
    """None when healthy, else why not."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        body = response.read(500).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as e:
        return f"no answer on port {port}: {e}"
    finally:
        connection.close()
    return None if response.status == 200 else f"/health answered {response.status}: {body}"


def main() -> int:
    problem = check(int(os.environ.get("MOE_SERVE_PORT") or 8000))
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
