"""The simulator as a server: a clock thread advances the simulation at wall time
times `speed`, and a stdlib HTTP server on loopback answers `/metrics`,
`/health`, `/version`, `/v1/models`, `/v1/completions`, `/v1/chat/completions`
(OpenAI style, streaming or not), `/app/metrics` (the RAG application's
histogram), `/sim/phase` (the scenario's phase now and the next, JSON) and,
with a simulated LMCache tier, `/lmcache/metrics` (its page), and with a
simulated router, `/router/metrics` (its page, llm-d EPP's names).
With `temperature: 0` a completion's text depends on its prompt
alone, and `logprobs` brings a logprob per token, also fixed by the prompt.

A request sent over HTTP becomes a request in the engine model; its tokens are
sent as the simulated engine produces them, so with speed 10 a completion that
takes 5 simulated seconds streams in 0.5 s.

For tests of other parts of kvwatch:

    with start_background("exhaustion", speed=20) as sim:
        requests.get(sim.metrics_url)

`speed=0` freezes the clock; move it with `handle.advance(seconds)`.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
import zlib
import heapq
import itertools
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvwatch import __version__
from kvwatch.sim.engine import FINISHED, Request, RequestRejected
from kvwatch.sim.dialects import DIALECTS, TrtllmGauges, render_dialect
from kvwatch.sim.render import CONTENT_TYPE, HttpStats, render_app_metrics, render_metrics
from kvwatch.sim.scenario import Scenario, load_scenario
from kvwatch.sim.simulation import DEFAULT_MODEL_NAME, Simulation
from kvwatch.sim.workload import token_block_hashes
from kvwatch.sim.kvevents import EventPublisher, attach

MAX_BODY_BYTES = 16 * 1024 * 1024


class _Server(ThreadingHTTPServer):
    # The default listen backlog of 5 drops connection attempts when a load
    # generator opens dozens at once; the kernel's retry then adds about 1 s
    # to those requests' first token.
    request_queue_size = 128
    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handlers_lock = threading.Lock()
        self._handlers: dict[socket.socket, threading.Thread] = {}

    def process_request(self, request: Any, client_address: Any) -> None:
        # ThreadingMixIn's, with each connection's thread kept until it ends.
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  name="kvwatch-sim-connection", daemon=True)
        with self._handlers_lock:
            self._handlers[request] = thread
        thread.start()

    def shutdown_request(self, request: Any) -> None:
        with self._handlers_lock:
            self._handlers.pop(request, None)
        super().shutdown_request(request)

    def close_connections(self, timeout: float) -> None:
        """Shuts every open connection (a client's idle keep-alive one too) and
        waits up to `timeout` for their threads: none outlives the server."""
        with self._handlers_lock:
            open_now = list(self._handlers.items())
        for sock, _ in open_now:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed
        deadline = time.monotonic() + timeout
        for _, thread in open_now:
            thread.join(max(0.0, deadline - time.monotonic()))


# A request (its line, headers and body) must arrive whole within this many
# seconds of the connection asking for it, or the connection is shut; an idle
# keep-alive connection is shut after as long. Its answer then has the
# server's request_timeout plus this much: a client that trickles its request
# or never reads its answer holds a handler thread no longer.
REQUEST_READ_SECONDS = 10.0
# One socket operation (a read or a write) waits at most this long.
SOCKET_TIMEOUT_SECONDS = 30.0
# The simulated LMCache tier's own page (`kvwatch sim --lmcache`).
LMCACHE_PATH = "/lmcache/metrics"
# The simulated router's page (`kvwatch sim --router POLICY`).
ROUTER_PATH = "/router/metrics"
# The scenario's phase now and the next, as JSON (`make run` prints it, and
# kvwatch's status page shows it when `demo_target` points here).
PHASE_PATH = "/sim/phase"
# The clock thread sleeps until the next simulated event (a step ending, an
# arrival), at most this long, so streamed tokens leave when the simulated
# engine produces them rather than on a coarse tick.
CLOCK_MAX_SLEEP_SECONDS = 0.02
CLOCK_MIN_SLEEP_SECONDS = 0.0005
# Most simulated seconds one catch-up runs while holding the lock, so /metrics
# stays responsive when a high --speed outruns the CPU (the simulation then lags).
MAX_CATCH_UP_SECONDS = 5.0
# Vocabulary of the simulated model's output; each token is one word, so the
# whitespace tokenizer counts it back exactly.
_WORDS = (
    "cache", "block", "prefix", "token", "engine", "queue", "decode", "prefill", "batch", "page",
    "hit", "miss", "evict", "usage", "latency", "stream", "model", "kernel", "memory", "request",
)


class _TokenStream:
    """Progress of one HTTP request, updated by the engine under the sim lock."""

    __slots__ = ("produced", "finish_reason", "server")

    def __init__(self, server: SimServer) -> None:
        self.produced = 0
        self.finish_reason: str | None = None
        self.server = server

    def __call__(self, request: Request, now: float) -> None:
        self.produced = request.num_output
        if request.state == FINISHED:
            self.finish_reason = request.finish_reason
        self.server.progress += 1


class SimServer:
    def __init__(
        self,
        simulation: Simulation,
        speed: float = 1.0,
        host: str = "127.0.0.1",
        port: int = 0,
        request_timeout: float = 600.0,
        dialect: str = "vllm",
        kv_events: str | None = None,
        kv_report: tuple = (0.0, False),
        read_timeout: float = REQUEST_READ_SECONDS,
        spelling: str = "sglang:",
    ) -> None:
        if speed < 0:
            raise ValueError("speed must be >= 0")
        if dialect not in DIALECTS:
            raise ValueError(f"unknown dialect {dialect!r} (known: {', '.join(DIALECTS)})")
        self.dialect = dialect
        self.spelling = spelling  # the SGLang dialect's: sglang: or sglang_ (SGLANG_SPELLINGS)
        self.trtllm_gauges = TrtllmGauges()
        self.sim = simulation
        self.speed = float(speed)
        self.request_timeout = request_timeout
        self.read_timeout = read_timeout
        self.deadlines = _Deadlines()
        self.cond = threading.Condition()
        self.http_stats = HttpStats(time.time())
        self.stopping = threading.Event()
        self.progress = 0  # bumped by every token or finish of an HTTP request
        self._wake = threading.Event()
        self._offset = 0.0
        self._base_sim = simulation.now
        self._base_wall = time.monotonic()
        self.httpd = _Server((host, port), _Handler)
        self.httpd.sim_server = self  # type: ignore[attr-defined]
        self._threads: list[threading.Thread] = []
        # The engines' KV-cache events in vLLM's wire format (kvwatch/sim/kvevents.py), where asked for.
        self.kv_events = kv_events
        self.kv_publisher = None
        if kv_events:
            attach(simulation.engines, *kv_report)
            self.kv_publisher = EventPublisher(simulation.engines, kv_events, self.cond)

    # -- lifecycle -------------------------------------------------------------

    @property
    def host(self) -> str:
        return str(self.httpd.server_address[0])

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return self.url + "/metrics"

    @property
    def app_metrics_url(self) -> str:
        return self.url + "/app/metrics"

    @property
    def lmcache_metrics_url(self) -> str:
        """The simulated LMCache tier's page (served only with one)."""
        return self.url + LMCACHE_PATH

    @property
    def router_metrics_url(self) -> str:
        """The simulated router's page (served only with one)."""
        return self.url + ROUTER_PATH

    def start(self) -> SimServer:
        serve = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                 name="kvwatch-sim-http", daemon=True)
        serve.start()
        self._threads.append(serve)
        watchdog = threading.Thread(target=self.deadlines.run, args=(self.stopping,),
                                    name="kvwatch-sim-deadlines", daemon=True)
        watchdog.start()
        self._threads.append(watchdog)
        if self.speed > 0:
            clock = threading.Thread(target=self._clock_loop, name="kvwatch-sim-clock", daemon=True)
            clock.start()
            self._threads.append(clock)
        if self.kv_publisher is not None:
            self.kv_publisher.start()
        return self

    def stop(self) -> None:
        if self.stopping.is_set():
            return
        self.stopping.set()
        self._wake.set()
        with self.cond:
            self.cond.notify_all()
        self.httpd.shutdown()
        self.httpd.close_connections(timeout=5)
        self.httpd.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
        if self.kv_publisher is not None:
            self.kv_publisher.stop()

    def __enter__(self) -> SimServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the clock -------------------------------------------------------------

    def catch_up(self) -> None:
        """Advance the simulation to what wall time says it is now (caller holds cond)."""
        if self.speed <= 0:
            return
        target = self._base_sim + self._offset + (time.monotonic() - self._base_wall) * self.speed
        if target > self.sim.now:
            before = self.progress
            self.sim.advance_to(min(target, self.sim.now + MAX_CATCH_UP_SECONDS))
            if self.progress != before:
                self.cond.notify_all()

    def _clock_loop(self) -> None:
        while not self.stopping.is_set():
            with self.cond:
                self.catch_up()
                wait = (self.sim.next_event_time() - self.sim.now) / self.speed
            self._wake.wait(min(CLOCK_MAX_SLEEP_SECONDS, max(CLOCK_MIN_SLEEP_SECONDS, wait)))
            self._wake.clear()

    def submit(self, prompt_len: int, prompt_hashes: list, max_tokens: int, output_len: int,
               progress: _TokenStream) -> Request:
        """Hand an HTTP request to the simulation at the current (wall-derived) time."""
        with self.cond:
            self.catch_up()
            request = self.sim.submit(prompt_len, prompt_hashes, max_tokens, output_len, progress)
        self._wake.set()  # its first step may end before the clock thread's next planned wake-up
        return request

    def advance(self, seconds: float) -> None:
        """Move the simulated clock forward now, on top of what wall time does."""
        with self.cond:
            self._offset += seconds
            self.sim.advance(seconds)
            self.cond.notify_all()
        self._wake.set()

    def metrics_text(self) -> str:
        with self.cond:
            if self.dialect != "vllm":
                return render_dialect(self.dialect, self.sim.engines, self.sim.model_name, self.trtllm_gauges,
                                      self.spelling)
            return render_metrics(self.sim.engines, self.sim.model_name, self.sim.created_unix, self.http_stats)

    def phase_status(self) -> dict:
        """The scenario's phase now and the next (Simulation.phase_status), its
        times in wall seconds at this speed (simulated seconds when the clock
        only moves by hand, speed 0: `clock` says which)."""
        with self.cond:
            self.catch_up()
            status = self.sim.phase_status()
        per = self.speed if self.speed > 0 else 1.0
        for key in ("next_in_seconds", "cycle_seconds"):
            if status[key] is not None:
                status[key] = status[key] / per
        status.update(speed=self.speed, clock="wall" if self.speed > 0 else "simulated")
        return status

    def lmcache_metrics_text(self) -> str | None:
        with self.cond:
            if self.sim.lmcache is None:
                return None
            return self.sim.lmcache.render(self.sim.model_name)

    def router_metrics_text(self) -> str | None:
        with self.cond:
            if self.sim.router is None:
                return None
            return self.sim.router.render(self.sim.model_name)

    def app_metrics_text(self) -> str:
        with self.cond:
            return render_app_metrics(self.sim.app_retrieval, self.sim.created_unix)


