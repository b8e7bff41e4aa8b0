"""The block ledger: what the engine's block stream says, accounted block by
block in bounded memory.

For each block hash it sees, the ledger keeps one dict entry: 0 while the
block is cached, or, once evicted, the number of blocks stored before its
eviction and the time of it (packed in one integer). A block stored again
while the ledger remembers its eviction is **stored again after eviction**:
recomputation that a larger cache would have saved. Its **distance** is the
number of blocks stored between its eviction and its return: under the
engine's least-recently-used eviction of free blocks, a cache that many blocks
larger would have evicted it that many stores later, after its return, so it
would have been a hit (a first-order estimate: it ignores what the extra hits
would have changed after them). The distances' histogram is the sizing curve.

Bounded in bytes, by spatial sampling (as SHARDS samples a trace): the
ledger tracks only the hashes whose mixed value falls below a threshold, a
rate R = 2**-shift of the hash space, and scales what it counts from them by
1/R. It starts at R = 1 (every block). When the table reaches its capacity,
evicted entries beyond the horizon (8x the most blocks seen cached at once)
are forgotten first; if the table is still three quarters full, R halves and
the entries outside the new sample are dropped. Stored, evicted and cleared
counts never depend on R (every event is counted); only stored-again counts,
their distances and times are sampled. The error of a sampled count is that
of a binomial sample: with n returns seen at rate R the relative standard
error of the scaled count is about 1/sqrt(n) (n = 400 sampled returns: 5 %),
independent of the hash function as long as hashes are spread uniformly,
which the mixing step ensures for any 64-bit hash.
"""

from __future__ import annotations

import zlib

from kvwatch.labels import LabelBudget

# Measured by benchmarks/kv_events.py (a dict entry of a 64-bit int key and,
# once evicted, its own packed mark): 78 bytes per cached block and 110 per
# evicted block on CPython 3.11; the capacity divides the byte budget by the
# larger.
ENTRY_BYTES = 110
DEFAULT_TABLE_BYTES = 32 * 1024 * 1024
MIN_CAPACITY = 1024
HORIZON_FACTOR = 8
# Media and LoRA names counted apart (kvwatch.labels' budget), and pairs of
# them; past either the rest are counted under "other".
MAX_LABELS = 64

_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_MS_MASK = 0xFFFFFFFF

# Distance buckets: exact below 8, then 4 per doubling.
DISTANCE_BUCKETS = 256
# Eviction-to-return time buckets, seconds (the last is +Inf).
RETURN_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
                 float("inf"))


def distance_bucket(d: int) -> int:
    if d < 8:
        return d
    b = d.bit_length()
    return (b - 4) * 4 + 8 + ((d >> (b - 3)) & 3)


def bucket_upper(index: int) -> int:
    """The largest distance in a bucket."""
    if index < 8:
        return index
    k, s = divmod(index - 8, 4)
    return ((5 + s) << (k + 1)) - 1


def bucket_lower(index: int) -> int:
    if index < 8:
        return index
    k, s = divmod(index - 8, 4)
    return (4 + s) << (k + 1)


def _return_bucket(seconds: float) -> int:
    for index, bound in enumerate(RETURN_BOUNDS):
        if seconds <= bound:
            return index
    return len(RETURN_BOUNDS) - 1


def medium_salt(medium: str | None) -> int:
    """Blocks of another medium (CPU offload) are other blocks: their hashes
    are salted so a GPU block's return is not confused with its CPU copy."""
    if not medium or medium.upper() == "GPU":
        return 0
    return (zlib.crc32(medium.encode("utf-8", "replace")) << 32) | 0x5BD1E995


