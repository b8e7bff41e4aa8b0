"""Sharded central mode: N kvwatch instances share the replicas a store
holds, with no coordination between them (`kvwatch serve --prometheus URL
--shard k/N`).

Each replica belongs to one shard, decided by rendezvous (highest random
weight) hashing of its identity: every shard scores the replica with a hash
of (identity, shard index) and the highest score owns it. Every instance
computes the same owner from the same identity, and when N grows to N+1 only
the replicas whose new top score is the new shard's move (about 1/(N+1) of
them); the rest keep their owner, their window and their finding holds.

A replica's identity is its replica labels (`--replica-labels`), as
`label=value` pairs sorted by label, empty ones left out: the same replica
has the same identity whatever order the labels are given in.

Each shard asks the store only for its replicas' series: the replicas are
found once per window span from one family every vLLM replica exports
(requests running), and the shard's range queries carry a regular-expression
matcher on the replica label that tells its replicas apart best (the store
selects; it reads and sends only the shard's series). A replica that
appears later joins its shard's queries at the next discovery (at most one
window span). Where the matcher would be longer than
MAX_SHARD_MATCHER_BYTES (stores cap a query's length: VictoriaMetrics'
-search.maxQueryLen is 16 KiB by default), the shard reads every replica's
series and keeps its own.

Fleet findings need every replica of a model: a shard's in-process fleet
rules would see only its share, so a sharded instance shows none; the fleet
alert (VllmFleetReplicaOutlier) and its recording rules run in the store over
the series every shard exports (each with the replica's own labels, so the
union of the shards' exports is the unsharded instance's).

With `--shard ordinal/N` the index is the trailing number of the pod's name
(a StatefulSet names its pods NAME-0 .. NAME-(N-1)), read from the POD_NAME
environment variable (the downward API) or else HOSTNAME.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from kvwatch.engines import vllm
from kvwatch.history.pages import escape

# Past this the shard selects nothing in the query and filters what it reads.
MAX_SHARD_MATCHER_BYTES = 8192
MAX_SHARDS = 1024


class ShardError(ValueError):
    """A --shard that cannot be used (the message says why, in one sentence)."""


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def owns(self, identity: str) -> bool:
        return owner(identity, self.count) == self.index


def _score(identity: str, shard: int) -> int:
    digest = hashlib.blake2b(f"{shard}\x00{identity}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owner(identity: str, count: int) -> int:
    """The shard (0..count-1) that owns a replica: the highest score, the
    lowest index on a tie."""
    best, chosen = -1, 0
    for shard in range(count):
        score = _score(identity, shard)
        if score > best:
            best, chosen = score, shard
    return chosen


def identity(replica_labels: tuple[str, ...], key: tuple[str, ...]) -> str:
    return "\x00".join(f"{label}={value}" for label, value in sorted(zip(replica_labels, key)) if value)


# ASCII digits only (str.isdigit and \d take "²" and "٣", which int() refuses
# or reads), and few of them: int() refuses 5,000 digits with a traceback.
_ORDINAL = re.compile(r"-([0-9]{1,9})\Z")
_NUMBER = re.compile(r"[0-9]{1,9}")


def parse_shard(text: str | None, environ: Mapping[str, str] | None = None) -> Shard | None:
    """`k/N` (0 <= k < N), or `ordinal/N` (k from the pod's name); None for
    no sharding (empty, or N = 1)."""
    import os

    if not text:
        return None
    if environ is None:
        environ = os.environ
    index_text, slash, count_text = text.strip().partition("/")
    if not slash or not _NUMBER.fullmatch(count_text.strip()):
        raise ShardError(f"not a shard: {_shown(text)} (expected k/N, e.g. 0/4, or ordinal/N in a StatefulSet)")
    count = int(count_text)
    if not 1 <= count <= MAX_SHARDS:
        raise ShardError(f"the number of shards must be 1 to {MAX_SHARDS}, not {count}")
    index_text = index_text.strip()
    if index_text == "ordinal":
        name = environ.get("POD_NAME") or environ.get("HOSTNAME") or ""
        found = _ORDINAL.search(name)
        if not found:
            raise ShardError(f"ordinal/{count}: the pod's name ({_shown(name) if name else 'neither POD_NAME nor HOSTNAME is set'}) "
                             "does not end in -<ordinal> as a StatefulSet's pods do")
        index_text = found.group(1)
    if not _NUMBER.fullmatch(index_text):
        raise ShardError(f"not a shard: {_shown(text)} (expected k/N, e.g. 0/4, or ordinal/N in a StatefulSet)")
    index = int(index_text)
    if index >= count:
        raise ShardError(f"shard {index} of {count} does not exist (shards are numbered 0 to {count - 1})")
    return Shard(index, count) if count > 1 else None


def _shown(text: str) -> str:
    """A flag's text as an error quotes it: its start, escaped."""
    return repr(text[:40] + ("..." if len(text) > 40 else ""))


def marker_matcher(source: str) -> str:
    """The __name__ matcher of one family every replica of a source exports
    (requests running): the replicas are found from its few series."""
    if source == "kvwatch":
        return '__name__="kvwatch_engine_requests_running"'
    names = sorted(prefix + family for prefix in vllm.PREFIXES for family in vllm.GAUGES["running"])
    return '__name__=~"' + "|".join(re.escape(name) for name in names) + '"'


def shard_matcher(replica_labels: tuple[str, ...], keys: list[tuple[str, ...]]) -> str:
    """A matcher selecting at least the given replicas (keys in the order of
    replica_labels): a regular expression on the label whose values tell them
    apart best (most distinct values, then fewest bytes); '' where none fits
    in MAX_SHARD_MATCHER_BYTES (or there is nothing to tell apart). The store
    may answer for more replicas (two sharing the label's value): whoever
    reads filters by owner."""
    best = None
    for position, label in enumerate(replica_labels):
        values = sorted({key[position] for key in keys})
        text = f'{label}=~"' + escape("|".join(re.escape(value) for value in values)) + '"'
        rank = (-len(values), len(text))
        if best is None or rank < best[0]:
            best = (rank, text)
    if best is None or len(best[1]) > MAX_SHARD_MATCHER_BYTES:
        return ""
    return best[1]
