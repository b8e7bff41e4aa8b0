"""A range query's answer (a Prometheus matrix) decoded without turning
every sample into Python objects where the reader holds them.

A day of a fleet at 30 s is tens of millions of samples, each written
`[1733184000,"0.25"]`: decoded as JSON, each is a list, an int and a string,
built in the process that reads the store (most of its CPU in the history
benchmark, and it holds the GIL the other reads wait on). Here each series'
labels are decoded as JSON and its values are kept as the text the store
wrote (`RawPairs`), checked for shape; the values are split out where
they are read (Pages, in the worker that diagnoses the replica), and the
whole answer falls back to `json.loads` wherever the text is not the usual
compact layout (spaces, native histograms, another key order, anything odd),
so the result is always what JSON decoding gives (tests/test_history_matrix.py).
"""

from __future__ import annotations

import json

_DECODER = json.JSONDecoder()
_RESULT = '"result":['
_METRIC = '{"metric":'
_VALUES = ',"values":'


class RawPairs:
    """One series' `[[time,"value"],...]` as the store wrote it: every pair
    a number and a quoted string, checked by count (as many `],[` as pairs
    less one, two quotes per pair; no bracket or quote inside a value)."""

    __slots__ = ("text", "count")

    def __init__(self, text: str, count: int):
        self.text = text
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getstate__(self):
        return self.text, self.count

    def __setstate__(self, state) -> None:
        self.text, self.count = state

    def __eq__(self, other) -> bool:
        return isinstance(other, RawPairs) and self.text == other.text

    def first_time(self) -> float:
        return float(self.text[2:self.text.index(",", 2)])

    def last_time(self) -> float:
        return float(self.text[self.text.rindex("[") + 1:self.text.rindex(",")])

    def strings(self) -> list[str]:
        """The values in time order, as the store wrote them."""
        return self.text.split('"')[1::2]

    def pairs(self) -> list[list]:
        """As JSON decoding gives them."""
        return json.loads(self.text)


def pairs_of(values) -> list:
    """A series' values as JSON decoding gives them, however they were read."""
    return values.pairs() if isinstance(values, RawPairs) else values


def joined(earlier, later):
    """Two chunks' values of one series, in time order (either may be raw)."""
    if isinstance(earlier, RawPairs) and isinstance(later, RawPairs):
        if not earlier.count:
            return later
        if not later.count:
            return earlier
        return RawPairs(earlier.text[:-1] + "," + later.text[1:], earlier.count + later.count)
    return list(pairs_of(earlier)) + list(pairs_of(later))


def decode(body: str, keep=None, refused: list | None = None) -> dict:
    """The answer of /api/v1/query_range as json.loads gives it, except that
    each series' `values` may be a RawPairs.

    `keep(metric) -> bool`: a series it refuses is left out as it is read,
    never built beyond its labels (central mode reads only the replicas it
    keeps: an answer of 370,000 small series is 14 bytes held per byte read
    once built, and a store past max_replicas answers mostly series it
    leaves out), and counted in `refused` ([series, samples])."""
    tally = refused if refused is not None else [0, 0]
    found = _scan(body, keep, tally)
    if found is not None:
        return found
    tally[0] = tally[1] = 0
    if keep is None:
        return json.loads(body)
    # Not the usual layout: decoded whole, but each refused series is
    # dropped as soon as its object is complete, so what is held is the
    # kept series and one refused series at a time.
    def hook(obj: dict):
        metric = obj.get("metric")
        if "values" in obj and _is_labels(metric) and not keep(metric):
            values = obj["values"]
            tally[0] += 1
            tally[1] += (len(values) if isinstance(values, list) else 0) or 1
            return _REFUSED
        return obj

    envelope = json.loads(body, object_hook=hook)
    data = envelope.get("data") if isinstance(envelope, dict) else None
    if isinstance(data, dict) and isinstance(data.get("result"), list):
        data["result"] = [series for series in data["result"] if series is not _REFUSED]
    return envelope


def decode_listing(body: str, labels: tuple[str, ...]) -> object:
    """The answer of /api/v1/series as json.loads gives it, except that each
    label set is cut to `labels` (and the envelope's own string keys), and
    label sets equal once cut are one object (read, never changed, by whoever
    reads the list).

    A listing is read to find names and replicas, and one label set of a few
    bytes decoded whole is a dict of about 200: a list of 11 million empty
    label sets under central mode's 32 MiB cap held 942 MiB, where cut and
    shared it holds a reference per label set. A label set with a value that
    is not a string is left whole, so the answer's check still refuses it."""
    kept = tuple(labels) + _ENVELOPE
    shared: dict[tuple, dict] = {}

    def hook(obj: dict):
        for value in obj.values():
            if type(value) is not str:
                return obj
        key = tuple(obj.get(label) for label in kept)
        cut = shared.get(key)
        if cut is None:
            cut = shared[key] = {label: value for label, value in zip(kept, key) if value is not None}
        return cut

    return json.loads(body, object_hook=hook)


# The string keys of an answer's envelope (an error answer is all strings:
# cut like a label set, it keeps them).
_ENVELOPE = ("status", "errorType", "error")


# What decode's hook leaves where a refused series was (not None: a store's
# own null in the result still fails the answer's check).
_REFUSED = object()


def _is_labels(metric) -> bool:
    # Keys and values checked in C (map), not a generator per label: this
    # runs for every series a keeping read decodes.
    return isinstance(metric, dict) and all(map(_IS_STR, metric)) and all(map(_IS_STR, metric.values()))


_IS_STR = str.__instancecheck__


def _scan(body: str, keep, tally: list) -> dict | None:
    """The fast path, or None where the text is not its layout."""
    begin = body.find(_RESULT)
    if begin < 0:
        return None
    at = begin + len(_RESULT)
    series = []
    try:
        if body[at] != "]":
            while True:
                if not body.startswith(_METRIC, at):
                    return None
                metric, at = _DECODER.raw_decode(body, at + len(_METRIC))
                if not isinstance(metric, dict) or not body.startswith(_VALUES, at):
                    return None
                at += len(_VALUES)
                end = body.index("]]", at) + 2
                # Counted in place (a refused series' text is never copied).
                count = body.count("],[", at, end) + 1
                # No bracket, quote or escape but the layout's: then the pairs
                # are exactly `count`, and each value is the text between quotes.
                if (not body.startswith("[[", at) or body.count('"', at, end) != 2 * count
                        or body.count("[", at, end) != count + 1 or body.find("\\", at, end) >= 0):
                    return None
                if body[end] != "}":
                    return None
                if keep is None or not _is_labels(metric) or keep(metric):
                    series.append({"metric": metric, "values": RawPairs(body[at:end], count)})
                else:
                    tally[0] += 1
                    tally[1] += count
                at = end + 1
                if body[at] == "]":
                    break
                if body[at] != ",":
                    return None
                at += 1
        # The envelope (status, data, warnings...) around the result, as JSON.
        envelope = json.loads(body[:begin] + '"result":[]' + body[at + 1:])
    except (ValueError, IndexError):
        return None
    data = envelope.get("data") if isinstance(envelope, dict) else None
    if not isinstance(data, dict) or data.get("result") != [] or data.get("resultType") != "matrix":
        return None
    data["result"] = series
    return envelope
