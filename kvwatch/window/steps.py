"""One engine's increase between two polls (Step), what a window adds up
to (Increase), and the window's entry (a snapshot with its steps).


Each snapshot is stored with its increase over the previous one, per engine,
computed once when it arrives, so a window's increase is a sum of stored steps
(Prometheus' `increase()` semantics, without its extrapolation):
- a reset is per series (Prometheus' rule): a counter that went down restarted
  from zero, so its step is its new value; a histogram whose count or any
  bucket went down, or whose bounds changed, restarted too. One series going
  down says nothing about the others: they keep their differences;
- a restart of the whole engine is a separate fact, read only from evidence
  of one: a new process start time (`process_start_time_seconds`), or a
  changed `_created` time together with a series that went down, or every
  counter that had counted something going down at once. Then every series
  counts its new value, even one that already climbed past its old value.
  `_created` alone is no evidence: a page may move it on every poll while
  its counters climb;
- a canonical key read from another vLLM family than in the previous poll
  (`gpu_prefix_cache_queries` -> `prefix_cache_queries`) means the engine was
  upgraded, so restarted, but the two values may not even share a unit
  (blocks before vLLM 0.9, tokens after) and nothing says the new ones started
  from zero: that step is marked a restart and counts neither increase nor time.
A reset therefore never produces a negative rate or a spike.

"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvwatch.snapshot import COUNTER_ROUNDING, EngineSnapshot, Histogram, Snapshot

EngineKey = tuple[str, str]


@dataclass(slots=True)
class Step:
    """The increase of one engine's counters and histograms between two polls."""

    seconds: float
    counters: dict[str, float]
    histograms: dict[str, Histogram]
    restarted: bool


@dataclass(slots=True)
class Entry:
    snapshot: Snapshot
    steps: dict[EngineKey, Step] = field(default_factory=dict)
    # What readers derive from this entry once, for every poll it stays in
    # the window (diagnosis' per-engine Polls); it leaves with the entry.
    derived: dict = field(default_factory=dict)
    # pair_bytes of its (model, engine) pairs, summed.
    size: int = 0


# What an entry derived that stays true when the window forgets some of its
# pairs: the changes read between it and the entry before, as they were
# seen (diagnose.changes). The rest is derived again from what is left.
DERIVED_KEPT_WHEN_TRIMMED = ("changes",)


@dataclass(slots=True)
class Increase:
    """What a window adds up to for one engine (or one model)."""

    seconds: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    restarts: int = 0
    steps: int = 0

    def add(self, step: Step | "Increase") -> None:
        for key, value in step.counters.items():
            self.counters[key] = self.counters.get(key, 0.0) + value
        for key, histogram in step.histograms.items():
            existing = self.histograms.get(key)
            if existing is None:
                self.histograms[key] = histogram
            else:
                merged = existing.plus(histogram)
                # Bounds changed inside the window: the newer bounds win.
                self.histograms[key] = merged if merged is not None else histogram
        if isinstance(step, Step):
            self.restarts += step.restarted
            self.steps += 1
        else:
            self.restarts += step.restarts
            self.steps += step.steps

    def rate(self, key: str) -> float | None:
        if self.seconds <= 0 or key not in self.counters:
            return None
        return self.counters[key] / self.seconds

    def ratio(self, numerator: str, denominator: str) -> float | None:
        below = self.counters.get(denominator)
        above = self.counters.get(numerator)
        if not below or above is None:
            return None
        if above > below:
            # A part larger than its whole: the two counters disagree over the
            # window (a restart that left no evidence, with one reset seen and
            # the other not). No answer is better than one above 1.
            return None
        return above / below


