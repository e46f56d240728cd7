"""An S3 API on 127.0.0.1 for benchmarks with many clients: moto's server with its requests handled one at a time.

moto's in-memory S3 is not safe under concurrent requests: a listing that runs while another request deletes a
key of the same bucket fails with ``KeyError`` inside moto and answers HTTP 500 (16 threads doing put, list,
copy and delete saw 96 of 12,800 requests fail). With 32 ranks committing at once that exhausts any client's
retries, which real S3 never would. Here the server still accepts connections on many threads (keep-alive
works), but one lock serializes moto's own handling of a request.

    python -m benchmarks.moto_serial --port 5000        # serves until killed
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def _serve(host: str, port: int) -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()

    def serialized(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        with lock:
            return list(app(environ, start_response))  # the body is made inside the lock too

    os.environ.setdefault("MOTO_PORT", str(port))
    run_simple(host, port, serialized, threaded=True, request_handler=MotoRequestHandler)


def serial_moto_server() -> Any:
    """The server above in a process of its own on a free loopback port: the tests' ``MotoServer`` (``tests/s3.py``:
    start-up wait, ``env()``, ``new_bucket()``, ``stop()``) running this module instead of moto's own server."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from s3 import MotoServer

    return MotoServer(
        startup_timeout=60.0, command=lambda port: [sys.executable, "-m", "benchmarks.moto_serial", "--port", str(port)]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    _serve(args.host, args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
