"""A loopback engine for the benchmark: serves the scaled capture on every
path, advanced by one poll per request (so kvwatch sees real increases), over
HTTP/1.1 keep-alive. Run as a separate process so its CPU and GIL stay out of
the measured process; prints its URL on stdout once it listens.

    python benchmarks/pageserver.py --fixtures tests/fixtures --engines 8
"""

from __future__ import annotations

import argparse
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pages import AdvancingPage, capture_text, scale  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fixtures", required=True)
    parser.add_argument("--engines", type=int, default=1)
    args = parser.parse_args()
    page = AdvancingPage(scale(capture_text(Path(args.fixtures)), args.engines))
    lock = threading.Lock()
    polls = [0]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in separate writes: without this, Nagle and
        # the client's delayed ACK hold each response for 40 ms.
        disable_nagle_algorithm = True

        def log_message(self, *args):
            pass

        def do_GET(self):
            with lock:
                poll = polls[0]
                polls[0] += 1
            body = page.render(poll).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request, client_address):
            pass  # a client that hung up mid-answer (a fetch past its deadline) is no news

    server = Server(("127.0.0.1", 0), Handler)
    host, port = server.server_address[:2]
    print(f"http://{host}:{port}/metrics", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