def start_background(
    scenario: str | Path | Scenario = "healthy",
    speed: float = 1.0,
    port: int = 0,
    host: str = "127.0.0.1",
    seed: int = 0,
    engines: int | None = None,
    model_name: str = DEFAULT_MODEL_NAME,
    dialect: str = "vllm",
    lmcache_tokens: int | None = None,
    kv_events: str | None = None,
    kv_report: tuple = (0.0, False),
    read_timeout: float = REQUEST_READ_SECONDS,
    spelling: str = "sglang:",
    router: str | None = None,
) -> SimServer:
    """Start a simulator in this process (threads); port 0 picks a free port.
    The handle has .url, .metrics_url, .app_metrics_url, .lmcache_metrics_url,
    .sim, .advance(s), .stop() and works as a context manager.
    `lmcache_tokens`: a simulated LMCache tier of that size (its page at
    .lmcache_metrics_url). `kv_events`: publish the engines' KV-cache events
    to that ZMQ endpoint (kvwatch/sim/kvevents.py); `kv_report`: (the share
    of requests in vLLM's full report mode, whether events name their
    origin[, whose publisher's layout: vllm, sglang, trtllm]). `read_timeout`: the
    seconds a request has to arrive whole (REQUEST_READ_SECONDS). `spelling`:
    the SGLang dialect's names, sglang: or sglang_ (sample lines rewritten).
    `router`: a simulated router of that policy (its page at .router_metrics_url)."""
    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario)
    simulation = Simulation(scenario, seed=seed, engines=engines, model_name=model_name,
                            lmcache_tokens=lmcache_tokens, router=router)
    return SimServer(simulation, speed=speed, host=host, port=port, dialect=dialect, kv_events=kv_events,
                     kv_report=kv_report, read_timeout=read_timeout, spelling=spelling).start()