class Totals:
    """Cumulative counts since the ledger started (the window diffs them)."""

    __slots__ = ("stored", "evicted", "again", "again_seconds", "cleared", "duplicate", "unknown_removed",
                 "reused", "clock", "distance", "returns", "labels", "evicted_by_medium", "tiers", "tier_distance",
                 "removing")

    def __init__(self) -> None:
        self.stored = 0
        self.clock = 0  # GPU blocks stored: the distances' clock (a lower tier's store allocates none)
        self.evicted = 0
        self.again = 0.0  # scaled by 1/R
        self.again_seconds = 0.0  # scaled sum of eviction-to-return times
        self.cleared = 0
        self.duplicate = 0  # stored while cached with origin NEW (another group's copy)
        # Announced as stored while cached: hits of full report mode (scaled by 1/R where the ledger tells them).
        self.reused = 0.0
        self.unknown_removed = 0  # removed, never seen stored (stored before kvwatch listened)
        self.distance = [0.0] * DISTANCE_BUCKETS
        self.returns = [0.0] * len(RETURN_BOUNDS)
        self.labels: dict[tuple[str, str], list[float]] = {}  # (medium, lora) -> [stored, again, reused]
        self.evicted_by_medium: dict[str, int] = {}
        # (medium, locality) -> [stored, evicted, returned]: a lower tier's returned are the GPU's
        # returns it held (its hits); the GPU's, every block back after its eviction, however served.
        self.tiers: dict[tuple[str, str], list[float]] = {}
        # lower medium -> distance buckets of the GPU returns it served (the curve per tier).
        self.tier_distance: dict[str, list[float]] = {}
        # Media that sent a BlockRemoved: a lower tier that never did is store-only (LMCache's
        # multiprocess connector), its residency unknown, so its hits are an upper bound.
        self.removing: set[str] = set()

    def copy(self) -> "Totals":
        other = Totals()
        for name in ("stored", "evicted", "again", "again_seconds", "cleared", "duplicate", "unknown_removed",
                     "reused", "clock"):
            setattr(other, name, getattr(self, name))
        other.distance = list(self.distance)
        other.returns = list(self.returns)
        other.labels = {key: list(value) for key, value in self.labels.items()}
        other.evicted_by_medium = dict(self.evicted_by_medium)
        other.tiers = {key: list(value) for key, value in self.tiers.items()}
        other.tier_distance = {key: list(value) for key, value in self.tier_distance.items()}
        other.removing = set(self.removing)
        return other


