"""One stub HTTP server for the tests of engines, reloads and the doctor: fixed answers by path, every request logged."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class _Handler(http.server.BaseHTTPRequestHandler):
    # path (query string ignored; "*": any other path) → a JSON-able answer, or bytes sent as they are
    routes: dict[str, object] = {}
    log: list[tuple[str, object]] = []
    delay = 0.0

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        raw = self.rfile.read(length) if length else b""
        body: object = json.loads(raw) if raw else None
        path = self.path.split("?")[0]
        self.log.append((path, body))
        time.sleep(self.delay)
        reply = self.routes.get(path, self.routes.get("*"))
        self.send_response(200 if reply is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        if isinstance(reply, bytes):
            self.wfile.write(reply)
        else:
            self.wfile.write(json.dumps(reply if reply is not None else {"detail": "Not Found"}).encode())

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    def log_message(self, *args) -> None:
        pass


@contextmanager
def stub_servers() -> Iterator:
    """Yields ``start(routes, delay=0.0) -> (url, log)``: a server on a free local port answering GET and POST on
    ``routes[path]`` (or ``routes["*"]``; 404 elsewhere) after ``delay`` seconds, ``log`` a list of ``(path, json body)`` in arrival order; every
    server started is stopped on exit."""
    servers = []

    def start(routes: dict[str, object], delay: float = 0.0):
        log: list[tuple[str, object]] = []
        handler = type("Handler", (_Handler,), {"routes": routes, "log": log, "delay": delay})
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}", log

    try:
        yield start
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