def step_between(earlier: EngineSnapshot, later: EngineSnapshot, seconds: float, renamed: bool = False,
                 new_process: bool = False) -> Step:
    """Only series present in both polls count: one that just appeared has no
    increase yet. `renamed`: the page spells a key with another vLLM family
    than the previous one did (a version change). `new_process`: the page's
    process start time changed."""
    if renamed:
        # Counting the new values (the reset rule) could add lifetime totals
        # in another unit as one step's increase: a spike. Skip the step, its
        # time included, so rates average over the steps that did count.
        return Step(0.0, {}, {}, True)
    histogram_deltas = {
        key: histogram.minus(earlier.histograms[key])
        for key, histogram in later.histograms.items()
        if key in earlier.histograms
    }
    # Counters that had counted something: did they go down, and all of them?
    # (A fall within COUNTER_ROUNDING of the value is no fall.)
    fell = [later.counters[key] < before - before * COUNTER_ROUNDING for key, before in earlier.counters.items()
            if before > 0 and key in later.counters]
    went_down = any(fell) or any(delta is None for delta in histogram_deltas.values())
    created_moved = earlier.created is not None and later.created is not None and later.created != earlier.created
    # Every counter going down at once (two at least) is a restart too: the
    # evidence pages without `_created` and a process start time have.
    restarted = new_process or (created_moved and went_down) or (len(fell) >= 2 and all(fell))
    counters = {}
    for key, value in later.counters.items():
        before = earlier.counters.get(key)
        if before is not None:
            # A series that went down restarted from zero: its increase is its
            # new value; one that fell within rounding did not move.
            if restarted:
                counters[key] = value
            elif value >= before:
                counters[key] = value - before
            else:
                counters[key] = 0.0 if value >= before - before * COUNTER_ROUNDING else value
    histograms = {key: later.histograms[key] if restarted or delta is None else delta
                  for key, delta in histogram_deltas.items()}
    _add_prefill_fit(counters, histograms)
    return Step(seconds, counters, histograms, restarted)


# The step's prefill (requests n, computed tokens t, seconds p) as the cross
# products a least-squares fit of p = a*n + b*t over the window's steps sums
# (kvwatch.signals.worth): counters, so the window adds and takes them away.
# Where the same requests' prompt lengths are observed too, the positions of
# the cached tokens (k: their count, h: their positions' sum) price a hit by
# where it sat in its prompt, and the steps that finished one request join a
# second fit, p = a + b*t + c*q, q the positions its computed tokens sat at
# (POSITION_FIT): a step's sums give a request's positions only where it
# holds one request.
PREFILL_FIT = "prefill_fit/"
POSITION_FIT = "position_fit/"
_COMPUTED = "prompt_tokens_by_source/local_compute"


def _add_prefill_fit(counters: dict[str, float], histograms: dict[str, Histogram]) -> None:
    # The tokens observed with the same requests' prefill time where the engine says (vLLM 0.13+); else
    # the step's computed tokens, counted at prefill, while the time is observed at the request's end.
    prefill, with_it = histograms.get("prefill_time"), histograms.get("prefill_computed")
    paired = prefill is not None and with_it is not None and with_it.count == prefill.count
    computed = with_it.sum if paired and with_it is not None else counters.get(_COMPUTED)
    if prefill is None or computed is None or prefill.count <= 0:
        return
    n, t, p = float(prefill.count), float(computed), float(prefill.sum)
    for name, value in (("nn", n * n), ("nt", n * t), ("tt", t * t), ("np", n * p), ("tp", t * p)):
        counters[PREFILL_FIT + name] = value
    prompts = histograms.get("prompt_len")
    if not paired or prompts is None or prompts.count != prefill.count or prompts.sum < t:
        return
    # A request of P prompt tokens, K of them cached, computes positions K..P-1 and was spared 0..K-1.
    # The page gives the step's sums alone: its requests are taken as one shape, their mean, for the
    # cached tokens' positions (a lower bound where shapes mix: the mean of squares is at least the
    # square of the mean, so a hit is never priced deeper than it sat).
    prompt, cached = float(prompts.sum) / n, (float(prompts.sum) - t) / n
    counters[PREFILL_FIT + "k"], counters[PREFILL_FIT + "h"] = n * cached, n * cached * (cached - 1.0) / 2.0
    if n != 1.0:
        # Mixed requests' positions from their means read the spread of their sizes as cost: not fitted.
        return
    q = t * (prompt + cached - 1.0) / 2.0
    for name, value in (("n", 1.0), ("t", t), ("q", q), ("tt", t * t), ("tq", t * q), ("qq", q * q),
                        ("p", p), ("tp", t * p), ("qp", q * p)):
        counters[POSITION_FIT + name] = value
