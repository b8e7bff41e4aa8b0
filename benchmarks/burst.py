"""The scrapers of the /metrics benchmark, in one thread of their own process.

N keep-alive connections; each round writes one GET on every connection at
once, then reads all answers with one selector and stamps each when its last
byte arrives. One thread and its own process keep the client's cost out of
the server's process and off the GIL the server's handlers need, and it is
small enough to measure: the same bursts against `--serve-bytes` (a server
that answers pre-built bytes of a given size) are the client's own floor.

    python benchmarks/burst.py --port 9400 --path /metrics --scrapers 50 --rounds 60
    python benchmarks/burst.py --serve-bytes 182000      # prints its port, serves until killed

Prints one JSON object: {"latencies": [seconds, ...], "errors": n}.
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import sys
import time

# Pauses after a round is answered, in turn: bursts land on every phase of a 1 s poll.
PAUSES = (0.05, 0.11, 0.17, 0.23, 0.29)


class Connection:
    """One scraper's keep-alive connection and the answer it is reading."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.buffer = bytearray(1 << 16)
        self.reset()

    def reset(self) -> None:
        self.got = 0           # bytes of this answer so far (head and body)
        self.total = None      # head + Content-Length, once the head is in
        self.status = b""
        self.started = 0.0

    def read(self) -> bool:
        """Read what has arrived; True once the whole answer is in."""
        while True:
            if self.got == len(self.buffer):  # grow: the next answer of this size then reads without copies
                self.buffer.extend(bytes(len(self.buffer)))
            try:
                read = self.sock.recv_into(memoryview(self.buffer)[self.got:])
            except BlockingIOError:
                return False
            if not read:
                raise OSError("connection closed")
            self.got += read
            if self.total is None:
                end = self.buffer.find(b"\r\n\r\n", 0, self.got)
                if end >= 0:
                    head = bytes(self.buffer[:end])
                    self.status = head.split(b"\r\n", 1)[0]
                    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:"))
                    self.total = end + 4 + length
            if self.total is not None and self.got >= self.total:
                if self.got > self.total:
                    raise OSError("more bytes than the answer announced")
                return True


def bursts(port: int, path: str, scrapers: int, rounds: int, headers: str = "") -> tuple[list[float], int]:
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/plain\r\n{headers}\r\n".encode()
    connections = [Connection(port) for _ in range(scrapers)]
    selector = selectors.DefaultSelector()
    for connection in connections:
        selector.register(connection.sock, selectors.EVENT_READ, connection)
    latencies: list[float] = []
    errors = 0
    try:
        for index in range(rounds):
            for connection in connections:
                connection.reset()
                connection.started = time.perf_counter()
                if connection.sock.send(request) != len(request):  # a few dozen bytes into an empty buffer
                    raise OSError("request not sent whole")
            waiting = len(connections)
            deadline = time.monotonic() + 10
            while waiting:
                if time.monotonic() > deadline:
                    raise OSError(f"{waiting} answers missing after 10 s")
                for key, _ in selector.select(timeout=1.0):
                    connection = key.data
                    if connection.total is not None and connection.got >= connection.total:
                        continue
                    if connection.read():
                        latencies.append(time.perf_counter() - connection.started)
                        if not connection.status.startswith(b"HTTP/1.1 200"):
                            errors += 1
                        waiting -= 1
            time.sleep(PAUSES[index % len(PAUSES)])
    except (OSError, StopIteration, ValueError) as exc:
        print(f"burst: {exc}", file=sys.stderr)
        errors += 1
    finally:
        for connection in connections:
            connection.sock.close()
    return latencies, errors


def serve_bytes(size: int) -> None:
    """The client's floor: answer every request on every connection with the
    same pre-built bytes (size bytes of body), one thread, one selector."""
    answer = (f"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {size}\r\n\r\n".encode()
              + b"x" * size)
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    listener.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    pending: dict[socket.socket, memoryview] = {}
    print(listener.getsockname()[1], flush=True)
    while True:
        for key, events in selector.select():
            sock = key.fileobj
            if key.data is None:
                client, _ = listener.accept()
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                client.setblocking(False)
                selector.register(client, selectors.EVENT_READ, b"")
                continue
            if events & selectors.EVENT_READ:
                try:
                    chunk = sock.recv(65536)
                except ConnectionError:
                    chunk = b""
                if not chunk:
                    selector.unregister(sock)
                    sock.close()
                    pending.pop(sock, None)
                    continue
                data = key.data + chunk
                requests = data.count(b"\r\n\r\n")
                data = data[data.rfind(b"\r\n\r\n") + 4:] if requests else data
                out = pending.get(sock, memoryview(b"")).tobytes() + answer * requests
                pending[sock] = memoryview(out)
                selector.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, data)
            if events & selectors.EVENT_WRITE and sock in pending:
                try:
                    sent = sock.send(pending[sock])
                except BlockingIOError:
                    sent = 0
                pending[sock] = pending[sock][sent:]
                if not len(pending[sock]):
                    del pending[sock]
                    selector.modify(sock, selectors.EVENT_READ, key.data)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int)
    parser.add_argument("--path", default="/metrics")
    parser.add_argument("--scrapers", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--gzip", action="store_true", help="send Accept-Encoding: gzip, as Prometheus does")
    parser.add_argument("--serve-bytes", type=int, help="serve this many bytes of body to every request instead")
    args = parser.parse_args()
    if args.serve_bytes is not None:
        serve_bytes(args.serve_bytes)
        return 0
    latencies, errors = bursts(args.port, args.path, args.scrapers, args.rounds,
                               "Accept-Encoding: gzip\r\n" if args.gzip else "")
    print(json.dumps({"latencies": latencies, "errors": errors}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
