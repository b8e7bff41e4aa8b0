"""A loopback HTTP server whose answers a test scripts: body, status,
headers, delays, trickling, cut-off bodies. Used to play an engine."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Answer:
    body: bytes | str = b""
    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
    delay: float = 0.0  # before the status line
    trickle: float = 0.0  # seconds between bytes
    declared_length: int | None = None  # a Content-Length that lies (cut-off body)
    close_after: int | None = None  # bytes sent before the connection drops


class PageServer:
    """Serves `answers` in order on every path (the last one repeats)."""

    def __init__(self, answers: list[Answer] | None = None):
        self.answers: list[Answer] = list(answers or [])
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                server.requests.append({"path": self.path, "headers": dict(self.headers)})
                answer = server.next_answer()
                body = answer.body.encode() if isinstance(answer.body, str) else answer.body
                if answer.delay:
                    time.sleep(answer.delay)
                try:
                    self.send_response(answer.status)
                    for key, value in answer.headers.items():
                        self.send_header(key, value)
                    self.send_header("Content-Length", str(answer.declared_length or len(body)))
                    self.end_headers()
                    to_send = body if answer.close_after is None else body[: answer.close_after]
                    if answer.trickle:
                        for i in range(len(to_send)):
                            self.wfile.write(to_send[i:i + 1])
                            self.wfile.flush()
                            time.sleep(answer.trickle)
                    else:
                        self.wfile.write(to_send)
                    if answer.close_after is not None or answer.declared_length:
                        self.close_connection = True
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def next_answer(self) -> Answer:
        if len(self.answers) > 1:
            return self.answers.pop(0)
        return self.answers[0] if self.answers else Answer(status=404)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/metrics"

    def __enter__(self) -> "PageServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