class Ledger:
    def __init__(self, max_bytes: int = DEFAULT_TABLE_BYTES):
        self.capacity = max(MIN_CAPACITY, max_bytes // ENTRY_BYTES)
        self.table: dict[int, int] = {}
        self.shift = 0  # sampling rate R = 2**-shift
        self._limit = 1 << 64
        self.totals = Totals()
        self.cached = 0  # sampled blocks cached now (scaled: cached / R)
        self.peak_cached = 0.0
        self.sweeps = 0
        self.forgotten = 0  # evicted entries dropped past the horizon
        self.labels = LabelBudget("the KV-cache event stream", MAX_LABELS)
        # Lower tiers seen storing blocks (a medium other than the GPU): name -> its hashes' salt,
        # and the locality its events last named.
        self.lower: dict[str, int] = {}
        self.locality: dict[str, str] = {}

    @property
    def rate(self) -> float:
        return 1.0 / (1 << self.shift)

    @property
    def horizon(self) -> int:
        return HORIZON_FACTOR * max(MIN_CAPACITY, int(self.peak_cached))

    def stored(self, hashes: list, now: float, medium: str | None = None, lora: str | None = None,
               origin: str | None = None, locality: str | None = None) -> None:
        """A BlockStored. Full report mode announces hits as stored: origin REUSED,
        or (no origin) a hash the ledger holds cached, is a hit (`reused`), neither
        stored nor a tick of the clock; origin NEW on a cached hash: another group's."""
        if origin == "REUSED":
            self._reused(hashes, medium, lora)
            return
        salt = medium_salt(medium)
        if salt and medium is not None:
            self._note_lower(medium, locality)
        totals, table, clock = self.totals, self.table, self.totals.clock
        tick = 0 if salt else 1  # a lower tier's store allocates no GPU block: the clock stands
        stored = 0
        shift = self.shift
        now_ms = int(now * 1000) & _MS_MASK
        scale = float(1 << shift)
        trust_new = origin == "NEW"
        again = 0
        new = 0
        duplicate = 0
        reused = 0
        distance = totals.distance
        returns = totals.returns
        seconds = 0.0
        returned = 0
        lower = None if salt else self._lower_holding()
        get = table.get
        for h in self._keys(hashes, salt):
            if h is None:
                clock += tick  # outside the sample: counted as stored (a hit there is not told apart)
                stored += 1
                continue
            value = get(h)
            if value == 0:
                if trust_new:
                    clock += tick
                    stored += 1
                    duplicate += 1
                else:
                    reused += 1
                continue
            clock += tick
            stored += 1
            if value is not None:
                # Its distance: blocks stored after its eviction, before this one.
                d = clock - tick - (value >> 33)
                returned += 1
                if lower is not None and lower(h, d if d < 8 else distance_bucket(d), scale):
                    new += 1  # a lower tier held it: that tier's hit, not recomputation
                    table[h] = 0
                    continue
                again += 1
                distance[d if d < 8 else distance_bucket(d)] += scale
                elapsed = ((now_ms - ((value >> 1) & _MS_MASK)) & _MS_MASK) / 1000.0
                seconds += elapsed
                returns[_return_bucket(elapsed)] += scale
            new += 1
            table[h] = 0
        totals.clock = clock
        totals.stored += stored
        totals.again += again * scale
        totals.again_seconds += seconds * scale
        totals.duplicate += duplicate
        totals.reused += reused * scale
        self.cached += new
        cached = self.cached * scale
        if cached > self.peak_cached:
            self.peak_cached = cached
        self._count_rows(medium, lora, locality, stored, again * scale, reused * scale, returned * scale)
        if len(table) > self.capacity:
            self._sweep()

    def _count_rows(self, medium, lora, locality, stored: int, again: float, reused: float, returned: float) -> None:
        row = self._label_row(medium, lora)
        row[0] += stored
        row[1] += again
        row[2] += reused
        tier = self._tier_row(medium, locality)
        tier[0] += stored
        tier[2] += returned

    def _note_lower(self, medium: str, locality: str | None) -> None:
        name = self.labels.admit(medium)
        if name not in self.lower and len(self.lower) < MAX_LABELS:
            self.lower[name] = medium_salt(medium)
        if locality:
            self.locality[name] = locality

    def _lower_holding(self):
        """A check of the lower tiers for a GPU block back after its eviction:
        the first tier holding it cached is credited (its hit, the distance);
        None while no lower tier has stored anything."""
        if not self.lower:
            return None
        table, totals, tiers = self.table, self.totals, list(self.lower.items())

        def held(h: int, bucket: int, scale: float) -> bool:
            for name, salt in tiers:
                if table.get(h ^ salt) == 0:
                    self._tier_row(name, self.locality.get(name))[2] += scale
                    row = totals.tier_distance.get(name)
                    if row is None:
                        row = totals.tier_distance.setdefault(name, [0.0] * DISTANCE_BUCKETS)
                    row[bucket] += scale
                    return True
            return False
        return held

    def _tier_row(self, medium: str | None, locality: str | None) -> list[float]:
        """[stored, evicted, returned] of a (medium, locality), or of "other" past the budget."""
        tiers = self.totals.tiers
        key = (self.labels.admit(medium or "GPU"), self.labels.admit(locality) if locality else "")
        row = tiers.get(key)
        if row is None:
            if len(tiers) >= MAX_LABELS:
                key = ("other", "")
            row = tiers.setdefault(key, [0.0, 0.0, 0.0])
        return row

    def _keys(self, hashes: list, salt: int) -> list[int | None]:
        """The events' hashes as the table's keys, in order: integers (bytes
        read as their last 8), salted by their medium, None for a hash outside
        the sample (the stored path still counts it)."""
        shift, limit = self.shift, self._limit
        keys: list[int | None] = []
        for h in hashes:
            if type(h) is not int:
                h = int.from_bytes(h[-8:], "big")
            if salt:
                h ^= salt
            keys.append(None if shift and ((h * _MIX) & _MASK64) >= limit else h)
        return keys

    def _reused(self, hashes: list, medium: str | None, lora: str | None) -> None:
        """Blocks the engine says it reused (origin REUSED): hits, cached now."""
        table = self.table
        for h in self._keys(hashes, medium_salt(medium)):
            if h is not None and table.get(h) != 0:
                table[h] = 0  # stored before kvwatch listened, or an eviction the engine undid
                self.cached += 1
        self.totals.reused += len(hashes)
        self._label_row(medium, lora)[2] += len(hashes)
        if len(table) > self.capacity:
            self._sweep()

    def _label_row(self, medium: str | None, lora: str | None) -> list[float]:
        """[stored, stored again, reused] of a (medium, LoRA) pair, or of "other" past the budget."""
        labels = self.totals.labels
        key = self._label_key(medium, lora)
        row = labels.get(key)
        if row is None:
            if len(labels) >= MAX_LABELS:
                key = ("other", "other")
            row = labels.setdefault(key, [0.0, 0.0, 0.0])
        return row

    def removed(self, hashes: list, now: float, medium: str | None = None, locality: str | None = None) -> None:
        totals = self.totals
        table = self.table
        mark = ((totals.clock << 32) | (int(now * 1000) & _MS_MASK)) << 1 | 1
        unknown = 0
        gone = 0
        get = table.get
        for h in self._keys(hashes, medium_salt(medium)):
            if h is None:
                continue
            value = get(h)
            if value is None:
                unknown += 1
            elif value == 0:
                gone += 1
            else:
                continue  # removed twice: the first eviction stands
            table[h] = mark
        totals.evicted += len(hashes)
        totals.unknown_removed += unknown
        self.cached = max(0, self.cached - gone)
        self._tier_row(medium, locality)[1] += len(hashes)
        name = self.labels.admit(medium or "GPU")
        if len(totals.removing) < MAX_LABELS:
            totals.removing.add(name)
        by_medium = totals.evicted_by_medium
        if name in by_medium or len(by_medium) < MAX_LABELS:
            by_medium[name] = by_medium.get(name, 0) + len(hashes)
        else:
            by_medium["other"] = by_medium.get("other", 0) + len(hashes)
        if len(table) > self.capacity:
            self._sweep()

    def _label_key(self, medium: str | None, lora: str | None) -> tuple[str, str]:
        # The stream's label values count against its budget; the hashes'
        # salt above used the medium itself, so folded media stay apart.
        admit = self.labels.admit
        return admit(medium or "GPU"), admit(lora) if lora else ""

    def clear(self) -> None:
        """AllBlocksCleared: the engine reset its prefix cache; what returns
        after it is not an eviction's recomputation, so the table starts over."""
        self.table.clear()
        self.cached = 0
        self.totals.cleared += 1

    def _sweep(self) -> None:
        self.sweeps += 1
        table = self.table
        oldest = self.totals.clock - self.horizon
        if oldest > 0:
            stale = [h for h, v in table.items() if v and (v >> 33) < oldest]
            for h in stale:
                del table[h]
            self.forgotten += len(stale)
        while len(table) > 0.75 * self.capacity:
            self.shift += 1
            self._limit = (1 << 64) >> self.shift
            limit = self._limit
            outside = [h for h in table if ((h * _MIX) & _MASK64) >= limit]
            for h in outside:
                if table.pop(h) == 0:
                    self.cached -= 1
            self.cached = max(0, self.cached)

    def entries(self) -> int:
        return len(self.table)


def _kept(distance: list[float], extra: float) -> float:
    """The returns whose distance is below `extra`: whole buckets below it,
    and of the bucket it falls in the share of its distances below it
    (distances spread evenly within a bucket)."""
    kept = 0.0
    for index, count in enumerate(distance):
        if not count:
            continue
        low, high = bucket_lower(index), bucket_upper(index)
        if high < extra:
            kept += count
        elif low < extra:
            kept += count * (extra - low) / (high - low + 1)
    return kept


def curve(distance: list[float], stored_again: float, points: list[int],
          stored: float = 0.0) -> list[tuple[int, float]]:
    """(extra blocks, blocks stored again that a cache that much larger
    would have kept) for each of `points`: the returns whose distance is
    below the extra blocks. With `stored` (the blocks stored over the same
    span), one second-order step: a kept return is a hit, not a store, so in
    the larger cache fewer blocks are stored between an eviction and a
    return, by the share p of the stores the first order keeps: a return is
    kept when its distance is below extra / (1 - p). One step, not the fixed
    point: iterating compounds the correction and overshoots (measured on
    the simulator, docs/kv-events.md)."""
    out = []
    for extra in points:
        kept = _kept(distance, extra)
        if stored > 0 and kept > 0:
            kept = _kept(distance, extra / (1.0 - min(kept / stored, 0.9)))
        out.append((extra, min(kept, stored_again)))
    return out
