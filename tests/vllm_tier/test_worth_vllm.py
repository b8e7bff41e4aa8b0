"""What the cache is worth, against the real vLLM 0.32 of the CPU tier: saved,
lost and needed, each against what the engine itself measured.

- Saved: the same seeded load (16 groups of a shared prefix, 512 to 1,920
  tokens, and suffixes of each request's own, four requests a group in a
  seeded order), one request at a time, sent to a vLLM with prefix caching on
  (kvwatch reading it), then on that engine again with a salt a request (no
  request finds a cached block), then, once it is stopped, to one started with
  prefix caching off: one engine up at a time, since an idle vLLM's CPU
  threads spin on the cores the serving one needs. The truth is the difference
  in vLLM's own prefill time (vllm:request_prefill_time_seconds sum): the
  salted load's against the cached one's on the same engine (asserted), and
  the off-engine's (reported); kvwatch's saved seconds are read from the
  on-run's window alone.
- Lost: a burst far beyond the tier's 128 blocks, so vLLM preempts. vLLM
  0.32 counts a request's prompt tokens once, at its first token (the prompt
  counters, the prefill's computed tokens and the per-step token histogram
  alike), so the only count of the prefill it did again is its KV-cache event
  stream: blocks stored again after their eviction, kvwatch's `stream` basis.
  kvwatch's lost is checked against that count at its rate, and the page's
  bound (preemptions x the mean prompt, kvwatch's lost without the stream)
  within 20 % of it.
- Needed: a burst of requests, more than the tier's cache admits at once,
  read the way `kvwatch capacity --prometheus` reads its store (running,
  waiting, KV usage, first-token p95), inverted for an objective; then the
  same burst on a vLLM with the blocks kvwatch says are needed and on one
  with half of them.

The figures of each run are printed ([vllm-tier] lines) and kept in
docs/capacity.md. Its own module: five vLLM start-ups, short loads; saved runs
first in the tier (`alone`), before any shared engine is up (SAVED_BAR says why)."""

from __future__ import annotations

import json
import math
import random
import statistics
import threading
import time
import urllib.request
from dataclasses import dataclass

import pytest

from kvwatch.capacity.needed import CacheShape, Step, needed
from kvwatch.signals import worth as worth_of
from kvwatch.window.steps import PREFILL_FIT

from .harness import (
    MODEL_NAME, TINY_MODEL_BLOCK_BYTES_PER_TOKEN, _post_json, burst_load, prompt_suffix, prompt_text, prompt_words,
    read_metrics, vllm_server, wait_until_idle,
)
from .kvwatch_support import read_kvwatch_diagnosis, running_kvwatch, tier_reporter
from .test_kv_events_vllm import events_config, free_port

pytestmark = pytest.mark.vllm

PREFILL = "vllm:request_prefill_time_seconds_sum"
STARTUP_S = 420.0
BLOCK = 32
# Saved: 2,048 positions is the tiny model's limit; 48 MiB of cache, 1,536 blocks, hold every group's prefix
# and the suffixes between their uses.
LONG_LEN, LONG_CACHE, SEED = 2048, 48 << 20, 51
# The seeded load: shared prefixes as tenants' system prompts and documents make them, four groups of each
# (prefix, own suffix) shape (prefixes whole blocks), four requests a group in a seeded order: a group's first
# request computes its prefix, the other three hit it. The window's own cold requests (16, of four lengths,
# beside the warm ones' suffixes at four depths) are what kvwatch prices the hits from: a per-request spread
# of 15-20 % on these cores needs that many.
GROUP_SHAPES, GROUPS_OF_A_SHAPE = ((1920, 64), (1536, 128), (1024, 64), (512, 256)), 4
GROUPS = GROUP_SHAPES * GROUPS_OF_A_SHAPE
PER_GROUP = 4


@pytest.fixture(scope="module")
def report(request):
    return tier_reporter(request.config)


def _complete(server, prompt: str, salt: str | None = None) -> dict:
    """One completion of one token; a `salt` (vLLM's cache_salt) keeps it from every cached block hashed
    without the same salt: the prompt is computed whole on an engine whose prefix caching is on."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1} | ({"cache_salt": salt} if salt else {})
    return _post_json(server.base_url + "/v1/completions", body, 120.0)["usage"]


def _prefill_of(server, prompt: str, salt: str | None = None) -> float:
    """One request alone on an idle engine: its prefill seconds, vLLM's own count."""
    before = read_metrics(server.metrics_url).value(PREFILL)
    _complete(server, prompt, salt)
    return wait_until_idle(server.metrics_url).value(PREFILL) - before


