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

The writer appends to index.jsonl and flushes after each fetch, so a folder
is readable even after a hard kill; a bundle is written once, at the end
(also on Ctrl-C), from such a folder. In a bundle the members come in the
order manifest, index, pages, so a reader streams it: 24 hours of pages never
sit in memory at once.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

FORMAT = "kvwatch-capture"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.jsonl"
PAGES = "pages"
BUNDLE_SUFFIXES = (".tar.gz", ".tgz")


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
    def from_json(cls, line: dict[str, Any]) -> "Entry":
        return cls(int(line["seq"]), float(line["time"]), float(line.get("seconds", 0.0)), bool(line["ok"]),
                   line.get("page"), int(line.get("size", 0)), line.get("reason"), str(line.get("detail", "")))


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
        for name in (MANIFEST, INDEX):
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
                    self.manifest = self._json(tar, MANIFEST)
                    self.entries = self._index(self._member(tar, INDEX).decode("utf-8"))
                except DAMAGED as exc:
                    raise CaptureError(f"{self.path}: the bundle is cut off or damaged before its index ({exc})") from None
        elif self.path.is_file():
            raise CaptureError(f"{self.path}: not a kvwatch capture (a capture is a folder or a .tar.gz bundle "
                               "written by kvwatch capture)")
        else:
            try:
                self.manifest = json.loads((self.path / MANIFEST).read_text())
                self.entries = self._index((self.path / INDEX).read_text())
            except FileNotFoundError as exc:
                raise CaptureError(f"{self.path}: not a kvwatch capture (no {Path(exc.filename).name} in it)") from None
            except (OSError, ValueError) as exc:
                raise CaptureError(f"{self.path}: not a kvwatch capture ({exc})") from None
        if self.manifest.get("format") != FORMAT:
            raise CaptureError(f"{self.path}: not a kvwatch capture (format {self.manifest.get('format')!r})")
        if int(self.manifest.get("format_version", 0)) > FORMAT_VERSION:
            raise CaptureError(f"{self.path}: capture format {self.manifest['format_version']} is newer than this "
                               f"kvwatch reads ({FORMAT_VERSION})")

    def pages(self) -> Iterator[tuple[Entry, str | None]]:
        """(entry, page text or None for a failed fetch), in recorded order."""
        if not is_bundle(self.path):
            for entry in self.entries:
                text = (self.path / entry.page).read_bytes().decode("utf-8") if entry.ok else None
                yield entry, text
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
                    entry = by_page.get(member.name) if member is not None else None
                    data = tar.extractfile(member).read() if entry is not None else b""
                except DAMAGED as exc:
                    raise CaptureError(f"{self.path}: the bundle is cut off or damaged after {read} of "
                                       f"{len(by_page)} pages ({exc})") from None
                if member is None:
                    break
                if entry is None:
                    continue
                # Failed fetches before this page come first, as recorded.
                for earlier in pending:
                    if earlier is entry:
                        break
                    if not earlier.ok:
                        yield earlier, None
                read += 1
                yield entry, data.decode("utf-8")
            for later in pending:
                if not later.ok:
                    yield later, None

    def _tar(self) -> tarfile.TarFile:
        try:
            return tarfile.open(self.path, "r|gz")
        except (OSError, tarfile.TarError) as exc:
            raise CaptureError(f"{self.path}: not a readable .tar.gz ({exc})") from None

    @staticmethod
    def _member(tar: tarfile.TarFile, name: str) -> bytes:
        member = tar.next()
        if member is None or member.name != name:
            raise CaptureError(f"bundle does not start with {MANIFEST} and {INDEX}")
        return tar.extractfile(member).read()

    def _json(self, tar: tarfile.TarFile, name: str) -> dict[str, Any]:
        try:
            return json.load(io.BytesIO(self._member(tar, name)))
        except ValueError as exc:
            raise CaptureError(f"{self.path}: {name} is not JSON ({exc})") from None

    def _index(self, text: str) -> list[Entry]:
        try:
            return [Entry.from_json(json.loads(line)) for line in text.splitlines() if line.strip()]
        except (ValueError, KeyError, TypeError) as exc:
            raise CaptureError(f"{self.path}: {INDEX} has a bad line ({exc})") from None
