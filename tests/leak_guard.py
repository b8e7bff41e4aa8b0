"""Finds the threads and child processes a test started and left running.

A thread or process one test leaves behind runs on into the next ones: it
holds a port, a file or a lock, answers the next test's requests, or fails it
at a random moment, so a test passes alone and fails after another (a history
test after the store tests did). tests/conftest.py takes a snapshot before
each test and asks, after it, what is new and still alive once those already
stopping have had a short grace to finish.

Children are read from /proc (Linux: each task's `children` file, or every
process's parent where the kernel lacks that file); elsewhere the process
half finds none. Only direct children count: a process started with its own
session is still one (tests stop them by process group).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

GRACE_S = 2.0
# Threads kvwatch starts once per process by design, so the first test to
# start one "leaves" it: each with why it may outlive that test.
LONG_LIVED_THREADS = {
    # kvwatch/scrape.py _DEADLINES: one watchdog thread for every fetch in the
    # process, started with the first fetch and asleep while none is in flight.
    "kvwatch-fetch-deadlines",
}
# Processes the standard library starts once per process by design and keeps
# to its end: multiprocessing's resource tracker (with the first spawned
# worker) and its fork server.
LONG_LIVED_PROCESSES = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
PROC = Path("/proc")


def thread_snapshot() -> set[threading.Thread]:
    return set(threading.enumerate())


def describe_thread(thread: threading.Thread) -> str:
    target = getattr(thread, "_target", None)
    where = getattr(target, "__qualname__", None) or type(thread).__qualname__
    return f"{thread.name} ({where}, {'daemon' if thread.daemon else 'non-daemon'})"


def _works_for_a_running_loop(thread: threading.Thread) -> bool:
    """A worker of an event loop still running (AnyIO's worker threads keep
    their loop): it ends with that loop's server. A server the test started
    and left running is named by its own thread; one started by a fixture of
    a wider scope (before the test) goes on serving, with its workers."""
    loop = getattr(thread, "loop", None)
    is_running = getattr(loop, "is_running", None)
    return callable(is_running) and bool(is_running())


def leftover_threads(before: set[threading.Thread], grace_s: float = GRACE_S) -> list[str]:
    """The threads started since `before` still alive after `grace_s` of joining them all."""
    new = [t for t in threading.enumerate()
           if t not in before and t.is_alive() and t.name not in LONG_LIVED_THREADS
           and not _works_for_a_running_loop(t)]
    deadline = time.monotonic() + grace_s
    for thread in new:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sorted(describe_thread(t) for t in new if t.is_alive())


def _state_and_parent(pid: int) -> tuple[str, int] | None:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name sits in parentheses and may hold spaces or parentheses itself.
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[0], int(fields[1])


def _pids_in_children_files(parent: int) -> set[int] | None:
    tasks = PROC / str(parent) / "task"
    pids: set[int] = set()
    try:
        for task in tasks.iterdir():
            pids.update(int(pid) for pid in (task / "children").read_text().split())
    except FileNotFoundError:
        return None  # a kernel without CONFIG_PROC_CHILDREN (or no /proc at all)
    except OSError:
        pass  # a task that ended while being read
    return pids


def running_children(parent: int | None = None) -> set[int]:
    """The pids of `parent`'s (this process's) children that have not exited (zombies aside)."""
    parent = os.getpid() if parent is None else parent
    pids = _pids_in_children_files(parent)
    if pids is None:
        if not PROC.is_dir():
            return set()
        pids = {int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit()}
    found = set()
    for pid in pids:
        known = _state_and_parent(pid)
        if known and known[1] == parent and known[0] not in ("Z", "X"):
            found.add(pid)
    return found


def command_line(pid: int) -> str:
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    return " ".join(part.decode("utf-8", "replace") for part in argv if part)


def describe_process(pid: int) -> str:
    return f"{pid} ({command_line(pid)[:160]})"


def leftover_children(before: set[int], grace_s: float = GRACE_S) -> list[str]:
    """This process's children started since `before` still running after `grace_s`."""
    deadline = time.monotonic() + grace_s
    while True:
        left = {pid for pid in running_children() - before
                if not any(name in command_line(pid) for name in LONG_LIVED_PROCESSES)}
        if not left or time.monotonic() >= deadline:
            return [describe_process(pid) for pid in sorted(left)]
        time.sleep(0.05)