def _worth(kvwatch_url: str) -> dict:
    with urllib.request.urlopen(kvwatch_url + "/api/v1/signals", timeout=5) as response:
        [worth] = json.loads(response.read())["worth"]
    return worth


# Saved against vLLM's own difference, the bar. The truth: the same prompts on the same engine, each
# with a salt of its own (vLLM's cache_salt: no request finds a cached block), against them without. An
# engine restarted with prefix caching off is run too and reported: two engine processes on these two cores
# disagreed on the cost of same-sized cold prompts by up to 27 %, the bar's own size, in the runs of an
# earlier probe (docs/capacity.md); on this load by -5.0 to +0.6 % in three runs.
SAVED_BAR = 0.15


@dataclass(frozen=True)
class SavedLoad:
    """The seeded load: its prompts in order, each one's kind ((prefix, suffix) tokens, whether it finds
    its prefix cached), the prompts that pay each shape's first use before kvwatch starts (another prefix
    of each shape, cold then warm), and the tokens it should hit."""

    prompts: list[str]
    kinds: list[tuple[tuple[int, int], bool]]
    first_uses: list[str]
    hits: int


def _saved_load(rng: random.Random, words: list[str]) -> SavedLoad:
    prefixes = [prompt_text(prefix, rng, words) for prefix, _ in GROUPS]
    order = [group for group in range(len(GROUPS)) for _ in range(PER_GROUP)]
    rng.shuffle(order)
    prompts = [prefixes[group] + prompt_suffix(GROUPS[group][1], rng, words) for group in order]
    kinds = [(GROUPS[group], group in order[:i]) for i, group in enumerate(order)]
    first_uses = []
    for prefix, suffix in GROUP_SHAPES:  # an engine's first request of a shape runs slow (1.3-2x the later ones)
        other = prompt_text(prefix, rng, words)
        first_uses += [other + prompt_suffix(suffix, rng, words) for _ in range(2)]
    return SavedLoad(prompts, kinds, first_uses, sum(prefix for prefix, _ in GROUPS) * (PER_GROUP - 1))


def _polls_past(kvwatch, polls: int) -> None:
    """Waits for kvwatch's poll count to pass `polls`."""
    deadline = time.monotonic() + 10
    while kvwatch.monitor.state.polls <= polls:
        assert time.monotonic() < deadline, "kvwatch stopped polling"
        time.sleep(0.02)


def _alone_in_a_poll(server, kvwatch, prompt: str, salt: str | None = None) -> float:
    """One request's prefill seconds, the request alone in kvwatch's poll: the next request starts after
    a poll begun once this one had ended (kvwatch fits where a request's tokens sat from such polls)."""
    seconds = _prefill_of(server, prompt, salt)
    _polls_past(kvwatch, kvwatch.monitor.state.polls + 1)
    return seconds


def _device_hits(server) -> float:
    return read_metrics(server.metrics_url).value("vllm:prompt_tokens_cached_by_source_total", source="device")


def _run_load(server, kvwatch, prompts: list[str]) -> dict:
    """The load on one engine, one request at a time and one a poll (no queue mixes two requests' prefill,
    no poll two requests' sums), read by a kvwatch that polled the engine from before it: each request's
    prefill seconds, the engine's prefix-cache hits over the load, and kvwatch's worth and fits at its end."""
    before = _device_hits(server)
    _polls_past(kvwatch, 4)  # kvwatch's first polls of the idle engine
    times = [_alone_in_a_poll(server, kvwatch, prompt) for prompt in prompts]
    time.sleep(1)
    hits = _device_hits(server) - before
    view = kvwatch.monitor.state.per_engine[0].view
    # The window's sums the fits solve (kept with the requests: why a fit was refused can be read from them).
    sums = {key: value for key, value in view.increase.counters.items() if key.startswith(PREFILL_FIT)}
    return {"times": times, "hits": hits, "worth": _worth(kvwatch.url), "sums": sums,
            "fits": [worth_of.fitted_prefill_cost(view), worth_of.position_fit(view)]}


def _salted(server, kvwatch, prompts: list[str], tag: str) -> list[float]:
    """The load with a salt a request, paced alike: its prefill seconds on this engine without a hit."""
    before = _device_hits(server)
    times = [_alone_in_a_poll(server, kvwatch, prompt, salt=f"{tag}-{i}") for i, prompt in enumerate(prompts)]
    assert _device_hits(server) == before  # each salted request computed its whole prompt
    return times


