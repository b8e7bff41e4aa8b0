"""Headless Chromium driven over the DevTools protocol on a pipe
(--remote-debugging-pipe: JSON messages ending in NUL on fds 3 and 4), so the
tests and `make screenshots` can size the viewport, pick the colour scheme,
run a script in the page, collect console messages and take screenshots,
with nothing but the `chromium` package and the standard library."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--hide-scrollbars", "--font-render-hinting=none")


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class BrowserError(RuntimeError):
    pass


class Browser:
    """One Chromium process; `page()` opens a tab. Use as a context manager."""

    def __init__(self, timeout: float = 60.0):
        path = chromium_path()
        if path is None:
            raise BrowserError("chromium is not installed (make test installs it)")
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="kvwatch-chromium-")
        self.targets: list[str] = []  # the pages opened, until close_pages
        child_in, self._write = os.pipe()
        self._read, child_out = os.pipe()
        # Moved above 9 first, so that dup2 onto 3 and 4 in the child never
        # meets one of them already sitting there.
        to_child_read = fcntl.fcntl(child_in, fcntl.F_DUPFD_CLOEXEC, 10)
        from_child_write = fcntl.fcntl(child_out, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(child_in)
        os.close(child_out)

        def wire_pipes():  # in the child: the protocol expects fds 3 (in) and 4 (out)
            os.dup2(to_child_read, 3)
            os.dup2(from_child_write, 4)

        self.proc = subprocess.Popen(
            [path, *FLAGS, "--remote-debugging-pipe", f"--user-data-dir={self.profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE if os.environ.get("KVWATCH_CHROMIUM_DEBUG") else subprocess.DEVNULL,
            # dup2 makes 3 and 4 inheritable; the pipes' own fds are close-on-exec.
            close_fds=False, preexec_fn=wire_pipes)
        os.close(to_child_read)
        os.close(from_child_write)
        self._next_id = 0
        self._lock = threading.Lock()
        self._replies: dict[int, queue.Queue] = {}
        self.events: dict[str, queue.Queue] = {}  # sessionId -> events
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()

    def _read_loop(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._read, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                for waiting in list(self._replies.values()):
                    waiting.put({"error": {"message": "chromium closed the pipe"}})
                return
            buffer += chunk
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                message = json.loads(raw)
                if "id" in message and message["id"] in self._replies:
                    self._replies[message["id"]].put(message)
                elif "method" in message:
                    self.events.setdefault(message.get("sessionId", ""), queue.Queue()).put(message)

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        with self._lock:
            self._next_id += 1
            ident = self._next_id
            reply: queue.Queue = queue.Queue()
            self._replies[ident] = reply
            message = {"id": ident, "method": method, "params": params or {}}
            if session:
                message["sessionId"] = session
            os.write(self._write, json.dumps(message).encode() + b"\0")
        try:
            answer = reply.get(timeout=self.timeout)
        except queue.Empty:
            raise BrowserError(f"{method}: no answer in {self.timeout:g} s") from None
        finally:
            self._replies.pop(ident, None)
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error'].get('message')}")
        return answer.get("result", {})

    def page(self, width: int = 1400, height: int = 900, dark: bool = False) -> "Page":
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.targets.append(target)
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        for domain in ("Page", "Runtime", "Log"):
            page.send(f"{domain}.enable")
        page.resize(width, height)
        page.send("Emulation.setEmulatedMedia", {
            "features": [{"name": "prefers-color-scheme", "value": "dark" if dark else "light"}]})
        return page

    def close_pages(self) -> None:
        """Closes every page opened so far: a status page left open keeps polling
        its server (and starting its worker threads) through the tests after."""
        targets, self.targets = self.targets, []
        for target in targets:
            try:
                self.send("Target.closeTarget", {"targetId": target})
            except BrowserError:
                pass  # closed already

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except BrowserError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        for fd in (self._write, self._read):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Page:
    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session
        self.console: list[str] = []  # errors and warnings: console calls, exceptions, log entries (CSP, loads)
        self._events = browser.events.setdefault(session, queue.Queue())

    def send(self, method: str, params: dict | None = None) -> dict:
        return self.browser.send(method, params, self.session)

    def _drain(self, until_method: str | None = None, timeout: float = 0.0) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                event = self._events.get(timeout=max(0.0, remaining)) if remaining > 0 else self._events.get_nowait()
            except queue.Empty:
                return False
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "warning", "assert"):
                text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
                self.console.append(f"console.{params['type']}: {text}")
            elif method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                self.console.append("exception: " + details.get("exception", {}).get("description", details.get("text", "")))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") in ("error", "warning"):
                self.console.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}".strip())
            if until_method is not None and method == until_method:
                return True

    def resize(self, width: int, height: int) -> None:
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600})

    def goto(self, url: str, timeout: float = 30.0) -> None:
        self.send("Page.navigate", {"url": url})
        if not self._drain("Page.loadEventFired", timeout):
            raise BrowserError(f"{url} did not load in {timeout:g} s")

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 15.0):
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"{expression!r} stayed false for {timeout:g} s")
            time.sleep(0.05)

    def messages(self) -> list[str]:
        """Console errors and warnings so far."""
        self._drain(timeout=0.2)
        return list(self.console)

    def screenshot(self, path: Path) -> None:
        """The whole page, at the viewport's width."""
        size = self.send("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = self.send("Page.captureScreenshot", {"format": "png", "clip": clip, "captureBeyondViewport": True})
        Path(path).write_bytes(base64.b64decode(shot["data"]))
