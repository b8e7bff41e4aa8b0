"""The HTTP server kvwatch serves with: uvicorn's, waking once a second
instead of ten times.

uvicorn's Server.main_loop sleeps 0.1 s between checks of should_exit, and
refreshes its Date header every tenth check: about twenty event-loop wakeups
a second in a sidecar that otherwise wakes once a poll, 1.5 ms of CPU a
second, 40% of the whole process's cost at a 1 s poll (benchmarks/RESULTS.md,
"What the pod pays"). Here it waits TICK_SECONDS between checks, refreshing
the Date header at each (as often as before), and an exit asked for by a
signal wakes it at once, so SIGTERM is not answered later than before.
"""

from __future__ import annotations

import asyncio
from types import FrameType

import uvicorn
from uvicorn.main import STARTUP_FAILURE

TICK_SECONDS = 1.0


class Server(uvicorn.Server):
    _loop: asyncio.AbstractEventLoop | None = None
    _wake: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        # Counter 0 is the tick on which uvicorn refreshes its Date header.
        while not await self.on_tick(0):
            await wait(self._wake, TICK_SECONDS)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)


async def wait(event: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except asyncio.TimeoutError:
        pass


def run(app, **options) -> None:
    """uvicorn.run(app, **options) with this Server (one process, no reload: all kvwatch uses)."""
    server = Server(uvicorn.Config(app, **options))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if not server.started:
        raise SystemExit(STARTUP_FAILURE)
