"""The check that fails a test leaving a thread or a child process running
(tests/leak_guard.py, used by tests/conftest.py after every test)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

import leak_guard


def test_a_thread_still_running_is_named_and_one_that_ends_in_the_grace_is_not():
    before = leak_guard.thread_snapshot()
    release = threading.Event()
    stays = threading.Thread(target=release.wait, name="stays-up", daemon=True)
    stays.start()
    stopping = threading.Thread(target=threading.Event().wait, args=(0.2,), name="stopping")
    stopping.start()
    try:
        left = leak_guard.leftover_threads(before, grace_s=0.5)
        assert left == ["stays-up (Event.wait, daemon)"]
        assert not stopping.is_alive()  # joined within the grace
    finally:
        release.set()
        stays.join(5)
    assert leak_guard.leftover_threads(before, grace_s=0.5) == []


def test_threads_started_before_and_the_long_lived_ones_are_not_counted(monkeypatch):
    release = threading.Event()
    earlier = threading.Thread(target=release.wait, name="earlier", daemon=True)
    earlier.start()
    before = leak_guard.thread_snapshot()
    by_design = threading.Thread(target=release.wait, name="by-design", daemon=True)
    monkeypatch.setattr(leak_guard, "LONG_LIVED_THREADS", {"by-design"})
    by_design.start()
    try:
        assert leak_guard.leftover_threads(before, grace_s=0.1) == []
    finally:
        release.set()
        earlier.join(5)
        by_design.join(5)


@pytest.mark.skipif(not leak_guard.PROC.is_dir(), reason="children are read from /proc")
def test_a_child_still_running_is_named_and_one_reaped_or_exited_is_not():
    before = leak_guard.running_children()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        left = leak_guard.leftover_children(before, grace_s=0.2)
        assert len(left) == 1 and left[0].startswith(f"{child.pid} (") and "time.sleep(30)" in left[0]
    finally:
        child.kill()
        child.wait(10)
    assert leak_guard.leftover_children(before, grace_s=0.2) == []
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert leak_guard.leftover_children(before, grace_s=5.0) == []  # exited within the grace, not yet reaped
    finally:
        quick.wait(10)


@pytest.mark.skipif(not leak_guard.PROC.is_dir(), reason="children are read from /proc")
def test_without_children_files_every_process_parent_is_read(monkeypatch):
    monkeypatch.setattr(leak_guard, "_pids_in_children_files", lambda parent: None)
    before = leak_guard.running_children()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert leak_guard.running_children() - before == {child.pid}
    finally:
        child.kill()
        child.wait(10)
    assert leak_guard.running_children() - before == set()


def test_a_worker_of_an_event_loop_still_running_is_that_servers_not_the_tests():
    # AnyIO's worker threads keep their loop; one serving a loop that still runs
    # belongs to a server a fixture of a wider scope started.
    import asyncio

    loop = asyncio.new_event_loop()
    serving = threading.Thread(target=loop.run_forever, name="server-loop", daemon=True)
    serving.start()
    before = leak_guard.thread_snapshot()
    release = threading.Event()
    worker = threading.Thread(target=release.wait, name="loop-worker", daemon=True)
    worker.loop = loop  # as anyio's WorkerThread keeps it
    worker.start()
    try:
        assert leak_guard.leftover_threads(before, grace_s=0.1) == []
        loop.call_soon_threadsafe(loop.stop)
        serving.join(5)
        assert leak_guard.leftover_threads(before, grace_s=0.1) == ["loop-worker (Event.wait, daemon)"]
    finally:
        release.set()
        worker.join(5)
        loop.call_soon_threadsafe(loop.stop)
        serving.join(5)
        loop.close()
