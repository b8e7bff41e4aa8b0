"""The on-disk format of a capture (docs/capture.md), written and read.

A capture is a folder, or the same folder as one `.tar.gz` bundle:

    manifest.json      what a reader needs first: format, kvwatch version, the
                       target (credentials removed), interval, the engine the
                       pages were recognised as, its cache_config_info labels,
                       counts of pages and failed fetches, and whether the
                       recording was interrupted
    index.jsonl        one line per fetch, in order: {"seq", "time" (Unix
                       seconds when the fetch began), "seconds" (how long it
                       took), "ok", and "page" + "size" when it succeeded,
                       "reason" + "detail" when it failed}
    pages/000001.txt   each page byte-exact (as the engine sent it, after
                       any gzip transfer encoding), named by its seq
    events.bin         with `kvwatch capture --kv-events`: the engine's
                       KV-cache event messages as received, each a record of
                       its receive time (8-byte big-endian float), sequence
                       number (8-byte signed) and payload (4-byte length, then
                       the msgpack bytes); at most MAX_EVENTS_BYTES, the
                       manifest says how many and whether it was cut short

The writer appends to index.jsonl and flushes after each fetch, so a folder
is readable even after a hard kill; a bundle is written once, at the end
(also on Ctrl-C), from such a folder. In a bundle the members come in the
order manifest, index, pages, so a reader streams it: 24 hours of pages never
sit in memory at once.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

FORMAT = "kvwatch-capture"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.jsonl"
PAGES = "pages"
EVENTS = "events.bin"
# The stream's records in one capture (read whole, before the pages): past
# it the recorder stops keeping events and says so in the manifest.
MAX_EVENTS_BYTES = 64 * 1024 * 1024
_EVENT_HEADER = 20  # time (8), sequence (8), payload length (4)
BUNDLE_SUFFIXES = (".tar.gz", ".tgz")

# What a reader takes of each part of a capture, counted as it is read (in a
# bundle: decompressed bytes, as they come out of the stream), so a crafted
# capture costs at most this much whatever it declares. A page is at most
# what the recorder's body cap let through (8 MiB by default); an index line
# is about 150 bytes a fetch (24 h at 1 s: 13 MB).
MAX_MANIFEST_BYTES = 1024 * 1024
MAX_INDEX_BYTES = 64 * 1024 * 1024
MAX_PAGE_BYTES = 64 * 1024 * 1024
# The only page names an index may hold: a folder capture's index naming any
# other file (`/dev/zero`, `../../secret`) read it.
PAGE_NAME = re.compile(r"pages/[0-9]{6,12}\.txt")
# Unix seconds a recorded time may hold (year 1970 to 5138): Infinity killed
# the `serve --replay` thread, and a time of 1e300 would wait for ever.
MAX_TIME = 1e11


class CaptureError(Exception):
    """A capture that cannot be written or read; the message says why."""


def is_bundle(path: Path | str) -> bool:
    return str(path).endswith(BUNDLE_SUFFIXES)


def page_name(seq: int) -> str:
    return f"{PAGES}/{seq:06d}.txt"


@dataclass(frozen=True, slots=True)
class Entry:
    """One recorded fetch."""

    seq: int
    time: float  # Unix seconds when the fetch began
    seconds: float  # how long the fetch took
    ok: bool
    page: str | None = None
    size: int = 0
    reason: str | None = None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        line: dict[str, Any] = {"seq": self.seq, "time": round(self.time, 6), "seconds": round(self.seconds, 6),
                                "ok": self.ok}
        if self.ok:
            line.update(page=self.page, size=self.size)
        else:
            line.update(reason=self.reason, detail=self.detail)
        return line

    @classmethod
    def from_json(cls, line: Any) -> "Entry":
        """An index line's entry; ValueError, one sentence, for a line that is
        not one kvwatch writes (wrong types, a time that is no time, a page
        outside the capture's pages/)."""
        if not isinstance(line, dict):
            raise ValueError(f"a JSON {type(line).__name__}, not an object")
        seq, ok, page = line.get("seq"), line.get("ok"), line.get("page")
        if type(seq) is not int or not 0 < seq < 10**12:
            raise ValueError("seq is not a positive whole number")
        if type(ok) is not bool:
            raise ValueError("ok is not true or false")
        numbers: dict[str, Any] = {}
        for name, default in (("time", None), ("seconds", 0.0), ("size", 0)):
            value: Any = line.get(name, default)
            if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} is not a finite number of at least 0")
            numbers[name] = value
        if numbers["time"] > MAX_TIME:
            raise ValueError("time is past the year 5000")
        if ok and (type(page) is not str or PAGE_NAME.fullmatch(page) is None):
            raise ValueError("page does not name a file of the capture's pages/ folder")
        reason, detail = line.get("reason"), line.get("detail", "")
        if reason is not None and type(reason) is not str or type(detail) is not str:
            raise ValueError("reason or detail is not text")
        return cls(seq, float(numbers["time"]), float(numbers["seconds"]), ok, page if ok else None,
                   int(numbers["size"]), reason, detail)


