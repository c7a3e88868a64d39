"""Exit 0 when the MLflow server answers ``/health`` with ``OK``, else 1.

    python infra/mlflow/healthcheck.py [URL]     # default http://127.0.0.1:$MLFLOW_PORT/health

Used by the compose file and the image's HEALTHCHECK; ``/health`` needs no login
even with the basic-auth app.
"""

import os
import sys
import urllib.request


def main() -> int:
    url = sys.argv[1] if len(sys.argv) > 1 else f"http://127.0.0.1:{os.environ.get('MLFLOW_PORT', '5000')}/health"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - a fixed http URL
            healthy = response.status == 200 and response.read().strip() == b"OK"
    except OSError as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    if not healthy:
        print(f"unhealthy: {url} did not answer OK", file=sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