def _spread(times: list[float]) -> str:
    """Prefill seconds' spread for the report: min, quartiles and max in ms."""
    q1, q2, q3 = statistics.quantiles(times, n=4)
    return f"{min(times) * 1e3:.1f}/{q1 * 1e3:.1f}/{q2 * 1e3:.1f}/{q3 * 1e3:.1f}/{max(times) * 1e3:.1f} ms"


def _saved_figures(load: SavedLoad, on: dict, off: dict, report) -> dict:
    """kvwatch's saved seconds from the on-engine's window against two truths, each the engine's own
    prefill-time difference for the same prompts: the same engine without a hit (the salted load), and an
    engine with prefix caching off; reported with the spread of each run's per-request prefill times."""
    on_times, off_times = on["times"], off["times"]
    # The salted load before the cached one and after it: the mean of each request's two, so a drift of the
    # engine's speed over the run cancels to first order.
    before, after = on["uncached"]
    uncached = [(a + b) / 2 for a, b in zip(before, after)]
    truth, truth_off = sum(uncached) - sum(on_times), sum(off_times) - sum(on_times)
    pairs = [b - a for a, b in zip(on_times, uncached)]
    worth, hits = on["worth"], on["hits"]
    saved, per_token, cached = worth["saved_seconds"], worth["prefill_seconds_per_token"], worth["cached_token_seconds"]
    linear = hits * per_token
    two, three = on["fits"]
    # The truth's own standard error: the spread of the pairs of each kind of request, summed over the kinds.
    by_kind: dict = {}
    for kind, pair in zip(load.kinds, pairs):
        by_kind.setdefault(kind, []).append(pair)
    error = math.sqrt(sum(len(kind) * statistics.variance(kind) for kind in by_kind.values()))
    groups = ", ".join(f"{prefix} + {suffix}" for prefix, suffix in GROUP_SHAPES)
    report(f"saved: {len(load.prompts)} requests, {PER_GROUP} of each of {len(GROUPS)} groups' prefix + own "
           f"tokens ({GROUPS_OF_A_SHAPE} groups of each: {groups}), one at a "
           f"time, each engine alone; prefill {sum(on_times):.3f} s with prefix caching, {sum(uncached):.3f} s on "
           f"the same engine with a salt a request, no hit (mean of {sum(before):.3f} s before and {sum(after):.3f} s "
           f"after): {truth:.3f} s saved by vLLM's count (standard error "
           f"{error:.3f} s); kvwatch says {saved:.3f} s for {hits:.0f} cached tokens at {cached * 1e6:.1f} us a "
           f"cached token ({100 * (saved - truth) / truth:+.1f} %); the linear price, {per_token * 1e6:.1f} us a "
           f"computed token, said {linear:.3f} s ({100 * (linear - truth) / truth:+.1f} %); fits: requests and "
           f"tokens {_terms(two)}, and positions {_terms(three)}")
    report(f"saved, with prefix caching off: the same requests took {sum(off_times):.3f} s on an engine started "
           f"with --no-enable-prefix-caching ({100 * (sum(off_times) - sum(uncached)) / sum(uncached):+.1f} % of "
           f"the salted load on the first engine): {truth_off:.3f} s saved by that difference, kvwatch "
           f"{100 * (saved - truth_off) / truth_off:+.1f} % of it")
    report(f"saved: per-request prefill (min/q1/median/q3/max): with caching {_spread(on_times)}, salted "
           f"{_spread(uncached)}, caching off {_spread(off_times)}")
    assert truth > 0 and truth_off > 0
    assert hits == load.hits  # each group's first request is cold, each later one hits its prefix
    assert saved == pytest.approx(hits * cached, rel=1e-9)
    assert off["hits"] == 0 and off["worth"]["saved_seconds"] == 0  # without prefix caching nothing is saved
    return {"groups": [list(group) for group in GROUPS], "on": on_times, "uncached": [before, after], "off": off_times,
            "saved": saved, "truth": truth, "truth_off": truth_off, "linear": linear, "fits": [two, three],
            "sums": on["sums"]}


def _terms(fit) -> str:
    """A fit's terms in ms a request, us a token and ns a position, for the report."""
    if fit is None:
        return "none (the polls cannot tell the terms apart)"
    return ", ".join(f"{value * scale:.3g} {unit}" for value, (scale, unit) in
                     zip(fit, ((1e3, "ms"), (1e6, "us"), (1e9, "ns"))))


