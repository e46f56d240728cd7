"""A real S3 API for the tests: a moto server on 127.0.0.1, and a proxy that injects faults in front of it.

The server runs in its own process (``python -m moto.server``), so spawned workers reach it like a
real object store, and its request handling does not compete with the test for the GIL. Nothing
here talks to anything but loopback.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moto_available() -> bool:
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError:
        return False
    return True


class MotoServer:
    """``python -m moto.server`` on a free loopback port, for as long as the object lives.

    Args:
        startup_timeout: seconds to wait for it to answer.
        command: the server's command line for a port (default: moto's own server; the scale benchmark runs
            ``benchmarks.moto_serial``, which handles one request at a time).
    """

    def __init__(self, *, startup_timeout: float = 30.0, command: Callable[[int], list[str]] | None = None) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env.pop("AWS_ENDPOINT_URL", None)
        default = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        argv = command(self.port) if command is not None else default
        self._proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/data.json", timeout=1).read()
                return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server did not start on {self.endpoint}") from None
                time.sleep(0.05)

    def env(self) -> dict[str, str]:
        """Environment that points boto/s3fs at this server with dummy credentials."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
        }

    def client(self, service: str = "s3", **kwargs: Any) -> Any:
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            aws_access_key_id=kwargs.pop("key", ACCESS_KEY),
            aws_secret_access_key=kwargs.pop("secret", SECRET_KEY),
            region_name=REGION,
            **kwargs,
        )

    def new_bucket(self) -> str:
        name = f"tbp-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def enforce_auth(self) -> None:
        """From now on, every request must be signed by an IAM access key and allowed by its policies."""
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth", data=b"0", method="POST", headers={"Content-Type": "text/plain"}
        )
        urllib.request.urlopen(request, timeout=10).read()

    def user_with_policy(self, name: str, statements: list[dict[str, Any]]) -> tuple[str, str]:
        """Creates an IAM user with an inline policy; returns its (access key, secret key)."""
        iam = self.client("iam")
        iam.create_user(UserName=name)
        if statements:
            policy = {"Version": "2012-10-17", "Statement": statements}
            iam.put_user_policy(UserName=name, PolicyName=f"{name}-policy", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)


class FaultProxy:
    """An HTTP proxy on loopback in front of ``upstream`` that answers ``503 Slow Down`` on demand.

    ``max_in_flight`` is the most requests it had under way at once. ``fail_next(n)`` makes the next ``n``
    requests fail; ``fail_randomly(p)`` makes each request fail with probability ``p`` (seeded);
    ``fail_always()`` makes every request fail. Requests are otherwise forwarded unchanged (same path,
    headers and body), so signatures stay valid.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.split("://", 1)[1]
        self.requests = 0
        self.failed = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._next = 0
        self._probability = 0.0
        self._random = random.Random(1234)
        self._always = False
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                with proxy._lock:
                    proxy.in_flight += 1
                    proxy.max_in_flight = max(proxy.max_in_flight, proxy.in_flight)
                try:
                    self._forward()
                finally:
                    with proxy._lock:
                        proxy.in_flight -= 1

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if proxy._should_fail():
                    payload = (
                        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                        b"<Message>Please reduce your request rate.</Message></Error>"
                    )
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":  # a HEAD answer has no body: one would be read as the next answer
                        self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    response = conn.getresponse()
                    data = response.read()
                    self.send_response(response.status, response.reason)
                    for key, value in response.getheaders():
                        if key.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                            self.send_header(key, value)
                    # a HEAD answer's Content-Length is the object's size (its body is empty): keep upstream's
                    length = response.getheader("Content-Length") if self.command == "HEAD" else None
                    self.send_header("Content-Length", length if length is not None else str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    def _should_fail(self) -> bool:
        with self._lock:
            self.requests += 1
            fail = self._always or (self._next > 0) or (self._random.random() < self._probability)
            if self._next > 0:
                self._next -= 1
            if fail:
                self.failed += 1
            return bool(fail)

    def fail_next(self, n: int) -> None:
        with self._lock:
            self._next = n

    def fail_randomly(self, probability: float) -> None:
        with self._lock:
            self._probability = probability

    def fail_always(self, on: bool = True) -> None:
        with self._lock:
            self._always = on

    def heal(self) -> None:
        with self._lock:
            self._next, self._probability, self._always = 0, 0.0, False

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
