"""The status page in headless Chromium: it renders, its script refreshes the
findings from /api/v1/* by itself, and the console stays silent (no errors, no
CSP violations, no failed loads). Against the simulator in the exhaustion,
prefix-change and slow-first-token phases and with four engines, at 1400 px
and 400 px: the banner names the expected cause, the highlighted figures are
the offending ones, nothing overflows sideways, and every trend chart holds
one point per window entry."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess

import pytest

from kvwatch.diagnose.arbitration import caused_by
from kvwatch.sidecar.app import create_app, readiness
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from pageserver import Answer, PageServer, serving

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0")


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium is not installed (make test installs it)")
    return path


def page(fixtures_dir, name: str) -> str:
    return (fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text()


class SwitchingMonitor:
    """Serves the first state once (the page's own render), then the second:
    what the browser shows in the end can only come from its script."""

    def __init__(self, first, second):
        self.settings = first.settings
        self._states = [first.state, second.state]
        self.after_poll = []  # the app hooks its render-ahead here; this monitor never polls

    @property
    def state(self):
        return self._states.pop(0) if len(self._states) > 1 else self._states[0]

    def ready(self):
        return True, "ok"


def polled(fixtures_dir, names, settings):
    with PageServer([Answer(page(fixtures_dir, n)) for n in names]) as server:
        settings.target = server.url
        monitor = Monitor(settings)
        for _ in names:
            monitor.poll_once()
    return monitor


def dump_dom(url: str, tmp_path) -> tuple[str, str]:
    result = subprocess.run(
        [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
         # Virtual time: 12 s of page time covers two 5 s refreshes without waiting for them.
         "--virtual-time-budget=12000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, result.stderr


def console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def test_page_refreshes_findings_live_without_console_errors(fixtures_dir, tmp_path):
    settings = load_settings(environ={})
    idle = polled(fixtures_dir, ["idle"], settings)
    burst = polled(fixtures_dir, ["idle", "prefix-load", "load"], settings)
    app = create_app(SwitchingMonitor(idle, burst), settings)
    with serving(app, lifespan="off", start_timeout_s=10) as kvwatch:
        dom, stderr = dump_dom(kvwatch.url + "/", tmp_path)

    assert console_lines(stderr) == []
    updates = int(re.search(r'data-updates="(\d+)"', dom).group(1))
    assert updates >= 1, "the page's script never refreshed from the API"
    assert "Live: refreshed" in dom
    # Rendered with no findings (idle), the page now shows the burst's finding.
    assert re.search(r'<section id="findings"><h2>Findings \([1-9]\d* active\)</h2>', dom)
    assert re.search(r'<div class="banner sev-warning" data-state="warning" data-symptom="exhaustion" '
                     r'data-cause="concurrency_beyond_capacity"', dom)
    card = re.search(r'<article class="card warning" data-symptom="exhaustion" '
                     r'data-cause="concurrency_beyond_capacity">(.*?)</article>', dom, re.S)
    assert card is not None
    assert re.search(r'data-evidence="waiting_at_peak">Waiting at peak<b>18</b>', card.group(1))
    assert "Now on tiny-llama / 0" in dom and "99.2%" in dom
    assert re.search(r'data-figure="kv_usage" data-state="bad"', dom)
    # The figures say which are the last poll's and which span the window (a window's p95
    # beside the trend's last 30 s point read as two answers to one question).
    assert re.search(r'<p class="muted span-note">KV usage, Headroom, Waiting: the last poll; Hit ratio, TTFT p95, '
                     r'Preempt/s: over the last \d+ s\.</p>', dom)
    # What the cache is worth, drawn by the script from /api/v1/signals (the idle render had none).
    worth = re.search(r'<section id="worth"><h2>What the cache is worth</h2>(.*?)</section>', dom, re.S)
    assert worth is not None and "<p>Saved: " in worth.group(1) and "the cost of that work, not a bill" in worth.group(1)


def test_central_modes_page_of_one_replica_refreshes_that_replica(tmp_path):
    """Central mode (kvwatch serve --prometheus) serves one replica's page at
    /?replica=NAME; its script must ask the API for the same replica (the
    API without it lists every replica, and /api/v1/series refuses)."""
    from kvwatch.central.refresh import Central
    from kvwatch.central.app import create_central_app
    from promstub import StubClient
    from sim_support import fleet_openmetrics
    from test_history_prometheus import fleet

    start, step = 1_700_002_800.0, 15
    settings = load_settings(overrides={"poll_interval": f"{step}s", "window": "2m"}, environ={})
    central = Central(StubClient(fleet_openmetrics(fleet()[:2], start, 240, step)), settings,
                      clock=lambda: start + 240)
    central.refresh_once()
    with serving(create_central_app(central, settings), lifespan="off", start_timeout_s=10) as kvwatch:
        dom, stderr = dump_dom(f"{kvwatch.url}/?replica=vllm%2F10.0.1.1%3A8000", tmp_path)
    assert console_lines(stderr) == []
    assert int(re.search(r'data-updates="(\d+)"', dom).group(1)) >= 1, "the page never refreshed from the API"
    assert "Live: refreshed" in dom and "vllm/10.0.1.1:8000" in dom
    # The exhaustion: its own card, or told inside the card of the late first tokens it causes.
    assert re.search(r'data-(cause|caused-by)="(exhaustion/)?concurrency_beyond_capacity"', dom)
    assert "every replica" in dom


def test_page_with_engine_down_renders_cleanly(tmp_path):
    settings = load_settings(overrides={"target": "http://127.0.0.1:9/metrics", "timeout": 0.5}, environ={})
    monitor = Monitor(settings)
    monitor.poll_once()  # refused
    with serving(create_app(monitor, settings), lifespan="off", start_timeout_s=10) as kvwatch:
        dom, stderr = dump_dom(kvwatch.url + "/", tmp_path)
    assert console_lines(stderr) == []
    assert 'data-state="down"' in dom
    # The sidecar's one sentence for the failure, as /readyz and the CLI print it.
    assert ("kvwatch cannot read the engine's metrics at http://127.0.0.1:9/metrics: connection refused by "
            "127.0.0.1:9: nothing listens there (engine down or starting?). No poll has succeeded yet.") in dom
    assert monitor.state.detail in dom and monitor.state.detail in readiness(monitor)[1]
    assert "No findings while the engine is not polled." in dom
    assert int(re.search(r'data-updates="(\d+)"', dom).group(1)) >= 1


# --------------------------------------------------------------------------
# Against the simulator, over the DevTools protocol
# --------------------------------------------------------------------------

FLEET = [("exhaustion", 0.0), ("prefix-change", 100.0), ("slow-prefill", 40.0), ("healthy", 0.0)]
FIGURES = ("kv_usage", "headroom", "hit_ratio", "ttft_p95", "waiting", "preemptions")

# (scenario, simulated seconds polled, banner cause, figures that must be
# highlighted, figures that must not be).
CASES = {
    # What users feel leads (causes.FELT_ORDER): late first tokens, queued for KV blocks, the
    # card naming the exhausted cache as their cause; the exhaustion card follows.
    "exhaustion": ("exhaustion", 230.0, "queueing_kv_bound",
                   {"kv_usage", "headroom", "waiting", "preemptions", "ttft_p95"}, set()),
    # The window's hit ratio (43 %) is above hit_ratio_low: the finding (the recent part fell
    # to 3 %) does not colour a value that is not bad by itself; the banner names it.
    "prefix-change": ("prefix-change", 330.0, "prefix_changed",
                      set(), {"kv_usage", "headroom", "waiting", "preemptions", "ttft_p95", "hit_ratio"}),
    "slow-first-token": ("slow-prefill", 270.0, "prefill",
                         {"ttft_p95"}, {"kv_usage", "headroom", "waiting", "preemptions"}),
    "four-engines": (FLEET, 230.0, "queueing_kv_bound",
                     {"kv_usage", "headroom", "waiting", "preemptions", "ttft_p95"}, set()),
}

PAGE_FACTS = """(() => ({
  overflow: document.documentElement.scrollWidth - window.innerWidth,
  banner: document.getElementById("banner").dataset.cause || document.getElementById("banner").dataset.state,
  bannerText: document.getElementById("banner").textContent,
  figures: Object.fromEntries(Array.from(document.querySelectorAll("#figures .fig"))
    .map(e => [e.dataset.figure, e.dataset.state])),
  charts: Array.from(document.querySelectorAll("#trends svg")).map(e => Number(e.dataset.points)),
  vertices: Math.max(0, ...Array.from(document.querySelectorAll("#trends polyline"))
    .map(e => e.getAttribute("points").split(" ").length)),
  marks: document.querySelectorAll("#trends line.mark").length,
  rows: Array.from(document.querySelectorAll("#engines tbody tr")).map(e => e.dataset.engine),
  selected: (document.querySelector("#figures h2") || {}).textContent,
  cards: document.querySelectorAll("#findings article.card").length,
  because: Array.from(document.querySelectorAll("#findings article.card .because")).map(e => e.dataset.causedBy),
}))()"""


@pytest.fixture(scope="module")
def browser():
    from browser import Browser, chromium_path

    if chromium_path() is None:
        pytest.skip("chromium is not installed (make test installs it)")
    with Browser() as running:
        yield running


@pytest.fixture(autouse=True)
def _pages_closed(request):
    yield
    if "browser" in request.fixturenames:
        request.getfixturevalue("browser").close_pages()


@pytest.fixture(scope="module")
def served():
    """Each case's monitor, polled once and served for the module (all started
    here, before any test: a server a test started would outlive it)."""
    from sim_support import sim_monitor

    running = {}
    with contextlib.ExitStack() as stack:
        for case, (scenario, until, *_rest) in CASES.items():
            monitor = sim_monitor(scenario, until)
            kvwatch = stack.enter_context(serving(create_app(monitor, monitor.settings), lifespan="off",
                                                  start_timeout_s=10))
            running[case] = (monitor, kvwatch.url + "/")
        yield running.__getitem__


def load(browser, url: str, width: int, dark: bool = False):
    page = browser.page(width, 900, dark)
    page.goto(url)
    page.wait_for("document.body.dataset.rendered === '1'")
    return page


@pytest.mark.parametrize("width", (1400, 400))
@pytest.mark.parametrize("case", list(CASES))
def test_console_reads_the_state_at_a_glance(browser, served, case, width):
    monitor, url = served(case)
    _, _, cause, offending, calm = CASES[case]
    page = load(browser, url, width, dark=width < 1000)
    facts = page.evaluate(PAGE_FACTS)

    assert page.messages() == []
    assert facts["banner"] == cause, facts["bannerText"]
    assert monitor.state.findings[0].cause == cause
    highlighted = {key for key, state in facts["figures"].items() if state in ("warn", "bad")}
    assert set(facts["figures"]) == set(FIGURES)
    assert offending <= highlighted, facts["figures"]
    assert not calm & highlighted, facts["figures"]
    assert facts["overflow"] <= 0, f"{facts['overflow']} px of horizontal overflow at {width} px"
    # Six charts, each with one point per entry the window holds.
    assert facts["charts"] == [len(monitor.state.entries)] * 6
    assert 2 < facts["vertices"] <= len(monitor.state.entries)
    assert facts["marks"] >= 1  # the active findings on the time axis
    # One card a story: a finding told as another's cause (arbitration.caused_by) is inside that card.
    told = caused_by(list(monitor.state.findings))
    assert facts["cards"] == len(monitor.state.findings) - len(told)
    assert facts["because"] == [f"{f.symptom}/{f.cause}" for f in (monitor.state.findings[i] for i in told.values())]


def test_four_engines_as_rows_worst_first_with_detail_on_click(browser, served):
    monitor, url = served("four-engines")
    page = load(browser, url, 1400)
    facts = page.evaluate(PAGE_FACTS)
    assert len(facts["rows"]) == 4
    # Critical (exhaustion) first, the healthy engine (info only) last.
    assert facts["rows"][0] == "tiny-llama / 0" and facts["rows"][-1] == "tiny-llama / 3"
    assert facts["selected"] == "Now on tiny-llama / 0"

    page.evaluate("""document.querySelector('#engines tr[data-engine="tiny-llama / 1"]').click()""")
    facts = page.evaluate(PAGE_FACTS)
    assert facts["selected"] == "Now on tiny-llama / 1"
    # Coloured by its own value against the diagnosis' threshold, whatever the finding.
    row = next(r for r in monitor.state.per_engine if r.engine == "1")
    from kvwatch.diagnose.thresholds import resolve_thresholds

    low = row.values["kvwatch_prefix_cache_hit_ratio"] < resolve_thresholds(monitor.settings.diagnosis).hit_ratio_low
    assert facts["figures"]["hit_ratio"] == ("warn" if low else "ok") and facts["figures"]["kv_usage"] == "ok"
    assert facts["charts"] == [len(monitor.state.entries)] * 6

    # Sorting by a column: highest hit ratio first, then the reverse.
    page.evaluate("""document.querySelector('#engines th[data-sort="hit_ratio"]').click()""")
    rows = page.evaluate(PAGE_FACTS)["rows"]
    ratios = {f"tiny-llama / {row.engine}": row.values["kvwatch_prefix_cache_hit_ratio"]
              for row in monitor.state.per_engine}
    # Engines with equal ratios (two engines without reuse read 0) may come in either order.
    assert sorted(rows) == sorted(ratios) and [ratios[r] for r in rows] == sorted(ratios.values(), reverse=True)
    page.evaluate("""document.querySelector('#engines th[data-sort="hit_ratio"]').click()""")
    assert [ratios[r] for r in page.evaluate(PAGE_FACTS)["rows"]] == sorted(ratios.values())
    assert page.messages() == []


def test_pinned_quantile_reads_as_a_bound(browser, served):
    monitor, url = served("exhaustion")
    page = load(browser, url, 1400)
    pinned = monitor.state.per_engine[0].pinned.get("kvwatch_time_to_first_token_seconds", {}).get("0.95")
    text = page.evaluate("document.querySelector('#figures .fig[data-figure=ttft_p95] .value').textContent")
    if pinned:
        assert text.startswith(pinned + " ")
    else:
        assert not text.startswith(("> ", "< "))


def test_findings_show_since_when_on_the_time_axis_and_their_runbook(browser, served):
    """The banner and each card say when the finding was first seen ("since
    HH:MM, N min ago", from `since` in /api/v1/diagnosis), its mark on the
    trend charts stands at that time, not at the latest poll, and its runbook
    section and prose notes show."""
    from kvwatch.sidecar.report import diagnosis_json

    monitor, url = served("exhaustion")
    findings = diagnosis_json(monitor.state, monitor.settings)["findings"]
    first = findings[0]
    assert first["since"] and first["runbook"] and "model" not in first
    page = load(browser, url, 1400)
    facts = page.evaluate("""(() => ({
      banner: document.querySelector("#banner .since").textContent,
      cards: Array.from(document.querySelectorAll("#findings article.card .since")).map(e => e.textContent),
      runbooks: Array.from(document.querySelectorAll("#findings article.card [data-runbook]"))
        .map(e => [e.dataset.runbook, e.textContent]),
      marks: Array.from(document.querySelectorAll("#trends svg:first-of-type line.mark[data-kind=finding]"))
        .map(e => Number(e.dataset.time)),
      notes: Array.from(document.querySelectorAll("#findings [data-note]")).map(e => e.dataset.note),
    }))()""")
    assert re.fullmatch(r"since \d\d:\d\d, \d+(\.\d)? (s|min|h) ago", facts["banner"]), facts["banner"]
    cards = [f for f in findings if not f.get("cause_of")]  # one told as another's cause is in its card
    assert len(facts["cards"]) == len(cards) and all(text.startswith("since ") for text in facts["cards"])
    # Each finding's runbook, a finding told as another's cause inside that card (before the card's own).
    assert sorted(r for r, _ in facts["runbooks"]) == sorted(f["runbook"] for f in findings if f["runbook"])
    assert all(text == "Runbook: " + r for r, text in facts["runbooks"])
    assert first["since"] in facts["marks"]
    assert first["since"] < monitor.state.snapshot.time  # first seen before the latest poll
    assert facts["notes"] == [key for f in findings for key in f["notes"]]
    assert page.messages() == []


def test_dark_signals_section_follows_the_api(fixtures_dir, tmp_path):
    """Rendered from a page with every family (no dark section), the page's
    script then draws the section from /api/v1/signals: a vLLM 0.32 capture
    without --kv-cache-metrics or an offload connector, its residency signals
    under that flag and the offload tier's named as missing families."""
    from kvwatch.sidecar.report import dark_signals
    from test_vllm_newer_families import residency

    settings = load_settings(environ={})
    everything = page(fixtures_dir, "after") + residency({1: 5}, {10: 5}) + offload_families(fixtures_dir)
    with PageServer([Answer(everything)]) as server:
        settings.target = server.url
        lit = Monitor(settings)
        lit.poll_once()
    assert lit.state.dark_signals == () and lit.state.up
    assert dark_signals(lit.state.snapshot, lit.state.engine, lit.state.dark_signals) == []
    plain = polled(fixtures_dir, ["idle", "load"], settings)
    expected = [d["signal"] for d in dark_signals(plain.state.snapshot, plain.state.engine, plain.state.dark_signals)]
    assert {"kvwatch_kv_cache_reuse_shortfall_blocks", "kvwatch_cache_tier_cost_ratio"} <= set(expected)
    app = create_app(SwitchingMonitor(lit, plain), settings)
    with serving(app, lifespan="off", start_timeout_s=10) as kvwatch:
        dom, stderr = dump_dom(kvwatch.url + "/", tmp_path)
    assert console_lines(stderr) == []
    assert int(re.search(r'data-updates="(\d+)"', dom).group(1)) >= 1
    section = re.search(r'<section id="dark">(.*?)</section>', dom, re.S)
    assert section is not None and f"Signals this engine leaves dark ({len(expected)})" in section.group(1)
    line = re.search(r'<li data-flag="--kv-cache-metrics"><code>--kv-cache-metrics</code> lights: (.*?)</li>',
                     section.group(1))
    assert line is not None, section.group(1)
    assert "KV blocks short of keeping reuse (blocks)</span>, <span" in line.group(1)


def offload_families(fixtures_dir) -> str:
    """The offload connector's families of the handwritten vLLM 0.32 offload
    page (tests/fixtures/README.md), which the capture lacks."""
    text = (fixtures_dir / "handwritten" / "vllm-0.32-offload-b.txt").read_text()
    blocks = re.split(r"(?m)^(?=# HELP )", text)
    return "".join(block for block in blocks
                   if block.startswith(("# HELP vllm:kv_offload_", "# HELP vllm:num_requests_kv_fetch")))


def test_a_finished_replay_reads_as_one_and_calm_figures_stay_calm(browser, fixtures_dir):
    """`serve --replay` of the concurrency capture looked live ("up · last
    poll 06:21:25 · refreshes every 5 s") and showed KV usage 0.0 %, its
    headroom and "Waiting 0" red under the exhaustion finding left in the
    window: the page marks the finished replay with its recorded time, and
    only figures whose own value is bad take the finding's colour."""
    from kvwatch.capture.bundle import Capture
    from kvwatch.commands.serve import replaying

    capture = Capture(fixtures_dir / "vllm-0.32-cpu-scenarios" / "concurrency" / "capture.tar.gz")
    settings = load_settings(overrides={"target": capture.manifest["target"],
                                        "poll_interval": capture.manifest["interval_seconds"]}, environ={})
    monitor, start = replaying(capture, settings, speed=0)
    start()
    monitor._thread.join(30)
    assert monitor.state.replay["finished"]
    with serving(create_app(monitor, settings), lifespan="off", start_timeout_s=10) as kvwatch:
        page = load(browser, kvwatch.url + "/", 1400)
        facts = page.evaluate("""(() => ({
          replay: (document.querySelector("#status [data-replay]") || {dataset: {}}).dataset.replay,
          status: document.getElementById("status").textContent,
          live: document.getElementById("live").textContent,
          figures: Object.fromEntries(Array.from(document.querySelectorAll("#figures .fig"))
            .map(e => [e.dataset.figure, [e.dataset.state, e.querySelector(".value").textContent]])),
          next: (document.querySelector("#banner > p:last-of-type") || {}).textContent,
        }))()""")
        assert page.messages() == []
    assert facts["replay"] == "finished" and "recorded time" in facts["status"] and "last poll" not in facts["status"]
    assert facts["live"].startswith("Replay ended") and "refreshes every" not in facts["live"]
    values = {key: value for key, (_, value) in facts["figures"].items()}
    states = {key: state for key, (state, _) in facts["figures"].items()}
    assert any(f.symptom == "exhaustion" for f in monitor.state.findings)
    if values["kv_usage"] == "0.0%":
        assert states["kv_usage"] == states["headroom"] == "ok", facts["figures"]
    if values["waiting"] == "0":
        assert states["waiting"] == "ok", facts["figures"]
    from kvwatch.diagnose.vocabulary import NEXT_ACTION

    assert facts["next"] == "Next: " + NEXT_ACTION[monitor.state.findings[0].cause]


def test_the_banner_shows_the_worst_active_finding_and_clearing_ones_are_muted_below(browser):
    """One story: a critical finding held while clearing never
    leads the banner over an active one; it is drawn muted below the active
    cards; a finding's contributing factors and alternatives show on its card."""
    from dataclasses import replace as with_

    from kvwatch.diagnose import Finding
    from kvwatch.diagnose.arbitration import alternative
    from kvwatch.diagnose.hold import FindingHold
    from sim_support import sim_monitor

    monitor = sim_monitor("healthy", 30.0)
    hold = FindingHold(60.0)
    now = monitor.state.last_poll_time
    # Found 20 s ago and clear since 18 s ago: past its symptom's quiet (a shorter lapse still shows
    # active), within the hold.
    hold.apply(now - 20, [Finding("exhaustion", "long_requests", "critical", "high", "tiny-llama", "0", "full earlier")])
    hold.apply(now - 18, [])
    found = hold.apply(now, [
        Finding("low_hit_rate", "prefix_changed", "warning", "low", "tiny-llama", "0", "prefix or eviction",
                {"hit_ratio": 0.1}, "diff the templates",
                alternatives=(alternative("eviction_before_reuse", ("kv_cache_metrics", "kv_events")),)),
        Finding("slow_first_token", "queueing_kv_bound", "warning", "medium", "tiny-llama", "0", "queue",
                {"ttft_p95_seconds": 28.0, "queue_share": 0.6, "window_seconds": 60}, "shorten it"),
        Finding("slow_first_token", "preemption", "warning", "medium", "tiny-llama", "0", "preempted",
                {"other_share": 0.3}, "relieve the cache")])
    # Late first tokens lead what costs compute (causes.FELT_ORDER); the held critical stays below.
    assert [f.cause for f in found] == ["queueing_kv_bound", "prefix_changed", "long_requests"]
    monitor.state = with_(monitor.state, findings=found)
    with serving(create_app(monitor, monitor.settings), lifespan="off", start_timeout_s=10) as kvwatch:
        page = load(browser, kvwatch.url + "/", 1400)
        facts = page.evaluate("""(() => ({
          banner: [document.getElementById("banner").dataset.cause, document.getElementById("banner").dataset.clearing || ""],
          cards: Array.from(document.querySelectorAll("#findings article.card"))
            .map(e => [e.dataset.cause, e.classList.contains("clearing")]),
          contributors: Array.from(document.querySelectorAll("#findings [data-contributor]")).map(e => e.dataset.contributor),
          alternatives: Array.from(document.querySelectorAll("#findings [data-alternative]")).map(e => e.textContent),
          spans: Array.from(document.querySelectorAll("#findings article.card [data-span]")).map(e => e.textContent),
          prefixHead: document.querySelector('#findings article.card[data-cause="prefix_changed"] h3').textContent,
        }))()""")
        messages = page.messages()
    assert facts["banner"] == ["queueing_kv_bound", ""], facts
    # The headline names what it cannot tell its cause from.
    assert facts["prefixHead"].endswith("the prompt prefix changed, or prefixes are evicted before they are reused")
    assert facts["cards"] == [["queueing_kv_bound", False], ["prefix_changed", False], ["long_requests", True]]
    assert facts["contributors"] == ["preemption"]
    assert len(facts["alternatives"]) == 1 and "KV-cache event stream" in facts["alternatives"][0]
    # The card's numbers say their span (the trends end on shorter ones).
    assert facts["spans"] == ["over the last 60 s"], facts["spans"]
    assert messages == []


def test_the_script_marks_a_figure_its_engines_version_counts_differently(fixtures_dir, tmp_path):
    """Rendered from a vLLM 0.32 page (no caveat), the script then draws the
    state of a replayed vLLM 0.10.2 burst: the hit-ratio and preemption
    figures say they are counted differently, and why, below the figures."""
    from kvwatch.capture.bundle import Capture
    from kvwatch.capture.replay import replay
    from kvwatch.engines.vllm import LATE_PREEMPTIONS, RELOOKUPS

    settings = load_settings(environ={})
    plain = polled(fixtures_dir, ["idle", "load"], settings)
    replay_settings = load_settings(overrides={"poll_interval": "1s", "window": "600s"}, environ={})
    monitors = []
    replay(Capture(fixtures_dir / "vllm-0.10.2-cpu" / "load.tar.gz"),
           lambda source: monitors.append(Monitor(replay_settings, fetcher=source, clock=source.now)) or monitors[0])
    app = create_app(SwitchingMonitor(plain, monitors[0]), settings)
    with serving(app, lifespan="off", start_timeout_s=10) as kvwatch:
        dom, stderr = dump_dom(kvwatch.url + "/", tmp_path)
    assert console_lines(stderr) == []
    figures = re.search(r'<section id="figures">(.*?)</section>', dom, re.S).group(1)
    assert 'data-figure="hit_ratio" data-state=' in figures
    assert re.search(r'data-figure="hit_ratio"[^>]*data-caveat="kvwatch_prefix_cache_hit_ratio"', figures)
    assert re.search(r'data-figure="preemptions"[^>]*data-caveat="kvwatch_preemptions_per_second"', figures)
    notes = re.findall(r'<p class="note caveat" data-caveat="([a-z_]+)"><b>[^<]*</b>([^<]*)</p>', figures)
    assert dict(notes)["kvwatch_prefix_cache_hit_ratio"].startswith("the window's lookups")
    assert RELOOKUPS in dict(notes)["kvwatch_prefix_cache_hit_ratio"]
    assert dict(notes)["kvwatch_preemptions_per_second"] == LATE_PREEMPTIONS


def test_first_tokens_late_because_the_cache_is_exhausted_read_as_one_card(browser):
    """The exhaustion that is the named cause of late first tokens is told
    inside their card (its headline, words and next action), in the banner
    too, not as a second card; another engine's exhaustion keeps its own."""
    from dataclasses import replace as with_

    from kvwatch.diagnose import Finding
    from sim_support import sim_monitor

    monitor = sim_monitor("healthy", 30.0)
    monitor.state = with_(monitor.state, findings=[
        Finding("slow_first_token", "preemption", "warning", "medium", "tiny-llama", "0", "preempted", {}, "relieve"),
        Finding("exhaustion", "concurrency_beyond_capacity", "critical", "high", "tiny-llama", "0", "full now", {},
                "cap it"),
        Finding("exhaustion", "long_requests", "warning", "high", "tiny-llama", "1", "a few long", {}, "cap")])
    with serving(create_app(monitor, monitor.settings), lifespan="off", start_timeout_s=10) as kvwatch:
        page = load(browser, kvwatch.url + "/", 1400)
        facts = page.evaluate("""(() => ({
          cards: Array.from(document.querySelectorAll("#findings article.card")).map(e => e.dataset.cause),
          because: Array.from(document.querySelectorAll("#findings article.card .because"))
            .map(e => [e.closest("article").dataset.cause, e.dataset.causedBy, e.textContent]),
          banner: Array.from(document.querySelectorAll("#banner .because")).map(e => e.dataset.causedBy),
          bannerText: document.getElementById("banner").textContent,
        }))()""")
        messages = page.messages()
    assert facts["cards"] == ["preemption", "long_requests"], facts
    assert [b[:2] for b in facts["because"]] == [["preemption", "exhaustion/concurrency_beyond_capacity"]]
    assert "KV cache exhausted" in facts["because"][0][2] and "full now" in facts["because"][0][2]
    assert facts["banner"] == ["exhaustion/concurrency_beyond_capacity"]
    assert "1 more finding below" in facts["bannerText"], facts["bannerText"]
    assert messages == []
