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

from .harness import VLLM_VERSION, burst_load, long_prompt_load, shared_prefix_load, vllm_server, wait_until_idle
from .kvwatch_support import parse_page

INTERVAL_S = 0.5
LOAD_S = 12.0
IDLE_S = 3.0
# fixture name -> (load factory or None for no load, what the page shows)
SCENARIOS = {
    "idle": (None, "fresh server, no request yet"),
    "prefix-load": (lambda url: shared_prefix_load(url, duration=LOAD_S, concurrency=8, prefix_tokens=512),
                    "8 requests sharing a 512-token prefix"),
    "load": (lambda url: burst_load(url, duration=LOAD_S), "a burst of 24 concurrent 400+400-token requests"),
    "long-load": (lambda url: long_prompt_load(url, duration=LOAD_S), "6 requests with 900-token prompts"),
    "after": (None, "after all load: counters hold totals"),
}


def record_scenario(metrics_url: str, out: Path, name: str) -> Path:
    load, _ = SCENARIOS[name]
    seconds = IDLE_S if load is None else LOAD_S + 1.0
    fetcher = Fetcher(metrics_url, timeout=INTERVAL_S * 0.8, max_body_bytes=16 << 20)
    writer = CaptureWriter(out / f"{name}.tar.gz", manifest_for(metrics_url, INTERVAL_S, seconds))
    recorder = threading.Thread(target=record, args=(fetcher, writer, INTERVAL_S, seconds), daemon=True)
    run = load(metrics_url.rsplit("/metrics", 1)[0]) if load is not None else None  # starts the load
    try:
        recorder.start()
        recorder.join()
    finally:
        if run is not None:
            run.stop()
            run.wait()
    writer.close(ended_at=time.time(), interrupted=False, scenario=name, load=SCENARIOS[name][1])
    return writer.out


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
    args = parser.parse_args(argv)
    if args.out.exists():
        print(f"{args.out} exists; give a new folder", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True)
    started = datetime.now(timezone.utc)
    rows = []
    with vllm_server() as server:
        for name in SCENARIOS:
            if name != "idle":
                wait_until_idle(server.metrics_url)
            bundle = record_scenario(server.metrics_url, args.out, name)
            (args.out / f"metrics-{name}.txt").write_text(telling_page(bundle, name))
            manifest = Capture(bundle).manifest
            rows.append(f"| metrics-{name}.txt, {name}.tar.gz | {SCENARIOS[name][1]} | "
                        f"{manifest['pages']} pages, {manifest['failed']} failed |")
            print(f"recorded {name}: {manifest['pages']} pages", file=sys.stderr)
    (args.out / "README.md").write_text("\n".join([
        f"# vLLM {VLLM_VERSION} (CPU) captures, recorded {started:%Y-%m-%d} by `make capture-vllm`",
        "",
        f"Recorded with kvwatch {__version__}'s recorder every {INTERVAL_S:g} s from the real-vLLM tier's "
        "server (tests/vllm_tier/harness.py, vllm_server(): tiny-llama, --max-num-seqs 8, --block-size 32, "
        "--kv-cache-memory-bytes 4194304, --enable-prefix-caching, --enforce-eager): 128 blocks x 32 tokens.",
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