@pytest.mark.alone
@pytest.mark.timeout(1200)  # two vLLM start-ups, one after the other, and 200 + 72 requests
def test_saved_is_the_cached_tokens_at_the_fitted_rate_within_the_bar_of_the_prefill_time_caching_saves(
        vllm_build, tmp_path_factory, report):
    venv, model = vllm_build
    load = _saved_load(random.Random(SEED), prompt_words())
    runs: dict[str, dict] = {}
    # One engine at a time: an idle vLLM's CPU threads spin on the cores the serving one needs, so two up at
    # once made the prefill times stalls (docs/capacity.md). The on-engine first, then the off-engine with
    # the same prompts in the same order, each polled by a kvwatch of its own, so both serve the same scrapes.
    for name, extra in (("on", ()), ("off", ("--no-enable-prefix-caching",))):
        port = free_port()
        with vllm_server(port=port, model_dir=model, venv=venv, max_model_len=LONG_LEN,
                         kv_cache_memory_bytes=LONG_CACHE, startup_timeout_s=STARTUP_S, report=report,
                         extra_args=extra, log_path=tmp_path_factory.mktemp(f"vllm-saved-{name}") / "server.log") \
                as server:
            for prompt in load.first_uses:
                _complete(server, prompt)
            url = f"http://127.0.0.1:{port}/metrics"
            if name == "on":  # the truth's salted load, before the cached one (paced alike; no figure read)
                with running_kvwatch(url, poll_interval="0.25s", window="15m") as pacer:
                    before = _salted(server, pacer, load.prompts, "before")
            with running_kvwatch(url, poll_interval="0.25s", window="15m") as kvwatch:
                runs[name] = _run_load(server, kvwatch, load.prompts)
                if name == "on":  # and after it, once kvwatch's figures are read
                    runs[name]["uncached"] = [before, _salted(server, kvwatch, load.prompts, "after")]
    figures = _saved_figures(load, runs["on"], runs["off"], report)
    kept = tmp_path_factory.mktemp("vllm-saved") / "requests.json"
    kept.write_text(json.dumps(figures))
    saved, truth, truth_off = figures["saved"], figures["truth"], figures["truth_off"]
    report(f"saved: each request's prefill seconds in {kept}; against the 15 % bar: "
           f"{100 * (saved - truth) / truth:+.1f} % of the same engine's difference, "
           f"{100 * (saved - truth_off) / truth_off:+.1f} % of the off-engine's")
    assert saved == pytest.approx(truth, rel=SAVED_BAR)


# ------------------------------------------------------------------ lost and needed


@pytest.fixture(scope="module")
def tier_engine(vllm_build, tmp_path_factory, report):
    """The tier's vLLM (128 blocks of 32 tokens) admitting 16 requests at once, its
    KV-cache events streamed to a kvwatch polling it (which binds the endpoint first)."""
    venv, model = vllm_build
    endpoint, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    with running_kvwatch(f"http://127.0.0.1:{port}/metrics", window="10m", kv_events=endpoint) as kvwatch:
        with vllm_server(port=port, model_dir=model, venv=venv, max_num_seqs=16, startup_timeout_s=STARTUP_S,
                         report=report, extra_args=events_config(endpoint),
                         log_path=tmp_path_factory.mktemp("vllm-lost") / "server.log") as server:
            yield server, kvwatch


@pytest.mark.timeout(600)
def test_lost_against_the_blocks_the_engine_stored_again(tier_engine, report):
    server, kvwatch = tier_engine
    before = wait_until_idle(server.metrics_url)
    # 16 requests of 400 + 400 tokens at once: 25 blocks each at their end, 400 against 127 usable.
    stats = burst_load(server.base_url, concurrency=16, duration=8.0, max_requests=16, seed=SEED).wait()
    after = wait_until_idle(server.metrics_url, timeout_s=300)
    time.sleep(3)  # the last events and a poll past the end
    worth = _worth(kvwatch.url)
    window = read_kvwatch_diagnosis(kvwatch.url)["kv_events"]["window"]

    def d(name: str) -> float:
        return after.value(name) - before.value(name)

    preemptions = d("vllm:num_preemptions_total")
    page_bound = preemptions * d("vllm:request_prompt_tokens_sum") / d("vllm:request_prompt_tokens_count")
    again = window["stored_again"] * BLOCK
    per_token, lost = worth["prefill_seconds_per_token"], worth["lost_seconds"]
    report(f"lost: {stats.completed} requests of 400 + 400 tokens at once on 127 blocks, {preemptions:.0f} "
           f"preemptions; the engine's events stored {again:.0f} tokens again ({window['stored_again']} blocks), "
           f"kvwatch says {lost:.3f} s ({worth['lost_basis']}) at {per_token * 1e6:.1f} us a token; the page's "
           f"bound, preemptions x the mean prompt: {page_bound:.0f} tokens, {page_bound * per_token:.3f} s "
           f"({100 * (page_bound - again) / again:+.1f} % of the stream's count)")
    assert stats.failed == 0, stats.errors
    assert preemptions > 0 and again > 0  # the burst did what it is for
    assert worth["lost_basis"] == "stream"
    assert lost == pytest.approx(again * per_token, rel=1e-9)
    # Without the stream kvwatch's lost is the page's bound: within 20 % of what the engine stored again
    # (-1.0 % and +12.5 % in the two runs of docs/capacity.md).
    assert page_bound == pytest.approx(again, rel=0.20)