class CaptureWriter:
    """Writes a capture to `out`: a folder, or a bundle when `out` ends in
    .tar.gz (recorded in `<out>.partial/` beside it, packed by close())."""

    def __init__(self, out: Path | str, manifest: dict[str, Any]):
        self.out = Path(out)
        self.bundle = is_bundle(self.out)
        self.folder = self.out.with_name(self.out.name + ".partial") if self.bundle else self.out
        if self.out.exists() or (self.bundle and self.folder.exists()):
            raise CaptureError(f"{self.out if self.out.exists() else self.folder} exists; "
                               "a capture never overwrites one")
        try:
            (self.folder / PAGES).mkdir(parents=True)
        except OSError as exc:
            raise CaptureError(f"cannot create {self.folder}: {exc.strerror or exc}") from None
        self.manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest,
                         "pages": 0, "failed": 0, "failed_by_reason": {}, "complete": False}
        self._write_manifest()
        self._index = open(self.folder / INDEX, "a", encoding="utf-8")
        self.seq = 0
        self._events: BinaryIO | None = None
        self._events_bytes = 0
        import threading

        self._events_lock = threading.Lock()

    def add_event(self, time: float, seq: int, payload: bytes) -> bool:
        """One KV-cache event message as received (the receiver's thread
        calls it); False once the capture holds MAX_EVENTS_BYTES of them."""
        import struct

        record = struct.pack(">dqI", time, seq, len(payload)) + payload
        with self._events_lock:
            if self._events_bytes + len(record) > MAX_EVENTS_BYTES:
                self.manifest["kv_events_truncated"] = True
                return False
            events = self._events
            if events is None:
                events = self._events = open(self.folder / EVENTS, "ab")
            events.write(record)
            events.flush()
            self._events_bytes += len(record)
            self.manifest["kv_events_messages"] = self.manifest.get("kv_events_messages", 0) + 1
            return True

    def add(self, time: float, seconds: float, text: str | None, reason: str | None = None,
            detail: str = "") -> Entry:
        self.seq += 1
        if text is not None:
            name = page_name(self.seq)
            data = text.encode("utf-8")  # the fetched bytes: the fetcher decoded them as strict UTF-8
            (self.folder / name).write_bytes(data)
            entry = Entry(self.seq, time, seconds, True, name, len(data))
            self.manifest["pages"] += 1
        else:
            entry = Entry(self.seq, time, seconds, False, reason=reason or "error", detail=detail)
            self.manifest["failed"] += 1
            by_reason = self.manifest["failed_by_reason"]
            by_reason[entry.reason] = by_reason.get(entry.reason, 0) + 1
        self._index.write(json.dumps(entry.to_json(), sort_keys=True) + "\n")
        self._index.flush()
        return entry

    def update(self, **fields: Any) -> None:
        self.manifest.update(fields)
        self._write_manifest()

    def close(self, **fields: Any) -> Path:
        """Finish the manifest (and pack the bundle); returns the capture's path."""
        self._index.close()
        with self._events_lock:
            if self._events is not None:
                self._events.close()
                self._events = None
            self._events_bytes = MAX_EVENTS_BYTES + 1  # nothing more after close
        self.manifest.update(fields, complete=True)
        self._write_manifest()
        if self.bundle:
            pack(self.folder, self.out)
            shutil.rmtree(self.folder)
        return self.out

    def _write_manifest(self) -> None:
        temporary = self.folder / (MANIFEST + ".tmp")
        temporary.write_text(json.dumps(self.manifest, indent=2, sort_keys=True) + "\n")
        temporary.replace(self.folder / MANIFEST)


def pack(folder: Path, out: Path) -> None:
    """A bundle of a capture folder: manifest, index, then pages in order."""
    temporary = out.with_name(out.name + ".tmp")
    with tarfile.open(temporary, "w:gz", compresslevel=6) as tar:
        for name in (MANIFEST, INDEX, EVENTS):
            if name != EVENTS or (folder / EVENTS).is_file():
                tar.add(folder / name, arcname=name, recursive=False)
        for page in sorted((folder / PAGES).iterdir()):
            tar.add(page, arcname=f"{PAGES}/{page.name}", recursive=False)
    temporary.replace(out)


# What a cut-off or damaged .tar.gz raises while it is read.
DAMAGED = (tarfile.TarError, EOFError, zlib.error, OSError)


