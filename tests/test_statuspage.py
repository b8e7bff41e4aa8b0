"""The status page as HTML: findings and signals rendered server-side,
nothing from outside, nothing secret, nothing from the engine as markup."""

from __future__ import annotations

import base64
from dataclasses import asdict
import json
import hashlib
import re

from fastapi.testclient import TestClient

from kvwatch.sidecar.app import create_app
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from kvwatch.present import format_value
from kvwatch.sidecar.statuspage import CONTENT_SECURITY_POLICY, SCRIPT, STYLE, render_status_page
from pageserver import Answer, PageServer


def page(fixtures_dir, name: str) -> str:
    return (fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text()


def polled(pages: list[str], target_prefix: str = "http://"):
    with PageServer([Answer(text) for text in pages]) as server:
        settings = load_settings(overrides={"target": server.url.replace("http://", target_prefix)}, environ={})
        monitor = Monitor(settings)
        for _ in pages:
            monitor.poll_once()
    return monitor, settings


def test_findings_and_signals_rendered(fixtures_dir):
    monitor, settings = polled([page(fixtures_dir, n) for n in ("idle", "prefix-load", "load")])
    html = render_status_page(monitor.state, settings)
    assert re.search(r"Findings \(\d+ active\)", html) and "Findings (0 active)" not in html
    assert 'data-symptom="exhaustion" data-cause="concurrency_beyond_capacity"' in html
    # The evidence rides in the state the script draws; the no-JS fallback
    # leaves it to /api/v1/diagnosis (a fifth of the page at 8 engines).
    assert '"waiting_at_peak":18' in html and "waiting_at_peak=18" not in html
    assert "<th>tiny-llama / 0</th>" in html
    assert "99.2%" in html and "4,096" in html
    for link in ('href="metrics"', 'href="api/v1/signals"', 'href="api/v1/diagnosis"'):
        assert link in html


def test_no_credentials_on_the_page(fixtures_dir):
    monitor, settings = polled([page(fixtures_dir, "idle")], "http://admin:hunter2@")
    html = render_status_page(monitor.state, settings)
    assert "hunter2" not in html and "admin" not in html
    assert "127.0.0.1" in html


def test_engine_text_is_escaped(fixtures_dir):
    hostile = page(fixtures_dir, "load").replace('model_name="tiny-llama"', 'model_name="<img src=x onerror=alert(1)>"')
    monitor, settings = polled([page(fixtures_dir, "idle").replace('model_name="tiny-llama"',
                                                                   'model_name="<img src=x onerror=alert(1)>"'), hostile])
    html = render_status_page(monitor.state, settings)
    assert monitor.state.findings  # the hostile model has a finding to show
    assert "<img src=x" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html


def test_no_external_assets():
    html = render_status_page(_down_state(), load_settings(overrides={"target": "http://10.0.0.5:8000"}, environ={}))
    urls = re.findall(r'(?:href|src)="([^"]*)"', html)
    assert urls and all(not re.match(r"^(https?:)?//", url) for url in urls), urls
    assert "@import" not in html and "url(" not in html
    assert "cdn" not in html.lower()


def test_csp_allows_exactly_the_inline_script_and_style():
    html = render_status_page(_down_state(), load_settings(environ={}))

    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    assert f"<script>{SCRIPT}</script>" in html and f"<style>{STYLE}</style>" in html
    assert f"script-src {digest(SCRIPT)};" in CONTENT_SECURITY_POLICY
    assert f"style-src {digest(STYLE)};" in CONTENT_SECURITY_POLICY
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY
    # No inline event handlers or style attributes, which those hashes would not allow.
    assert not re.search(r"\son[a-z]+=", html) and ' style="' not in html


def test_down_state_says_why():
    html = render_status_page(_down_state(), load_settings(environ={}))
    assert "down: refused connection refused" in html
    assert "No findings while the engine is not polled." in html


def test_served_at_root(fixtures_dir):
    monitor, settings = polled([page(fixtures_dir, "idle")])
    response = TestClient(create_app(monitor, settings)).get("/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert "Findings (0 active)" in response.text


def test_format_value():
    assert format_value(0.9921, "ratio") == "99.2%"
    assert format_value(0.0283, "seconds") == "28.3 ms"
    assert format_value(9.7e-06, "seconds") == "9.7 µs"
    assert format_value(3.875, "seconds") == "3.88 s"
    assert format_value(4096.0, "tokens") == "4,096"
    assert format_value({"0.5": 0.03, "0.95": 0.064}, "seconds") == "p50 30 ms, p95 64 ms"
    assert format_value(None, "ratio") == "–"
    # Pinned quantiles read as bounds, from the JSON's `pinned`.
    assert format_value({"0.5": 0.3, "0.95": 80.0}, "seconds", {"0.5": "<", "0.95": ">"}) == "p50 < 300 ms, p95 > 80.00 s"
    assert format_value(0.3, "seconds", "<") == "< 300 ms"


def test_format_value_never_writes_an_exponent():
    # `kvwatch diagnose` printed "Prompt tokens 3.04e+03/s" where the page's script writes 3040/s.
    assert format_value(3040.2, "per_second") == "3040/s"
    assert format_value(355.4, "per_second") == "355/s"
    assert format_value(0.0123, "per_second") == "0.0123/s"
    assert format_value(0.9996, "seconds") == "1000 ms"
    assert format_value(123456.7, "") == "123000"
    # Bytes in thousands, as tokens are ("KV cache in use (bytes) 13940013" beside "16,384" tokens).
    assert format_value(13940013.0, "bytes") == "13,940,013"


def test_a_full_window_reads_as_the_span_it_covers_not_more_than_set():
    # The header read "window 62 of 60 s" once the window was full.
    from kvwatch.sidecar.statuspage import window_text

    assert window_text({"window_covered_seconds": 62.0, "window_seconds": 60.0}) == "62 s"
    assert window_text({"window_covered_seconds": 60.2, "window_seconds": 60.0}) == "60 s"
    assert window_text({"window_covered_seconds": 22.4, "window_seconds": 60.0}) == "22 of 60 s"
    assert window_text({"window_covered_seconds": None, "window_seconds": 300.0}) == "0 of 300 s"
    assert "function windowText(signals)" in SCRIPT and 'covered + " of " + set + " s" : covered + " s"' in SCRIPT


def _down_state():
    from kvwatch.pipeline.monitor import State

    return State(up=False, reason="refused", detail="connection refused", polls=3)


def test_series_hold_one_point_per_window_entry_and_thresholds_come_with_the_state():
    from sim_support import sim_monitor

    from kvwatch.diagnose.thresholds import DEFAULT_THRESHOLDS
    from kvwatch.sidecar.statuspage import FIGURES, TRENDS

    # 160 s: the cache's first fill reads as a few long requests, and the load shape that follows
    # (concurrency) replaces it only once it has led for the exhaustion's lead (causes.Symptom).
    monitor = sim_monitor("exhaustion", 160.0, thresholds={"max_num_seqs": 32, "ttft_p95_seconds": 3.0})
    client = TestClient(create_app(monitor, monitor.settings))
    series = client.get("/api/v1/series").json()
    entries = len(monitor.state.entries)
    assert entries > 20 and len(series["times"]) == entries
    row = series["engines"][0]
    for name in ("kv_usage", "waiting", "hit_ratio", "ttft_p95", "queue_share", "prefill_share", "other_share",
                 "preemptions_per_second"):
        assert len(row[name]) == entries, name
    assert row["kv_usage"][-1] == round(monitor.state.per_engine[0].values["kvwatch_kv_cache_usage_ratio"], 4)
    assert max(row["preemptions_per_second"][1:]) > 0
    assert any(m["kind"] == "finding" and m["cause"] == "concurrency_beyond_capacity" for m in series["markers"])
    # The page colours by the thresholds in force, sent with the state, by name.
    thresholds = client.get("/api/v1/signals").json()["thresholds"]
    assert thresholds["ttft_p95_seconds"] == 3.0 and thresholds["exhaustion_usage_ratio"] == 0.9
    named = [rule["threshold"] for f in FIGURES for rule in f["rules"] if "threshold" in rule]
    named += [t["threshold"] for t in TRENDS if "threshold" in t]
    assert named and set(named) <= set(asdict(DEFAULT_THRESHOLDS))
    assert client.get("/", headers={"Accept-Encoding": "gzip"}).headers["content-encoding"] == "gzip"


def test_every_signal_has_a_human_label():
    from kvwatch.signals import SIGNALS
    from kvwatch.present import signal_label

    labels = [signal.display for signal in SIGNALS]
    assert all(labels) and len(set(labels)) == len(labels)
    assert signal_label("kvwatch_kv_cache_capacity_tokens") == "KV cache capacity (tokens)"
    assert signal_label("kvwatch_kv_cache_usage_ratio") == "KV cache usage"


# --- the signals the engine's flags leave dark ------------------------------------


def _dark_section(html: str) -> str:
    found = re.search(r'<section id="dark">(.*?)</section>', html, re.S)
    assert found is not None
    return found.group(1)


def test_vllm_without_kv_cache_metrics_names_the_flag_that_lights_residency(fixtures_dir):
    # A real vLLM 0.32 capture, served without --kv-cache-metrics: the residency
    # signals are dark, grouped on one line under the flag that lights them.
    monitor, settings = polled([page(fixtures_dir, n) for n in ("idle", "load")])
    section = _dark_section(render_status_page(monitor.state, settings))
    assert "Signals this engine leaves dark" in section and "<details>" in section
    line = re.search(r'<li data-flag="--kv-cache-metrics"><code>--kv-cache-metrics</code> lights: (.*?)</li>', section)
    assert line is not None, section
    assert "KV blocks short of keeping reuse (blocks)" in line.group(1)  # the catalogue's title, not the name
    assert "KV bytes short of keeping reuse (bytes)" in line.group(1)
    assert ">kvwatch_kv_cache_reuse_shortfall_blocks<" not in section
    assert "OffloadingConnector</code> lights: " in section
    # Lit signals are not listed.
    assert "KV cache usage" not in section and "Prompt tokens served from a cache" not in section


def test_an_engine_that_does_not_export_the_inputs_says_so(fixtures_dir):
    llamacpp = (fixtures_dir / "handwritten" / "llamacpp-2026-a.txt").read_text()
    monitor, settings = polled([llamacpp])
    assert monitor.state.engine == "llamacpp"
    section = _dark_section(render_status_page(monitor.state, settings))
    line = re.search(r'<li data-flag="">No flag lights these \(llama.cpp does not export what it is computed '
                     r'from\): (.*?)</li>', section)
    assert line is not None, section
    assert "Time to first token, mean" in line.group(1) and "KV cache capacity (tokens)" in line.group(1)
    assert "--kv-cache-metrics" not in section  # the engine's own reason, not vLLM's flag


def test_a_page_with_everything_has_no_dark_section(fixtures_dir):
    from test_vllm_newer_families import OFFLOAD_NEW, residency
    from test_vllm_offload_tier import offload_lines

    everything = page(fixtures_dir, "after") + residency({1: 5}, {10: 5}) + OFFLOAD_NEW + offload_lines(fixtures_dir)
    monitor, settings = polled([everything, everything])
    html = render_status_page(monitor.state, settings)
    assert _dark_section(html) == "" and "leaves dark" not in html.split("<script")[0]


def test_the_script_groups_dark_signals_as_the_server_does(fixtures_dir):
    """The section is drawn twice (server-side, then by the script on each
    refresh): both group the API's dark_signals the same way, one group per
    flag and one per reason where no flag lights them."""
    from kvwatch.sidecar.report import signals_json
    from kvwatch.sidecar.statuspage import dark_groups

    monitor, settings = polled([page(fixtures_dir, "load")])

    dark = signals_json(monitor.state, settings)["dark_signals"] + [
        {"signal": "kvwatch_engine_sleeping", "missing_families": [], "lit_by": None, "why": "not exported"},
        {"signal": "kvwatch_kv_cache_used_blocks", "missing_families": [], "lit_by": ["--a", "--b"], "why": "gated"},
        {"signal": "kvwatch_kv_cache_free_blocks", "missing_families": [], "lit_by": ["--kv-cache-metrics"],
         "why": "config-gated: start the engine with --kv-cache-metrics"}]
    server = [[flags, why, [i["signal"] for i in items]] for flags, why, items in dark_groups(dark)]
    assert server[0] == ["--kv-cache-metrics", "", ["kvwatch_kv_cache_reuse_shortfall_blocks",
                                                    "kvwatch_kv_cache_reuse_shortfall_bytes",
                                                    "kvwatch_kv_cache_free_blocks"]]
    assert ["--a and --b", "", ["kvwatch_kv_cache_used_blocks"]] in server
    assert [None, "not exported", ["kvwatch_engine_sleeping"]] in server
    script = run_script(["darkGroups"], f"darkGroups({json.dumps(dark)}).map(function (g) {{ return "
                                        "[g.flags, g.why, g.items.map(function (i) { return i.signal; })]; })")
    assert script == server
    assert "renderDark(signals);" in script_function("render")


# --------------------------------------------------------------------------
# The page's script, run in node: its functions taken out of SCRIPT by name.
# --------------------------------------------------------------------------


def script_function(name: str) -> str:
    """The source of `function name(...) {...}` in the page's script."""
    start = SCRIPT.index(f"function {name}(")
    depth, i = 0, SCRIPT.index("{", start)
    while True:
        depth += {"{": 1, "}": -1}.get(SCRIPT[i], 0)
        i += 1
        if depth == 0:
            return SCRIPT[start:i]


def run_script(functions: list[str], expression: str, prelude: str = "") -> object:
    """`expression`'s value (JSON) with the named functions of the script and
    its meta in scope (node comes with `make system-deps`)."""
    import json
    import shutil
    import subprocess

    from kvwatch.sidecar.statuspage import page_meta

    node = shutil.which("node")
    assert node, "node is not installed: `make system-deps` installs the Debian package nodejs"
    constants = "\n".join(re.search(rf"var {name} = [^;]+;", SCRIPT).group(0) for name in ("STATE_RANK",))
    source = (f"var meta = {json.dumps(page_meta())};\n{constants}\n{prelude}\n"
              + "\n".join(script_function(name) for name in functions)
              + f"\nprocess.stdout.write(JSON.stringify({expression}));\n")
    result = subprocess.run([node, "-e", source], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_finding_colours_only_figures_whose_own_value_is_bad():
    """An exhaustion finding left over in the window (the replayed
    concurrency capture after its burst) must not turn "KV usage 0.0%",
    its headroom or "Waiting 0" red: only figures past their own threshold
    take the finding's colour."""
    import json

    from kvwatch.diagnose.thresholds import DEFAULT_THRESHOLDS

    row = {"model_name": "m", "engine": "0", "pinned": {}, "signals": {
        "kvwatch_kv_cache_usage_ratio": 0.0, "kvwatch_kv_cache_free_tokens": 4096,
        "kvwatch_prefix_cache_hit_ratio": 0.5, "kvwatch_time_to_first_token_seconds": {"0.95": 0.1},
        "kvwatch_requests_waiting": 0, "kvwatch_preemptions_per_second": 0.2}}
    finding = {"symptom": "exhaustion", "severity": "critical", "model_name": "m", "engine": "0"}
    functions = ["figureValue", "compare", "figureStates"]
    calm = run_script(functions, f"figureStates({json.dumps(row)}, [{json.dumps(finding)}], "
                                 f"{json.dumps(asdict(DEFAULT_THRESHOLDS))})")
    assert calm == {"kv_usage": "ok", "headroom": "ok", "hit_ratio": "ok", "ttft_p95": "ok",
                    "waiting": "ok", "preemptions": "bad"}
    row["signals"].update(kvwatch_kv_cache_usage_ratio=0.95, kvwatch_requests_waiting=3)
    full = run_script(functions, f"figureStates({json.dumps(row)}, [{json.dumps(finding)}], "
                                 f"{json.dumps(asdict(DEFAULT_THRESHOLDS))})")
    # Waiting's own rule says warn; the critical finding deepens it to bad.
    assert full["kv_usage"] == full["headroom"] == full["waiting"] == "bad"


def test_every_cause_has_a_short_action_for_the_banner():
    """The banner's "Next:" cut NEXT_CHECK at its first '.', ';' or ':' and
    read "Expected after a restart." for cold_cache: each cause now declares
    its action once, an instruction that starts with a verb."""
    from kvwatch.diagnose.vocabulary import CAUSES, NEXT_ACTION, NEXT_CHECK
    from kvwatch.sidecar.statuspage import page_meta

    causes = {cause for listed in CAUSES.values() for cause in listed}
    assert set(NEXT_ACTION) == causes and page_meta()["actions"] == NEXT_ACTION
    for cause, action in NEXT_ACTION.items():
        first = action.split()[0].rstrip(",:")
        cut = re.match(r"^(.*?[.;:])(\s|$)", NEXT_CHECK[cause])
        assert action.endswith(".") and len(action) <= 110, cause
        assert cut is None or action != cut.group(1).rstrip(";:") + ".", cause
        # An instruction: a capitalised bare verb, not a statement ("Expected ...", "The queue ...").
        assert first[0].isupper() and not first.endswith(("ed", "s")) and first not in ("The", "A", "An", "If", "Nothing", "Time", "Most"), (cause, first)
    assert "meta.actions[f.cause]" in SCRIPT


def test_the_page_says_why_in_the_sidecars_one_failure_sentence():
    """The banner said "the connection was refused (is the engine running…)"
    while /readyz and the CLI said "connection refused by …: nothing listens
    there": the page now prints the state's `detail`, the one sentence."""
    import json

    from kvwatch.scrape import failure_sentence

    signals = {"up": False, "reason": "refused", "detail": failure_sentence("refused", "h:1"),
               "target": "http://h:1/metrics", "last_success_time": None}
    text = run_script(["clock", "downSentence"], f"downSentence({json.dumps(signals)})")
    assert text == ("kvwatch cannot read the engine's metrics at http://h:1/metrics: connection refused by h:1: "
                    "nothing listens there (engine down or starting?). No poll has succeeded yet.")


FORMAT_CASES = [
    (value, unit)
    for unit in ("ratio", "seconds", "tokens", "bytes", "per_second", "requests", "")
    for value in (0, 0.0, 1, 0.5, 0.9996, 0.99949, 1.005, 1.234, 12.5, 3040.4, 0.0123, 0.00049999, 1e-5, 2.5e-7,
                  -0.002, 123456.7, 4096, 1e9 + 0.5, None, "text")
] + [({"0.5": 0.1, "0.95": 2.5, "0.99": None}, "seconds"), ({}, "seconds"), ({"0.9": 0.25}, "ratio")]


def test_the_script_formats_numbers_as_python_does():
    """Numbers are formatted twice, here for the CLI and the <noscript>
    summary and in the page's script: both must write every value alike."""
    import json

    from kvwatch.present import format_value

    expected = [format_value(value, unit) for value, unit in FORMAT_CASES]
    written = run_script(["labelKey", "three", "fmt"], f"{json.dumps(FORMAT_CASES)}.map(function (c) {{ return fmt(c[0], c[1]); }})")
    differ = [(case, py, js) for case, py, js in zip(FORMAT_CASES, expected, written) if py != js]
    assert not differ, "\n".join(map(repr, differ))


def test_no_two_signals_read_alike():
    """"Prompt tokens from cache" and "Prompt tokens served from a cache"
    sat side by side in the CLI: the share of all prompt tokens and the same
    share by tier. Labels that differ only in small words must say how."""
    from kvwatch.signals import SIGNALS

    def gist(label: str) -> str:
        words = re.findall(r"[a-z0-9]+", label.lower())
        return " ".join(w for w in words if w not in ("a", "an", "the", "served", "of", "in"))

    seen: dict[str, str] = {}
    for signal in SIGNALS:
        label = signal_label_of(signal.name)
        assert gist(label) not in seen, (label, seen.get(gist(label)))
        seen[gist(label)] = label


def signal_label_of(name: str) -> str:
    from kvwatch.present import signal_label

    return signal_label(name)


def test_a_held_finding_reads_clearing_with_when_it_ends():
    """A finding inside its hold (diagnosis: finding_hold_seconds) says it is
    clearing and when it ends unless its condition returns; an active one
    does not."""
    functions = ["clock", "minutes", "span", "fmt", "bounded", "evidenceUnit", "evidenceLabel", "evidenceText",
                 "endedText", "sinceText"]
    now = 1_700_000_000.0
    held = {"since": now - 600, "clearing_since": now - 20}
    text = run_script(functions, f"sinceText({held}, {now}, 60)".replace("'", '"'), prelude="process.env.TZ='UTC';")
    assert "clearing: ended at 22:13:00" in text and "gone at 22:14:00 unless it returns" in text
    active = run_script(functions, f'sinceText({{"since": {now - 600}}}, {now}, 60)')
    assert "clearing" not in active


def test_a_finding_whose_condition_stopped_says_ended_at_with_its_peak():
    """Issue 55: a finding whose condition stopped says "ended at" with its
    peak, the figure that leads its card (the cause's first deciding figure,
    as last seen), on the page's script and the page without it alike."""
    from kvwatch.sidecar.statuspage import _findings_html

    functions = ["clock", "minutes", "span", "fmt", "bounded", "evidenceUnit", "evidenceLabel", "evidenceText",
                 "endedText", "sinceText"]
    now = 1_700_000_000.0
    held = {"since": now - 600, "clearing_since": now - 20, "cause": "concurrency_beyond_capacity",
            "evidence": {"kv_usage_max": 0.969, "preemptions": 12}}
    text = run_script(functions, f"sinceText({held}, {now}, 60)".replace("'", '"'), prelude="process.env.TZ='UTC';")
    assert "ended at 22:13:00, peak KV usage max 96.9%" in text, text
    finding = {"model_name": "m", "engine": "0", "symptom": "exhaustion", "cause": "concurrency_beyond_capacity",
               "severity": "critical", "confidence": "high", "summary": "s", "next_check": "n",
               "evidence": held["evidence"], "since": now - 600, "clearing_since": now - 20}
    page = _findings_html({"findings": [finding], "up": True})
    assert "ended at" in page and "peak KV usage max 96.9%" in page, page


def test_the_noscript_page_says_a_finding_is_clearing():
    from kvwatch.sidecar.statuspage import _findings_html

    finding = {"model_name": "m", "engine": "0", "symptom": "slow_first_token", "cause": "queueing_kv_bound",
               "severity": "warning", "confidence": "medium", "summary": "s", "next_check": "n", "evidence": {},
               "since": 1_700_000_000.0, "clearing_since": 1_700_000_100.0}
    assert "clearing" in _findings_html({"findings": [finding], "up": True})
    assert "clearing" not in _findings_html({"findings": [{**finding, "clearing_since": None}], "up": True})


def test_a_finding_the_event_stream_decided_says_so_in_its_headline():
    """At one minute into the demo, 'prefixes are evicted before they are
    reused' stood beside a green 47 % hit-ratio card, decided by the KV-cache
    event stream without the page saying so. The banner, the card, the
    noscript page and `kvwatch diagnose` say what decided it."""
    from kvwatch.sidecar.statuspage import _findings_html

    finding = {"model_name": "m", "engine": "0", "symptom": "low_hit_rate", "cause": "eviction_before_reuse",
               "severity": "warning", "confidence": "high", "summary": "s", "next_check": "n",
               "evidence": {"decided_by": "kv_events"}, "since": 1_700_000_000.0, "clearing_since": None}
    assert "decided by the engine&#x27;s KV-cache events" in _findings_html({"findings": [finding], "up": True}) or \
        "decided by the engine's KV-cache events" in _findings_html({"findings": [finding], "up": True})
    headline = run_script(["title"], f"title({json.dumps(finding)})")
    assert headline.endswith("(decided by the engine's KV-cache events)"), headline
    plain = run_script(["title"], f"title({json.dumps({**finding, 'evidence': {}})})")
    assert "decided" not in plain


def test_late_first_tokens_caused_by_the_exhausted_cache_are_one_story():
    """Where a lower symptom is the named cause of a higher one the API and
    the page tell one causal story ("first tokens are slow: requests are
    preempted because the cache is exhausted"), not two cards: the
    first-token finding carries the exhaustion as `caused_by`, the exhaustion
    says `cause_of`, and the noscript page draws one card with both. A cause
    that does not need the exhausted cache (prefill), an exhaustion on
    another engine, or one that has ended (clearing) stays its own card."""
    from dataclasses import replace as with_

    from sim_support import sim_monitor

    from kvwatch.diagnose import Finding
    from kvwatch.sidecar.statuspage import _findings_html

    monitor = sim_monitor("healthy", 30.0)
    found = [
        Finding("slow_first_token", "preemption", "warning", "medium", "m", "0", "preempted", {}, "relieve the cache"),
        Finding("slow_first_token", "prefill", "warning", "medium", "m", "1", "long prompts", {}, "chunk them"),
        Finding("slow_first_token", "queueing_kv_bound", "warning", "medium", "m", "3", "queued", {}, "shorten it"),
        Finding("exhaustion", "concurrency_beyond_capacity", "critical", "high", "m", "0", "full now", {}, "cap it"),
        Finding("exhaustion", "long_requests", "warning", "high", "m", "1", "a few long", {}, "cap max_tokens"),
        Finding("exhaustion", "long_requests", "warning", "high", "m", "2", "elsewhere", {}, "cap max_tokens"),
        Finding("exhaustion", "long_requests", "warning", "high", "m", "3", "ended", {}, "cap", clearing_since=1.0)]
    monitor.state = with_(monitor.state, findings=found)
    diagnosis = TestClient(create_app(monitor, monitor.settings)).get("/api/v1/diagnosis").json()
    rows = {(f["engine"], f["cause"]): f for f in diagnosis["findings"]}
    assert len(diagnosis["findings"]) == len(found)  # every finding is still listed
    told = rows[("0", "preemption")]["caused_by"]
    assert (told["symptom"], told["cause"], told["summary"]) == ("exhaustion", "concurrency_beyond_capacity", "full now")
    # What the card tells of its cause, no more: the cause's evidence is in its own row, listed beside it.
    cause_row = rows[("0", "concurrency_beyond_capacity")]
    assert told == {key: cause_row[key] for key in told} and "evidence" not in told and "evidence" in cause_row
    assert rows[("0", "concurrency_beyond_capacity")]["cause_of"] == {"symptom": "slow_first_token",
                                                                      "cause": "preemption"}
    assert [key for key, f in rows.items() if "caused_by" in f or "cause_of" in f] == [
        ("0", "preemption"), ("0", "concurrency_beyond_capacity")]
    page = _findings_html(diagnosis)
    assert page.count('class="finding') == len(found) - 1
    card = page[page.index('data-cause="preemption"'):]
    card = card[:card.index('<div class="finding')] if '<div class="finding' in card else card
    assert 'data-caused-by="exhaustion/concurrency_beyond_capacity"' in card and "full now" in card
    assert "Because: KV cache exhausted" in card