# Needed: 16 requests of 448 + 128 tokens sent at once; 14 blocks each at
# admission, 18 at their end: the tier's 127 usable blocks admit 9.
NEEDED_PROMPT, NEEDED_OUTPUT, NEEDED_REQUESTS = 448, 128, 16


def _streamed_first_token(server, prompt: str, out: list[float]) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": NEEDED_OUTPUT, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(server.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                out.append(time.monotonic() - started)
                break
        for _ in response:  # the rest of the answer, read to its end
            pass


def _burst(server, seed: int, watch: list[Step] | None = None) -> float:
    """NEEDED_REQUESTS streamed requests at once; the first-token p95 the clients saw.
    With `watch`, the engine's running, waiting and KV usage every 0.25 s while they run."""
    rng = random.Random(seed)
    prompts = [prompt_text(NEEDED_PROMPT, rng) for _ in range(NEEDED_REQUESTS)]
    firsts: list[float] = []
    threads = [threading.Thread(target=_streamed_first_token, args=(server, p, firsts), daemon=True) for p in prompts]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 240
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        if watch is not None:
            m = read_metrics(server.metrics_url)
            watch.append(Step(time.time(), m.value("vllm:num_requests_running"), m.value("vllm:num_requests_waiting"),
                              1.0, m.value("vllm:kv_cache_usage_perc"), None))
        time.sleep(0.25)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert len(firsts) == NEEDED_REQUESTS, f"{NEEDED_REQUESTS - len(firsts)} requests got no first token"
    return sorted(firsts)[math.ceil(0.95 * len(firsts)) - 1]


@pytest.mark.timeout(900)  # the tier's engine, then two more start-ups at once
def test_needed_cache_meets_the_objective_and_half_of_it_does_not(tier_engine, vllm_build, tmp_path_factory, report):
    venv, model = vllm_build
    tier_engine, _ = tier_engine
    wait_until_idle(tier_engine.metrics_url)
    steps: list[Step] = []
    observed = _burst(tier_engine, SEED, steps)
    usable = read_metrics(tier_engine.metrics_url).labels("vllm:cache_config_info")
    shape = CacheShape(int(usable["num_gpu_blocks"]) - 1, BLOCK, TINY_MODEL_BLOCK_BYTES_PER_TOKEN * BLOCK, "tier")
    # The objective: half the p95 observed, where half the burst waited for the first half's answers (128
    # decode steps); all admitted at once, the first tokens wait for the prefills alone.
    objective = observed / 2
    result = needed(MODEL_NAME, steps, objective, shape)
    blocks = result["estimate"]["blocks_per_replica"]
    p95 = {}
    for label, count in (("needed", blocks), ("half", blocks // 2)):
        with vllm_server(model_dir=model, venv=venv, max_num_seqs=16, startup_timeout_s=STARTUP_S, report=report,
                         kv_cache_memory_bytes=count * BLOCK * TINY_MODEL_BLOCK_BYTES_PER_TOKEN,
                         log_path=tmp_path_factory.mktemp(f"vllm-{label}") / "server.log") as server:
            _burst_one(server, SEED + 2)  # first-use costs paid before the burst
            p95[label] = _burst(server, SEED + 3)
    report(f"needed: {NEEDED_REQUESTS} requests of {NEEDED_PROMPT} + {NEEDED_OUTPUT} tokens at once; first-token "
           f"p95 {observed:.2f} s on {shape.usable_blocks} blocks; objective "
           f"{objective:.2f} s; kvwatch: {result['answer']} At {blocks} blocks p95 {p95['needed']:.2f} s, at "
           f"{blocks // 2} blocks {p95['half']:.2f} s")
    assert observed > objective  # the burst missed the objective where it was observed
    assert p95["needed"] <= objective < p95["half"]


def _burst_one(server, seed: int) -> float:
    firsts: list[float] = []
    _streamed_first_token(server, prompt_text(NEEDED_PROMPT, random.Random(seed)), firsts)
    return firsts[0]
