"""Prefix reuse per tenant (LMCache's `cache_salt`, llm-d's `fairness_id`)
and per LoRA adapter (vLLM's events' `lora_name`), bounded to the top K plus
"other", and who evicts whom from the KV-cache event stream.

- TenantTable: counters per (kind, tenant) summed over a window: queried and
  hit tokens, blocks stored and stored again (returned after an eviction),
  recomputed tokens. `rows(k)` gives the K tenants with the most queried
  tokens (stored blocks where nothing was queried) and one "other" row
  summing the rest, so every per-tenant signal has at most K + 1 series
  however many tenants the sources name. The table itself holds at most
  `max_tenants` names (past it a new name counts into "other" at once).
- EvictionLedger: vLLM evicts a cached block when an allocation needs room,
  and the request that allocated stores its own blocks next: each
  BlockRemoved is charged to the tenant of the next BlockStored (the
  evictor), against the tenant whose BlockStored had put the block there
  (the victim). An eviction costs something only if the block is stored
  again later (it was reusable, and was recomputed): `finding()` names the
  tenant that evicts others' reusable blocks most, with its share of all
  evictions of reusable blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvwatch.labels import OTHER, bounded_label
from kvwatch.stream_report import KVEventsReport

KINDS = ("cache_salt", "fairness_id", "lora")
DEFAULT_TOP_K = 10
MAX_TENANTS = 10_000
FIELDS = ("queries", "hits", "stored", "stored_again", "recomputed")


@dataclass
class TenantRow:
    tenant: str
    queries: float = 0.0
    hits: float = 0.0
    stored: float = 0.0
    stored_again: float = 0.0
    recomputed: float = 0.0
    tenants: int = 1  # how many tenants the row sums ("other": more than one)

    def add(self, other: "TenantRow") -> None:
        for name in FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.tenants += other.tenants

    @property
    def hit_ratio(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 and self.hits <= self.queries else None

    @property
    def stored_again_share(self) -> float | None:
        return self.stored_again / self.stored if self.stored > 0 else None

    def as_dict(self) -> dict[str, Any]:
        """The row as the reports and the JSON API carry it."""
        return {"tenant": self.tenant, "tenants": self.tenants, "queries": self.queries, "hits": self.hits,
                "hit_ratio": self.hit_ratio, "stored": self.stored, "stored_again": self.stored_again,
                "stored_again_share": self.stored_again_share, "recomputed_tokens": self.recomputed}

    def signals(self) -> dict[str, float | None]:
        return {"hit_ratio": self.hit_ratio, "stored_again_share": self.stored_again_share,
                "recomputed_tokens": self.recomputed}


@dataclass
class TenantTable:
    """One kind's tenants over a window, bounded by `max_tenants` names."""

    kind: str
    max_tenants: int = MAX_TENANTS
    rows: dict[str, TenantRow] = field(default_factory=dict)
    overflow: TenantRow = field(default_factory=lambda: TenantRow(OTHER, tenants=0))

    def add(self, tenant: str, **counts: float) -> None:
        unknown = set(counts) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown tenant counter(s) {', '.join(sorted(unknown))} (expected {', '.join(FIELDS)})")
        name = bounded_label(tenant) if tenant else "(none)"
        row = self.rows.get(name)
        if row is None:
            if len(self.rows) >= self.max_tenants or name == OTHER:
                row = TenantRow(name)
                for key, value in counts.items():
                    setattr(row, key, value)
                self.overflow.add(row)
                return
            row = self.rows[name] = TenantRow(name)
        for key, value in counts.items():
            setattr(row, key, getattr(row, key) + value)

    def top(self, k: int = DEFAULT_TOP_K) -> list[TenantRow]:
        """The k heaviest tenants (queried tokens, then stored blocks, then name) and one "other" row."""
        if k < 0:
            raise ValueError(f"top K must be 0 or more, got {k}")
        ranked = sorted(self.rows.values(), key=lambda r: (-r.queries, -r.stored, r.tenant))
        out = ranked[:k]
        other = TenantRow(OTHER, tenants=0)
        for row in ranked[k:]:
            other.add(row)
        other.add(self.overflow)
        if other.tenants:
            out.append(other)
        return out

    def series(self, signal: str, k: int = DEFAULT_TOP_K) -> dict[str, float]:
        """tenant -> the signal's value, at most k + 1 of them; absent where unknown."""
        out: dict[str, float] = {}
        for row in self.top(k):
            value = row.signals()[signal]
            if value is not None:
                out[row.tenant] = value
        return out


def tenant_sums(families: dict[str, Any], label: str, queried: str, hit: str,
                max_tenants: int = MAX_TENANTS) -> dict[str, list[float]]:
    """tenant -> [queried, hit] cumulative sums over one page's counter families
    (Family objects by name) by `label`, summed over every other label; at most
    `max_tenants` names, the rest summed as "other"."""
    out: dict[str, list[float]] = {}
    for slot, name in enumerate((queried, hit)):
        family = families.get(name)
        for suffix, labels, value in (family.samples if family is not None else ()):
            if suffix not in ("", "_total", "_sum") or not 0.0 <= value < float("inf"):
                continue
            tenant = bounded_label(labels.get(label, "")) or "(none)"
            if tenant not in out and len(out) >= max_tenants:
                tenant = OTHER
            out.setdefault(tenant, [0.0, 0.0])[slot] += value
    return out


