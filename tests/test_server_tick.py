"""kvwatch serve's HTTP server (kvwatch/sidecar/server.py) wakes once a second, not ten times, to see whether
to exit, and a signal's exit still wakes it at once (what it saves is measured by the process section of
make bench)."""

from __future__ import annotations

import asyncio
import signal
import threading

import uvicorn

from kvwatch.sidecar import server as kvwatch_server


def _server() -> kvwatch_server.Server:
    return kvwatch_server.Server(uvicorn.Config(app=None, log_level="warning"))


def test_the_loop_waits_a_second_between_ticks_and_refreshes_the_date_at_each(monkeypatch):
    waits, ticks = [], []
    server = _server()

    async def on_tick(counter: int) -> bool:
        ticks.append(counter)
        return len(ticks) == 4

    async def wait(event, seconds):
        waits.append(seconds)

    monkeypatch.setattr(server, "on_tick", on_tick)
    monkeypatch.setattr(kvwatch_server, "wait", wait)
    asyncio.run(server.main_loop())
    assert waits == [1.0, 1.0, 1.0]  # uvicorn's own loop: 0.1 s
    assert ticks == [0, 0, 0, 0]  # each tick is the one uvicorn refreshes its Date header on


def test_a_signal_ends_the_wait_at_once(monkeypatch):
    monkeypatch.setattr(kvwatch_server, "TICK_SECONDS", 3600.0)
    server = _server()
    server.config.load()  # on_tick reads the encoded headers

    async def main():
        loop = asyncio.get_running_loop()
        # From another thread, as a signal handler runs outside the loop's callbacks.
        loop.call_later(0.05, lambda: threading.Thread(target=server.handle_exit, args=(signal.SIGTERM, None)).start())
        await asyncio.wait_for(server.main_loop(), 60)  # an hour's tick would time out here

    asyncio.run(main())
    assert server.should_exit
