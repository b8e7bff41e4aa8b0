"""kvwatch under load from its own scrapers, served by uvicorn on loopback
while the poll loop runs: many concurrent scrapers each see one whole poll,
never a mix; slow scrapers and slow engines delay neither the poll loop nor
the other scrapers.

No assertion here is about speed: each waits for an event (polls advancing,
a response arriving) under a generous deadline, and fails only when the
event never comes.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import requests

from fuzz.pages import Engine, page
from kvwatch.sidecar.app import create_app
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from pageserver import Answer, PageServer, serving
from test_reliability_faults import metric_values

DEADLINE = 60.0


def wait_until(condition, what: str, deadline: float = DEADLINE) -> None:
    end = time.monotonic() + deadline
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting: {what}")
        time.sleep(0.02)


@contextmanager
def uvicorn_serving(app):
    with serving(app, access_log=False) as served:
        yield served.url


def changing_engine() -> PageServer:
    """Every answer is a new poll's page: counters grow, and running, waiting
    and usage move together, so a scrape mixing two polls shows."""
    server = PageServer()
    counter = itertools.count(1)

    def next_answer() -> Answer:
        n = next(counter)
        level = n % 10
        return Answer(page(Engine(prompt_tokens=100 * n, generation_tokens=10 * n, running=level, waiting=level,
                                  usage=level / 10, finished_stop=n)))

    server.next_answer = next_answer
    return server


def make_monitor(url: str, interval: str = "0.05s", timeout: str = "0.04s") -> Monitor:
    settings = load_settings(overrides={"target": url, "poll_interval": interval, "timeout": timeout,
                                        "window": "1m"}, environ={})
    return Monitor(settings)


def assert_one_poll(metrics_text: str) -> None:
    values = metric_values(metrics_text)
    identity = (("engine", "0"), ("model_name", "m"))
    running = values.get(("kvwatch_engine_requests_running", identity))
    waiting = values.get(("kvwatch_engine_requests_waiting", identity))
    usage = values.get(("kvwatch_engine_kv_cache_usage_ratio", identity))
    windowed = values.get(("kvwatch_requests_running", identity))
    if values[("kvwatch_up", ())] == 1.0:
        assert running == waiting == windowed and round(usage * 10) == running, (running, waiting, usage, windowed)
    else:
        assert running is None and waiting is None


def test_many_concurrent_scrapers_each_see_one_whole_poll_while_polling():
    with changing_engine() as engine:
        monitor = make_monitor(engine.url)
        monitor.start()
        try:
            with uvicorn_serving(create_app(monitor)) as base:
                wait_until(lambda: monitor.state.up, "the first poll")
                polls_before = monitor.state.polls
                failures: list[str] = []
                scrapes = itertools.count()

                def scraper(worker: int) -> int:
                    done = 0
                    with requests.Session() as session:
                        # Scrape until the poll loop has moved on by 10 polls
                        # under this load (and at least 20 times each).
                        end = time.monotonic() + DEADLINE
                        while (done < 20 or monitor.state.polls < polls_before + 10) and time.monotonic() < end:
                            path = "/api/v1/signals" if (worker + done) % 3 == 0 else "/metrics"
                            response = session.get(base + path, timeout=30)
                            if response.status_code != 200:
                                failures.append(f"{path}: {response.status_code}")
                            elif path == "/metrics":
                                assert_one_poll(response.text)
                            else:
                                body = response.json()
                                if body["up"]:
                                    values = body["engines"][0]["signals"]
                                    assert values["kvwatch_requests_running"] == values["kvwatch_requests_waiting"]
                            done += 1
                            next(scrapes)
                    return done

                with ThreadPoolExecutor(max_workers=24) as pool:
                    counts = list(pool.map(scraper, range(24)))
                assert failures == []
                assert min(counts) >= 20
                assert monitor.state.polls >= polls_before + 10, "the poll loop stalled under scrapes"
        finally:
            monitor.stop()
    assert monitor.state.errors_by_reason.get("internal", 0) == 0


def test_slow_scrapers_delay_neither_the_poll_loop_nor_other_scrapers():
    with changing_engine() as engine:
        monitor = make_monitor(engine.url)
        monitor.start()
        slow: list[socket.socket] = []
        try:
            with uvicorn_serving(create_app(monitor)) as base:
                wait_until(lambda: monitor.state.up, "the first poll")
                port = int(base.rsplit(":", 1)[1])
                for i in range(16):
                    sock = socket.socket()
                    # A tiny receive buffer that is never read: the response
                    # backs up into kvwatch's send buffers.
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
                    sock.connect(("127.0.0.1", port))
                    if i % 2:
                        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 200)  # pipelined, never read
                    else:
                        sock.sendall(b"GET /metr")  # and the rest of the request never comes
                    slow.append(sock)
                polls_before = monitor.state.polls
                wait_until(lambda: monitor.state.polls >= polls_before + 10, "polls while slow scrapers hang on")
                response = requests.get(base + "/metrics", timeout=30)
                assert response.status_code == 200
                assert_one_poll(response.text)
        finally:
            for sock in slow:
                sock.close()
            monitor.stop()


def test_a_scrape_is_answered_while_a_poll_waits_on_a_slow_engine():
    """Serving /metrics never waits on the engine: a scrape made while the
    poll is blocked on an engine that has not answered yet returns the last
    state."""
    release = threading.Event()
    with PageServer([Answer(page(Engine(running=2, waiting=2, usage=0.2)))]) as engine:
        monitor = make_monitor(engine.url, interval="30s", timeout="20s")
        monitor.poll_once()
        original = engine.next_answer

        def held_answer():
            release.wait(20)
            return original()

        engine.next_answer = held_answer
        poll = threading.Thread(target=monitor.poll_once, daemon=True)
        try:
            with uvicorn_serving(create_app(monitor)) as base:
                poll.start()
                wait_until(lambda: len(engine.requests) == 2, "the second poll to reach the engine")
                response = requests.get(base + "/metrics", timeout=10)
                assert response.status_code == 200
                assert_one_poll(response.text)
                assert monitor._lock.locked() and not release.is_set()  # the poll is still waiting
        finally:
            release.set()
            poll.join(30)
    assert monitor.state.up and monitor.state.polls == 2
