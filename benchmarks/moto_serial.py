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
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from typing import Any

ACCESS_KEY = SECRET_KEY = "testing"
REGION = "us-east-1"


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


class SerialMotoServer:
    """The server above in a process of its own, on a free loopback port, for as long as the object lives."""

    def __init__(self, *, startup_timeout: float = 60.0) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.moto_serial", "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
        )
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/data.json", timeout=1).read()
                return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the moto server did not start on {self.endpoint}") from None
                time.sleep(0.1)

    def env(self) -> dict[str, str]:
        """Environment that points boto and s3fs at this server with dummy credentials."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
        }

    def new_bucket(self) -> str:
        import boto3

        name = f"tbp-{uuid.uuid4().hex[:16]}"
        client = boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )
        client.create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    _serve(args.host, args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