def window_rows(kind: str, start: dict[str, list[float]], end: dict[str, list[float]],
                k: int = DEFAULT_TOP_K) -> list[TenantRow]:
    """The top k tenants and "other" over a window between two tenant_sums
    (a sum that fell restarted from zero, as a counter does)."""
    table = TenantTable(kind)
    for tenant, (queried, hit) in end.items():
        before = start.get(tenant, [0.0, 0.0])
        queries = queried - before[0] if queried >= before[0] else queried
        hits = hit - before[1] if hit >= before[1] else hit
        if queries > 0:
            table.add(tenant, queries=queries, hits=hits)
    return table.top(k)


def lora_rows(kv_events: KVEventsReport | None, k: int = DEFAULT_TOP_K) -> list[dict[str, Any]]:
    """Per LoRA adapter over the stream's window (vLLM's BlockStored carries it;
    the stream's report sums its blocks stored and stored again by medium and
    adapter): the k adapters that stored most, and "other". "(base)" is the
    base model's own blocks. Recomputed tokens: the GPU's blocks stored again
    after their eviction times the block size the window's lost counts in (the
    events', else the page's: worth.with_worth; unknown, none counted)."""
    window = kv_events.get("window") if kv_events else None
    block_size = ((kv_events.get("block_size") if kv_events else None)
                  or (window.get("tokens_per_block") if window else None) or 0)
    table = TenantTable("lora")
    for row in (window.get("by_label") if window else None) or ():
        again = float(row.get("stored_again") or 0.0)
        recomputed = again * block_size if row.get("medium") in (None, "GPU") else 0.0
        table.add(row.get("lora_name") or "(base)", stored=float(row.get("stored") or 0.0), stored_again=again,
                  recomputed=recomputed)
    return [row.as_dict() for row in table.top(k)]


@dataclass
class EvictionLedger:
    """Who evicts whom: victims' blocks charged to the tenant that stored next,
    and the evictions that cost a recomputation (the block was stored again
    later: it was reusable) counted apart."""

    max_blocks: int = 1_000_000
    owners: "OrderedDict[int, str]" = field(default_factory=OrderedDict)
    pending: list[tuple[str, int]] = field(default_factory=list)  # (victim, block) of removals not yet charged
    evicted_by: "OrderedDict[int, tuple[str, str]]" = field(default_factory=OrderedDict)  # block -> (evictor, victim)
    charged: dict[tuple[str, str], int] = field(default_factory=dict)  # (evictor, victim) -> blocks
    returned: dict[tuple[str, str], int] = field(default_factory=dict)  # (evictor, victim) -> blocks stored again

    max_pairs: int = 10_000

    def _count(self, table: dict[tuple[str, str], int], key: tuple[str, str]) -> None:
        if key in table or len(table) < self.max_pairs:  # pairs bounded: a flood of names adds none past it
            table[key] = table.get(key, 0) + 1

    def stored(self, hashes: list[int], tenant: str) -> None:
        tenant = bounded_label(tenant) if tenant else "(none)"
        evicted_by = self.evicted_by
        for victim, block in self.pending:
            self._count(self.charged, (tenant, victim))
            evicted_by[block] = (tenant, victim)
        self.pending.clear()
        owners = self.owners
        for block in hashes:
            pair = evicted_by.pop(block, None)
            if pair is not None:
                self._count(self.returned, pair)
            owners[block] = tenant
            owners.move_to_end(block)
        for table in (owners, evicted_by):
            while len(table) > self.max_blocks:
                table.popitem(last=False)

    def removed(self, hashes: list[int]) -> None:
        for block in hashes:
            victim = self.owners.pop(block, None)
            if victim is not None and len(self.pending) < self.max_blocks:
                self.pending.append((victim, block))

    def clear(self) -> None:
        """The engine cleared its cache: no block is held, no eviction pending (what was counted stays)."""
        self.owners.clear()
        self.pending.clear()
        self.evicted_by.clear()

    def snapshot(self) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]:
        """The counts so far (charged, returned), to count a window from."""
        return dict(self.charged), dict(self.returned)

    def reusable_evicted(self) -> dict[str, int]:
        """evictor -> blocks of other tenants it evicted that were stored again (recomputed)."""
        return _others(self.returned)

    def finding(self, min_blocks: int = 32,
                since: tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]] | None = None
                ) -> dict[str, Any] | None:
        """The tenant whose traffic evicts other tenants' reusable blocks most, its
        share of all evictions of reusable blocks, and whom it evicted; counted
        since `since` (a snapshot), else since the ledger began."""
        charged, returned = self.charged, self.returned
        if since is not None:
            charged, returned = _delta(charged, since[0]), _delta(returned, since[1])
        total = sum(returned.values())
        others = _others(returned)
        if not others or total < min_blocks:
            return None
        evictor, blocks = max(others.items(), key=lambda item: (item[1], item[0]))
        victims = {victim: n for (who, victim), n in returned.items() if who == evictor and victim != evictor}
        return {"evictor": evictor, "evicted_blocks": blocks, "reusable_evictions": total, "share": blocks / total,
                "evictions": sum(charged.values()),
                "victims": dict(sorted(victims.items(), key=lambda item: -item[1])[:DEFAULT_TOP_K])}


def _delta(end: dict[tuple[str, str], int], start: dict[tuple[str, str], int]) -> dict[tuple[str, str], int]:
    out = {key: value - start.get(key, 0) for key, value in end.items()}
    return {key: value for key, value in out.items() if value > 0}


def _others(returned: dict[tuple[str, str], int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for (evictor, victim), blocks in returned.items():
        if evictor != victim:
            out[evictor] = out.get(evictor, 0) + blocks
    return out
