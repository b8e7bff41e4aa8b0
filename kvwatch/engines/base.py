"""The adapter interface: what every engine's adapter is given and returns.

An adapter is given the text of one engine's metrics page and the time it was
fetched, parses only the families it needs, and returns one canonical
Snapshot (per (model, engine): gauges, counters and histograms under the
canonical keys of kvwatch.snapshot; the cache configuration as an open map).
Everything downstream (window, signals, diagnosis, exporter, rules,
dashboards) reads only the Snapshot, so a second engine is one new file here
plus its line in ENGINES (kvwatch/engines/__init__.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvwatch.snapshot import Snapshot


class EngineAdapter(ABC):
    """One instance per target: an adapter may cache what it learned of the
    page's layout from one poll to the next."""

    # The engine's name, as `--engine` and the status page say it.
    name: str = ""
    # How people write the engine's name, in sentences.
    title: str = ""
    # Prefixes of the families the engine writes; a page carrying any of them
    # is the engine's (checked in the order of ENGINES).
    prefixes: tuple[str, ...] = ()
    # canonical key -> the engine's (newest) family name for it, and, for the
    # families the engine exports only when a flag asks, the flag. Snapshots
    # carry both so that every surface can say which families were on the
    # page and which flag would light a dark signal.
    families: dict[str, str] = {}
    gates: dict[str, str] = {}
    # Engine family -> the releases that export it ("0.20+"): a dark signal
    # whose family a page lacks names them.
    versions: dict[str, str] = {}

    def __init__(self, max_series: int = 10_000):
        # A page with more (model, engine) pairs than this is capped: the rest
        # are dropped and counted, so one label value per request cannot grow
        # kvwatch's memory without bound.
        self.max_series = max_series
        self.dropped_series = 0

    @abstractmethod
    def adapt(self, text: str, at: float | None = None) -> Snapshot:
        """The canonical Snapshot of one page fetched at `at` (Unix time)."""

    @classmethod
    def provides(cls, older_builds: bool = True) -> dict[str, str]:
        """canonical key -> kind (gauge, counter, histogram, config) the adapter
        can fill; a key ending in "/*" is a labelled one (a key per label
        value). Without `older_builds`, only what the engine's current builds
        carry. engines/coverage.py reads the dark signals and the coverage
        table from it: an engine with no declaration provides nothing."""
        return {}

    @classmethod
    def recognizes(cls, text: str) -> bool:
        """Whether a page is this engine's: a family with one of its prefixes
        at the start of a line."""
        return any(text.startswith(prefix) or f"\n{prefix}" in text or f"# TYPE {prefix}" in text
                   for prefix in cls.prefixes)

    @classmethod
    def spelling_of(cls, text: str) -> str:
        """The namespace prefixes the page's sample lines start with, in the
        order of `prefixes`, joined by ","; "" when none does. HELP and TYPE
        lines are not samples: OpenMetrics' escaping=underscores rewrites only
        the sample lines, so they say nothing of what a query must name."""
        return ",".join(prefix for prefix in cls.prefixes
                        if text.startswith(prefix) or f"\n{prefix}" in text)
