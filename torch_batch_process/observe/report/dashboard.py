"""``tbp dashboard``: the report page served live on localhost while the job runs.

A standard-library :class:`~http.server.ThreadingHTTPServer` bound to ``127.0.0.1`` (never another interface:
reach it from elsewhere through ``ssh -L``) serves:

- ``/``: the report page in live mode: it fetches ``data.json`` every ``refresh_s`` seconds and updates its text
  and plots in place (zoom kept); while nothing is stored yet, a page that reloads itself;
- ``/data.json``: the page's model (see :func:`~torch_batch_process.observe.report.page.build_model`);
- ``/report.html``: the same page, static, as ``tbp report`` writes it.

Bounded: the stored job is read at most once per ``refresh_s / 2`` seconds whatever the number of browsers (one
read at a time; the others get the latest model), at most :data:`MAX_REQUESTS` requests are served at once (more
get HTTP 503 at once) and a client that stalls is dropped after :data:`SOCKET_TIMEOUT_S`. Ctrl-C (SIGINT) or
SIGTERM stops it cleanly: the listening socket is closed and the command returns 0. ``kill -USR1`` prints every
thread's stack to stderr (a diagnostic; the server goes on).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any

from torch_batch_process.errors import BatchProcessError
from torch_batch_process.observe.report.data import read_job_data
from torch_batch_process.observe.report.page import build_model, render_page
from torch_batch_process.observe.visible_text import visible

__all__ = ["HOST", "MAX_REQUESTS", "SOCKET_TIMEOUT_S", "Dashboard", "serve_dashboard"]

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
MAX_REQUESTS = 8
"""Requests served at once; more are answered 503 at once."""
SOCKET_TIMEOUT_S = 30.0
"""A client silent for this long is dropped."""


class Dashboard:
    """The latest model of a stored job, read again when it is older than half the refresh interval.

    Args:
        storage_path: the job's storage path or URL.
        storage_options: fsspec storage options.
        refresh_s: seconds between the page's updates.
    """

    def __init__(self, storage_path: str, storage_options: dict[str, Any] | None, refresh_s: float) -> None:
        self.storage_path = storage_path
        self.storage_options = storage_options
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._model: dict[str, Any] | None = None
        self._error: str | None = None
        self._read_at = 0.0
        self.reads = 0
        """How many times the stored job was read (for tests and the log)."""

    def model(self) -> tuple[dict[str, Any] | None, str | None]:
        """The latest model (``None`` while nothing can be read) and why it cannot be read (else ``None``)."""
        with self._lock:  # one read at a time; the others wait for it and share its model
            if time.monotonic() - self._read_at >= self.refresh_s / 2:
                try:
                    data = read_job_data(self.storage_path, self.storage_options)
                    self._model = build_model(data, live=True, refresh_s=self.refresh_s)
                    self._error = None
                except BatchProcessError as exc:  # no job yet, a damaged record, storage unreachable
                    self._error = str(exc)
                self._read_at = time.monotonic()
                self.reads += 1
            return self._model, self._error


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = SOCKET_TIMEOUT_S
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        if not self.server.slots.acquire(blocking=False):
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, "text/plain", b"busy: too many requests at once\n")
            return
        try:
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._page(live=True)
            elif path == "/report.html":
                self._page(live=False)
            elif path == "/data.json":
                self._data()
            else:
                self._send(HTTPStatus.NOT_FOUND, "text/plain", b"not found: try /\n")
        finally:
            self.server.slots.release()

    def _page(self, *, live: bool) -> None:
        model, error = self.server.dashboard.model()
        if model is None:
            body = _waiting_page(self.server.dashboard.storage_path, error, self.server.dashboard.refresh_s)
            self._send(HTTPStatus.OK, "text/html; charset=utf-8", body.encode("utf-8"))
            return
        page = render_page(model if live else {**model, "live": False})
        self._send(HTTPStatus.OK, "text/html; charset=utf-8", page.encode("utf-8"))

    def _data(self) -> None:
        model, error = self.server.dashboard.model()
        if model is None:
            body = json.dumps({"error": error}).encode("utf-8")
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, "application/json", body)
            return
        payload = {**model, "error": error}  # a read that failed after a good one: the last model, and why
        self._send(HTTPStatus.OK, "application/json", json.dumps(payload, separators=(",", ":")).encode("utf-8"))

    def _send(self, status: HTTPStatus, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the standard library's name
        logger.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stalled client never keeps the command alive
    request_queue_size = 16

    def __init__(self, port: int, dashboard: Dashboard) -> None:
        self.dashboard = dashboard
        self.slots = threading.BoundedSemaphore(MAX_REQUESTS)
        super().__init__((HOST, port), _Handler)


def _waiting_page(storage_path: str, error: str | None, refresh_s: float) -> str:
    """The page shown while nothing can be read; the path and the error are shown visible (a lone surrogate, as
    a path decoded with ``surrogateescape`` holds, cannot be encoded in UTF-8: the page was never sent)."""
    import html

    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{max(1, round(refresh_s))}"><title>tbp dashboard</title></head>'
        f"<body><h1>tbp dashboard</h1><p>Nothing to show yet for <code>{html.escape(visible(storage_path))}</code>: "
        f"{html.escape(visible(error or 'not read yet'))}</p><p>This page reloads itself every {refresh_s:g} s.</p>"
        "</body></html>"
    )


def serve_dashboard(
    storage_path: str,
    *,
    port: int,
    refresh_s: float,
    storage_options: dict[str, Any] | None = None,
    ready: Callable[[str], None] | None = None,
) -> int:
    """Serves the dashboard of the job at ``storage_path`` on ``127.0.0.1:port`` (``0``: a free port) until
    Ctrl-C or SIGTERM; returns 0.

    Args:
        ready: called with the page's URL once the server listens.

    Raises:
        OSError: the port cannot be used (e.g. already in use).
    """
    dashboard = Dashboard(storage_path, storage_options, refresh_s)
    server = _Server(port, dashboard)
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _interrupt)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)  # kill -USR1: where every thread is
    try:
        host, bound = server.server_address[:2]
        if ready is not None:
            ready(f"http://{host}:{bound}/")
        try:
            server.serve_forever(poll_interval=0.25)
        except KeyboardInterrupt:
            pass
    finally:
        server.server_close()
        signal.signal(signal.SIGTERM, previous)
        faulthandler.unregister(signal.SIGUSR1)
    return 0


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM: stop the way Ctrl-C does."""
    raise KeyboardInterrupt