# -- HTTP ----------------------------------------------------------------------


class _Deadlines:
    """One thread's watch over every connection's deadline: at its deadline a
    connection is shut down (its handler's read or write then fails at once),
    whatever the client does. A socket timeout alone bounds one read, and a
    client sending one byte a second never hits it."""

    TICK_SECONDS = 0.05

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, tuple[float, socket.socket]] = {}
        self._ids = itertools.count()
        self.shut = 0  # connections shut at their deadline

    def arm(self, sock: socket.socket, deadline: float, ident: int | None = None) -> int:
        """Watches `sock` until `deadline` (time.monotonic()); with `ident`,
        moves that watch's deadline. Returns the watch's id."""
        ident = next(self._ids) if ident is None else ident
        with self._lock:
            self._armed[ident] = (deadline, sock)
            heapq.heappush(self._heap, (deadline, ident))
            if len(self._heap) > 2 * len(self._armed) + 64:  # moved and finished watches: drop them
                self._heap = [(at, key) for key, (at, _) in self._armed.items()]
                heapq.heapify(self._heap)
        return ident

    def disarm(self, ident: int) -> None:
        with self._lock:
            self._armed.pop(ident, None)
            if not self._armed:
                self._heap.clear()

    def expire(self, now: float) -> None:
        due = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                deadline, ident = heapq.heappop(self._heap)
                armed = self._armed.get(ident)
                if armed is not None and armed[0] == deadline:
                    del self._armed[ident]
                    due.append(armed[1])
        for sock in due:
            self.shut += 1
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

    def run(self, stopping: threading.Event) -> None:
        while not stopping.wait(self.TICK_SECONDS):
            self.expire(time.monotonic())