class Capture:
    """A recorded capture, folder or bundle: its manifest, its index, and its
    entries with their pages, read in order (a bundle is streamed once per
    call of `pages()`)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.exists():
            raise CaptureError(f"{self.path}: no such capture")
        if is_bundle(self.path):
            with self._tar() as tar:
                try:
                    manifest = self._member(tar, MANIFEST, MAX_MANIFEST_BYTES)
                    index = self._member(tar, INDEX, MAX_INDEX_BYTES)
                    events = b""
                    following = tar.next()  # the stream's records come before the pages
                    if following is not None and following.name == EVENTS and following.isfile():
                        if following.size > MAX_EVENTS_BYTES:
                            raise CaptureError(f"{self.path}: {EVENTS} declares {following.size:,} bytes, over the "
                                               f"{MAX_EVENTS_BYTES:,} a capture's events may hold")
                        events = self._read(tar, following, MAX_EVENTS_BYTES)
                except DAMAGED as exc:
                    raise CaptureError(f"{self.path}: the bundle is cut off or damaged before its index ({exc})") from None
        elif self.path.is_file():
            raise CaptureError(f"{self.path}: not a kvwatch capture (a capture is a folder or a .tar.gz bundle "
                               "written by kvwatch capture)")
        else:
            try:
                manifest = self._file(MANIFEST, MAX_MANIFEST_BYTES)
                index = self._file(INDEX, MAX_INDEX_BYTES)
                events = self._file(EVENTS, MAX_EVENTS_BYTES) if (self.path / EVENTS).exists() else b""
            except FileNotFoundError as exc:
                raise CaptureError(f"{self.path}: not a kvwatch capture (no {Path(exc.filename).name} in it)") from None
            except OSError as exc:
                raise CaptureError(f"{self.path}: not a kvwatch capture ({exc.strerror or exc})") from None
        self.manifest = self._manifest(manifest)
        self.entries = self._index(index)
        # The engine's KV-cache event messages (time, sequence, payload), in receive order.
        self.events = self._event_records(events)

    def _event_records(self, data: bytes) -> list[tuple[float, int, bytes]]:
        import struct

        out = []
        offset = 0
        while offset < len(data):
            if offset + _EVENT_HEADER > len(data):
                raise CaptureError(f"{self.path}: {EVENTS} ends inside a record's header (byte {offset:,})")
            at, seq, size = struct.unpack_from(">dqI", data, offset)
            offset += _EVENT_HEADER
            if not (math.isfinite(at) and 0 <= at <= MAX_TIME) or offset + size > len(data):
                raise CaptureError(f"{self.path}: {EVENTS} holds a record that is not one kvwatch writes "
                                   f"(byte {offset - _EVENT_HEADER:,})")
            out.append((at, seq, data[offset:offset + size]))
            offset += size
        return out

    def _manifest(self, data: bytes) -> dict[str, Any]:
        try:
            manifest = json.loads(data.decode("utf-8"))
        except ValueError as exc:
            raise CaptureError(f"{self.path}: {MANIFEST} is not JSON ({exc})") from None
        if not isinstance(manifest, dict):
            raise CaptureError(f"{self.path}: {MANIFEST} is a JSON {type(manifest).__name__}, not an object: "
                               "not a kvwatch capture")
        if manifest.get("format") != FORMAT:
            raise CaptureError(f"{self.path}: not a kvwatch capture (format {str(manifest.get('format'))[:80]!r})")
        version = manifest.get("format_version", 0)
        if type(version) is not int:
            raise CaptureError(f"{self.path}: {MANIFEST}'s format_version is not a whole number")
        if version > FORMAT_VERSION:
            raise CaptureError(f"{self.path}: capture format {version} is newer than this "
                               f"kvwatch reads ({FORMAT_VERSION})")
        for name, kinds in (("target", (str,)), ("interval_seconds", (int, float)), ("engine", (str, dict)),
                            ("kvwatch_version", (str,)), ("interrupted", (bool,))):
            value = manifest.get(name)
            if value is not None and (type(value) not in kinds or (
                    kinds == (int, float) and not (math.isfinite(value) and 0 < value <= 86400))):
                raise CaptureError(f"{self.path}: {MANIFEST}'s {name} is not "
                                   f"{'a number of seconds above 0 and at most a day' if kinds == (int, float) else 'what kvwatch writes there'}")
        return manifest

    def _file(self, name: str, cap: int) -> bytes:
        """A folder capture's file, a regular one inside the folder (not a
        link, a device or a FIFO), read up to `cap` bytes."""
        import os
        import stat

        path = self.path / name
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError as exc:
            if exc.errno == 40:  # ELOOP: a symbolic link
                raise CaptureError(f"{self.path}: {name} is a link; a capture holds its own files") from None
            raise
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise CaptureError(f"{self.path}: {name} is not a regular file")
            if info.st_size > cap:
                raise CaptureError(f"{self.path}: {name} is {info.st_size:,} bytes, over the {cap:,} a capture's "
                                   f"{'page' if name.startswith(PAGES) else name} may hold")
            data = handle.read(cap + 1)
        if len(data) > cap:
            raise CaptureError(f"{self.path}: {name} grew past the {cap:,} bytes a capture's "
                               f"{'page' if name.startswith(PAGES) else name} may hold while it was read")
        return data

    def _text(self, entry: Entry, data: bytes) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise CaptureError(f"{self.path}: {entry.page} is not UTF-8 text (kvwatch records pages as the "
                               "engine sent them, which it reads only as UTF-8)") from None

    def pages(self) -> Iterator[tuple[Entry, str | None]]:
        """(entry, page text or None for a failed fetch), in recorded order."""
        if not is_bundle(self.path):
            for entry in self.entries:
                if not entry.ok:
                    yield entry, None
                    continue
                try:
                    data = self._file(entry.page or "", MAX_PAGE_BYTES)
                except FileNotFoundError:
                    raise CaptureError(f"{self.path}: {entry.page} is missing") from None
                except OSError as exc:
                    raise CaptureError(f"{self.path}: {entry.page} cannot be read ({exc.strerror or exc})") from None
                yield entry, self._text(entry, data)
            return
        by_page = {entry.page: entry for entry in self.entries if entry.ok}
        pending = iter(self.entries)
        read = 0
        with self._tar() as tar:
            members = iter(tar)
            while True:
                # A bundle cut off in transit (a partial copy of an incident) ends in one
                # sentence after the pages it holds, not in tarfile's traceback.
                try:
                    member = next(members, None)
                    if member is not None and member.size > MAX_PAGE_BYTES:
                        raise CaptureError(f"{self.path}: member {member.name[:200]!r} declares {member.size:,} "
                                           f"bytes, over the {MAX_PAGE_BYTES:,} a capture's page may hold")
                    found = by_page.get(member.name) if member is not None and member.isfile() else None
                    data = self._read(tar, member, MAX_PAGE_BYTES) if found is not None and member is not None else b""
                except DAMAGED as exc:
                    raise CaptureError(f"{self.path}: the bundle is cut off or damaged after {read} of "
                                       f"{len(by_page)} pages ({exc})") from None
                if member is None:
                    break
                if found is None:
                    continue
                # Failed fetches before this page come first, as recorded.
                for earlier in pending:
                    if earlier is found:
                        break
                    if not earlier.ok:
                        yield earlier, None
                read += 1
                yield found, self._text(found, data)
            for later in pending:
                if not later.ok:
                    yield later, None

    def _tar(self) -> tarfile.TarFile:
        try:
            return tarfile.open(self.path, "r|gz")
        except (OSError, tarfile.TarError) as exc:
            raise CaptureError(f"{self.path}: not a readable .tar.gz ({exc})") from None

    def _member(self, tar: tarfile.TarFile, name: str, cap: int) -> bytes:
        member = tar.next()
        if member is None or member.name != name or not member.isfile():
            raise CaptureError(f"{self.path}: the bundle does not start with {MANIFEST} and {INDEX}")
        if member.size > cap:
            raise CaptureError(f"{self.path}: {name} declares {member.size:,} bytes, over the {cap:,} a capture's "
                               f"{name} may hold")
        return self._read(tar, member, cap)

    def _read(self, tar: tarfile.TarFile, member: tarfile.TarInfo, cap: int) -> bytes:
        """A member's bytes, decompressed at most `cap` + 1 of them whatever
        its header says (a 15 MB bundle held a 2 GiB page: 13.4 GB RSS)."""
        file = tar.extractfile(member)
        if file is None:
            raise CaptureError(f"{self.path}: {member.name[:200]!r} is not a file")
        data = file.read(cap + 1)
        if len(data) > cap:
            raise CaptureError(f"{self.path}: {member.name[:200]!r} holds more than the {cap:,} bytes a "
                               "capture's member may hold")
        return data

    def _index(self, data: bytes) -> list[Entry]:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise CaptureError(f"{self.path}: {INDEX} is not UTF-8 text") from None
        entries = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entries.append(Entry.from_json(json.loads(line)))
            except (ValueError, RecursionError) as exc:
                raise CaptureError(f"{self.path}: {INDEX} line {number} is not a recorded fetch "
                                   f"({str(exc)[:200]})") from None
        return entries