class _BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _words_of_messages(messages: Any) -> list[str]:
    if not isinstance(messages, list) or not messages:
        raise _BadRequest("'messages' must be a non-empty list")
    words: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise _BadRequest("each message must be an object")
        content = message.get("content", "")
        if isinstance(content, list):  # content parts
            content = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        words.append(f"<|{message.get('role', 'user')}|>")
        words.extend(str(content).split())
    return words


def _prompt_tokens(body: dict) -> list:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokens: list = prompt.split()
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        tokens = list(prompt)
    else:
        raise _BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)")
    return tokens


def _int_field(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise _BadRequest(f"'{name}' must be an integer")
    return value


def _greedy_token(key: int, index: int) -> tuple[str, float]:
    """The simulated model's greedy choice at position `index` of the answer to
    the prompt hashed to `key`, with its logprob: fixed by the two alone."""
    draw = zlib.crc32(f"{key}-{index}".encode())
    return _WORDS[draw % len(_WORDS)], -round((draw >> 8) % 2000 / 1000.0, 3)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "kvwatch-sim"
    _greedy_key: int | None = None
    _want_logprobs = False

    @property
    def sim_server(self) -> SimServer:
        return self.server.sim_server  # type: ignore[attr-defined]

    timeout = SOCKET_TIMEOUT_SECONDS  # per socket operation (StreamRequestHandler sets it)

    def setup(self) -> None:
        super().setup()
        # Streamed chunks are small writes; without this, Nagle's algorithm and
        # the client's delayed ACK hold each one back by up to 40 ms.
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle_one_request(self) -> None:
        # The request must arrive whole within read_timeout (see _answer_deadline for its answer).
        server = self.sim_server
        self._watch = server.deadlines.arm(self.connection, time.monotonic() + server.read_timeout)
        try:
            super().handle_one_request()
        except OSError:
            self.close_connection = True  # shut at its deadline, or the client went away
        finally:
            server.deadlines.disarm(self._watch)

    def _answer_deadline(self) -> None:
        """The request is read: its answer has request_timeout (and read_timeout more)."""
        server = self.sim_server
        server.deadlines.arm(self.connection, time.monotonic() + server.request_timeout + server.read_timeout,
                             self._watch)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # quiet: a load test would flood the terminal

    # -- plumbing ----------------------------------------------------------------

    def _begin(self) -> None:
        self._started = time.monotonic()
        self._request_bytes = int(self.headers.get("Content-Length") or 0)
        self._response_bytes = 0
        self._status = 200
        self._headers_sent = False

    def _finish(self) -> None:
        path = self.path.split("?", 1)[0]
        self.sim_server.http_stats.record(path, self.command, self._status, self._request_bytes,
                                          self._response_bytes, time.monotonic() - self._started, time.time())

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self._status = status
        self._response_bytes = len(body)
        self._headers_sent = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, status: int, payload: Any) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _send_error(self, status: int, message: str) -> None:
        kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(status, "Error")
        self._send_json(status, {"object": "error", "message": message, "type": kind, "param": None, "code": status})

    def _read_json(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None:
            raise _BadRequest("a JSON body with Content-Length is required", 411)
        try:
            size = int(length)
        except ValueError:
            raise _BadRequest("Content-Length is not a number") from None
        if size < 0 or size > MAX_BODY_BYTES:
            raise _BadRequest("request body too large", 413)
        raw = self.rfile.read(size)
        if len(raw) < size:
            raise _BadRequest("the body ended before its Content-Length")
        self._answer_deadline()
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise _BadRequest("the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise _BadRequest("the body must be a JSON object")
        return body

    # -- routes ------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        self._begin()
        self._answer_deadline()
        path = self.path.split("?", 1)[0]
        server = self.sim_server
        try:
            # TensorRT-LLM serves its page at /prometheus/metrics.
            if path == "/metrics" or (path == "/prometheus/metrics" and server.dialect == "trtllm"):
                self._send(200, server.metrics_text().encode(), CONTENT_TYPE)
            elif path == "/app/metrics":
                self._send(200, server.app_metrics_text().encode(), CONTENT_TYPE)
            elif path == LMCACHE_PATH and (tier_text := server.lmcache_metrics_text()) is not None:
                self._send(200, tier_text.encode(), CONTENT_TYPE)
            elif path == ROUTER_PATH and (router_text := server.router_metrics_text()) is not None:
                self._send(200, router_text.encode(), CONTENT_TYPE)
            elif path == PHASE_PATH:
                # One line ending in a newline: kvwatch reads it with its page fetcher.
                self._send(200, (json.dumps(server.phase_status()) + "\n").encode(), "application/json")
            elif path in ("/health", "/ping"):
                self._send(200, b"", "application/json")
            elif path == "/version":
                self._send_json(200, {"version": f"kvwatch-sim {__version__}"})
            elif path == "/v1/models":
                sim = server.sim
                model = sim.model_name
                self._send_json(200, {"object": "list", "data": [{
                    "id": model, "object": "model", "created": int(sim.created_unix), "owned_by": "vllm",
                    "root": model, "parent": None, "max_model_len": sim.engines[0].config.max_model_len,
                }]})
            else:
                self._send_json(404, {"detail": "Not Found"})
        finally:
            self._finish()

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        self._begin()
        path = self.path.split("?", 1)[0]
        try:
            if path not in ("/v1/completions", "/v1/chat/completions"):
                self._send_json(404, {"detail": "Not Found"})
                return
            try:
                body = self._read_json()
                self._complete(body, chat=path == "/v1/chat/completions")
            except _BadRequest as exc:
                self._send_error(exc.status, str(exc))
            except RequestRejected as exc:
                self._send_error(exc.status, str(exc))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # a bug must not kill the connection silently
            self.close_connection = True
            if not self._headers_sent:
                self._send_error(500, f"simulator error: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._finish()

    def _complete(self, body: dict, chat: bool) -> None:
        server = self.sim_server
        sim = server.sim
        model = body.get("model", sim.model_name)
        if model != sim.model_name:
            raise _BadRequest(f"The model `{model}` does not exist.", 404)
        if body.get("n", 1) != 1:
            raise _BadRequest("the simulator serves n=1 only")
        tokens = _words_of_messages(body.get("messages")) if chat else _prompt_tokens(body)
        # Greedy decoding answers a prompt the same way every time (the sweep's
        # quality probe relies on it); sampling answers each request its own way.
        temperature = body.get("temperature")
        greedy = isinstance(temperature, (int, float)) and not isinstance(temperature, bool) \
            and temperature == 0
        self._greedy_key = zlib.crc32(repr(tokens).encode()) if greedy else None
        logprobs = body.get("logprobs")
        self._want_logprobs = greedy and not chat and isinstance(logprobs, int) \
            and not isinstance(logprobs, bool) and logprobs >= 0
        explicit_len = _int_field(body, "kvwatch_prompt_tokens", None)
        if explicit_len is not None:
            # Pad with tokens private to this request: they never match a cache entry.
            filler = f"#{uuid.uuid4().hex}"
            tokens = tokens[:explicit_len] + [(filler, i) for i in range(max(0, explicit_len - len(tokens)))]
        if not tokens:
            raise _BadRequest("the prompt is empty")
        max_model_len = sim.engines[0].config.max_model_len
        default_max = max(1, max_model_len - len(tokens)) if chat else 16
        max_tokens = _int_field(body, "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
                                default_max)
        if max_tokens is None:
            max_tokens = default_max
        if body.get("ignore_eos"):
            output_len = max_tokens
        else:
            # The simulated model emits end-of-sequence at a point fixed by the
            # prompt, somewhere in [1, max_tokens] (send ignore_eos for exact lengths).
            output_len = 1 + zlib.crc32(repr(tokens[:64]).encode()) % max(1, max_tokens)
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        block_size = sim.engines[0].config.block_size
        hashes = token_block_hashes(tokens, block_size)
        progress = _TokenStream(server)
        request = server.submit(len(tokens), hashes, max_tokens, output_len, progress)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        try:
            if stream:
                self._stream(request, progress, ident, created, model, chat, include_usage)
            else:
                self._unary(request, progress, ident, created, model, chat)
        except (BrokenPipeError, ConnectionResetError):
            with server.cond:
                sim.abort(request)
            raise

    def _wait(self, progress: _TokenStream, seen: int) -> tuple[int, str | None, bool]:
        """Block until the request produced more than `seen` tokens or finished.
        Returns (produced, finish_reason, gave_up)."""
        server = self.sim_server
        deadline = time.monotonic() + server.request_timeout
        with server.cond:
            while progress.produced == seen and progress.finish_reason is None:
                if server.stopping.is_set() or time.monotonic() > deadline:
                    return progress.produced, progress.finish_reason, True
                server.cond.wait(0.25)
            return progress.produced, progress.finish_reason, False

    def _give_up(self, request: Request) -> None:
        with self.sim_server.cond:
            self.sim_server.sim.abort(request)

    def _text(self, request: Request, start: int, stop: int) -> str:
        if self._greedy_key is not None:
            return "".join(f" {_greedy_token(self._greedy_key, i)[0]}" for i in range(start, stop))
        return "".join(f" {_WORDS[(request.uid * 7 + i) % len(_WORDS)]}" for i in range(start, stop))

    def _logprobs(self, request: Request) -> dict:
        """The OpenAI completions logprobs block of a greedy answer."""
        tokens, logprobs, offsets, offset = [], [], [], 0
        key = self._greedy_key or 0  # asked for only with a greedy key
        for index in range(request.num_output):
            word, logprob = _greedy_token(key, index)
            tokens.append(f" {word}")
            logprobs.append(logprob)
            offsets.append(offset)
            offset += len(word) + 1
        return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens,
                "top_logprobs": [{token: logprob} for token, logprob in zip(tokens, logprobs)]}

    def _usage(self, request: Request) -> dict:
        return {"prompt_tokens": request.prompt_len, "completion_tokens": request.num_output,
                "total_tokens": request.prompt_len + request.num_output}

    def _unary(self, request, progress, ident, created, model, chat) -> None:
        seen = 0
        while True:
            seen, reason, gave_up = self._wait(progress, seen)
            if gave_up:
                self._give_up(request)
                self._send_error(503, "the simulator stopped or the request timed out")
                return
            if reason is not None:
                break
        text = self._text(request, 0, request.num_output)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason, "stop_reason": None}
        else:
            choice = {"index": 0, "text": text,
                      "logprobs": self._logprobs(request) if self._want_logprobs else None,
                      "finish_reason": reason, "stop_reason": None}
        self._send_json(200, {"id": ident, "object": "chat.completion" if chat else "text_completion",
                              "created": created, "model": model, "choices": [choice], "usage": self._usage(request)})

    def _chunk(self, payload: dict | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        raw = f"data: {data}\n\n".encode()
        self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
        self.wfile.flush()

    def _stream(self, request, progress, ident, created, model, chat, include_usage) -> None:
        self._status = 200
        self._headers_sent = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choice: dict) -> dict:
            return {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice]}

        if chat:
            self._chunk(event({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}))
        sent = 0
        reason = None
        while reason is None:
            produced, reason, gave_up = self._wait(progress, sent)
            if gave_up:
                self._give_up(request)
                break
            for index in range(sent, produced):
                last = reason is not None and index == produced - 1
                text = self._text(request, index, index + 1)
                if chat:
                    choice = {"index": 0, "delta": {"content": text}, "logprobs": None,
                              "finish_reason": reason if last else None}
                else:
                    choice = {"index": 0, "text": text, "logprobs": None,
                              "finish_reason": reason if last else None, "stop_reason": None}
                self._chunk(event(choice))
            sent = produced
        if include_usage:
            self._chunk({"id": ident, "object": kind, "created": created, "model": model, "choices": [],
                         "usage": self._usage(request)})
        self._chunk("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
