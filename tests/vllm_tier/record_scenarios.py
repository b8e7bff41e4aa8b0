"""Record one capture per cause from the tier's real vLLM, for the unit tests
that replay them (tests/fixtures/vllm-0.32-cpu-scenarios/<scenario>/).

Each scenario's load (tests/vllm_tier/scenarios.py) runs while kvwatch's own
Fetcher records /metrics every second, with a deadline of 20 s: a page vLLM
answers late is recorded with its lateness (`seconds`), never dropped. The
restart scenario records across `vllm serve` stopped and started again on the
same port, the changes scenario across a restart with another served model
name, an fp8 KV cache, prefix caching off and two LoRA adapters (not recorded on a CPU whose
vLLM takes no fp8 KV cache: cpu_support.py). The residency scenarios run on
a second server started with --kv-cache-metrics --kv-cache-metrics-sample 1.0.

    .venv/bin/python -m tests.vllm_tier.record_scenarios --out /tmp/scenarios [--only name ...]

The README of each scenario (flags, load, date, what the pages show) is
written beside its capture; the ground truth is the load's, by construction.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from kvwatch.capture.bundle import Capture, CaptureWriter
from kvwatch.capture.record import describe_page, manifest_for
from kvwatch.scrape import Fetcher

from .cpu_support import this_cpu_kv_cache_dtype_change
from .harness import VLLM_VERSION, burst_load, shared_prefix_load, vllm_server, wait_until_idle, write_tiny_lora
from .scenarios import (
    changed_prefix_load,
    distinct_load,
    long_requests_load,
    prefix_rotation_load,
    reuse_then_flood_load,
    stalled_front_end_load,
)

INTERVAL_S = 1.0
DEADLINE_S = 20.0
RESIDENCY_FLAGS = ("--kv-cache-metrics", "--kv-cache-metrics-sample", "1.0")
SERVER_FLAGS = ("vllm serve tiny-llama --dtype float32 --max-model-len 1024 --max-num-seqs 8 --block-size 32 "
                "--enable-prefix-caching --kv-cache-memory-bytes 4194304 --enforce-eager "
                "(128 blocks x 32 tokens = 4,096 tokens)")

GROWING = ((0.0, 4), (18.0, 12))  # 4 prefixes that fit, then 12 that do not

# name -> (server, load factory (given the running server), seconds recorded, ground truth)
SCENARIOS = {
    "long-requests": ("plain", lambda server: long_requests_load(server.base_url, duration=25.0), 32.0,
                      "long_requests: 5 requests of 200 prompt + 800 generated tokens, all admitted at once; "
                      "each ends at 1,000 tokens (32 blocks), 5 x 32 > 127 usable blocks: preemptions, "
                      "with at most the preempted waiting"),
    "front-end": ("plain", lambda server: stalled_front_end_load(server.base_url, server.pid, duration=25.0), 32.0,
                  "front_end: 4 in flight, distinct 64-token prompts, 8 tokens generated, while vLLM's API server "
                  "process alone is stopped 0.3 s of every 0.4 s (SIGSTOP/SIGCONT; the engine core runs on): "
                  "TTFT grows, queue and prefill do not"),
    "concurrency": ("plain", lambda server: burst_load(server.base_url, duration=15.0), 25.0,
                    "concurrency_beyond_capacity: 24 distinct requests of 400 + 400 tokens in flight"),
    "eviction-rotation": ("plain", lambda server: prefix_rotation_load(server.base_url, duration=30.0), 32.0,
                          "eviction_before_reuse: round robin over 12 prefixes of 512 tokens (192 blocks > 128), "
                          "2 in flight: each prefix is evicted just before its turn; usage about 0.27"),
    "eviction-growing": ("plain", lambda server: prefix_rotation_load(server.base_url, duration=40.0, phases=GROWING),
                         42.0,
                         "eviction_before_reuse: round robin over 4 prefixes of 512 tokens (fits) for 18 s, then "
                         "over 12 (does not fit): the working set outgrew the cache; usage about 0.27"),
    "prefix-changed": ("plain",
                       lambda server: changed_prefix_load(server.base_url, duration=40.0, switch_after=18.0), 42.0,
                       "prefix_changed: 2 in flight sharing a 512-token prefix for 18 s, then each request puts "
                       "its own 32-token header first: no block is shared any more"),
    "no-reuse": ("plain", lambda server: distinct_load(server.base_url, duration=30.0), 32.0,
                 "no_reuse: 2 in flight, distinct 544-token prompts"),
    "changes": ("changes", None, 0.0,
                "model_changed, cache_dtype_changed, cache_config_changed, caching_disabled, lora_changed: "
                "distinct prompts for 10 s, vllm serve stopped and started on the same port with "
                "--served-model-name tiny-llama-b --kv-cache-dtype fp8 --no-enable-prefix-caching and two LoRA "
                "adapters of the tiny model (lora-a, lora-b), distinct prompts for 10 s, then 4 s for lora-a "
                "and 4 s for lora-b"),
    "restart": ("restart", None, 0.0,
                "cold_cache then recovered: 8 requests sharing a 512-token prefix for 15 s, vllm serve stopped "
                "and started on the same port, the same load with the same prefix for 30 s"),
    "residency-eviction-rotation": ("residency",
                                    lambda server: prefix_rotation_load(server.base_url, duration=30.0), 32.0,
                                    "eviction_before_reuse with --kv-cache-metrics: as eviction-rotation"),
    "residency-eviction-growing": ("residency",
                                   lambda server: prefix_rotation_load(server.base_url, duration=40.0, phases=GROWING),
                                   42.0, "eviction_before_reuse with --kv-cache-metrics: as eviction-growing"),
    "residency-prefix-changed": ("residency",
                                 lambda server: changed_prefix_load(server.base_url, duration=40.0,
                                                                    switch_after=18.0), 42.0,
                                 "prefix_changed with --kv-cache-metrics: as prefix-changed"),
    "residency-no-reuse": ("residency", lambda server: distinct_load(server.base_url, duration=30.0), 32.0,
                           "no_reuse with --kv-cache-metrics: as no-reuse"),
    "residency-shortfall": ("residency", lambda server: reuse_then_flood_load(server.base_url), 26.0,
                            "eviction_before_reuse with --kv-cache-metrics: 4 prefixes of 256 tokens reused every "
                            "~2 s for 14 s (their blocks record reuse gaps), then distinct 480-token prompts, 2 in "
                            "flight, for 8 s: blocks evicted after less idle time than the reuse gap"),
}


class Recorder:
    """Fetch every INTERVAL_S (a late page delays the next fetch, never doubles it) until stopped."""

    def __init__(self, metrics_url: str, out: Path, seconds: float):
        self.fetcher = Fetcher(metrics_url, timeout=DEADLINE_S, max_body_bytes=16 << 20)
        self.writer = CaptureWriter(out, manifest_for(metrics_url, INTERVAL_S, seconds))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.late: list[float] = []

    def _run(self) -> None:
        started = time.monotonic()
        slot = 0
        while not self.stop.is_set():
            at = time.time()
            result = self.fetcher.fetch()
            self.writer.add(at, result.seconds, result.text, result.reason, result.detail)
            if result.text is not None and self.writer.manifest.get("engine") is None:
                self.writer.update(**describe_page(result.text))
            self.late.append(result.seconds)
            slot = max(slot + 1, int((time.monotonic() - started) / INTERVAL_S) + 1)
            self.stop.wait(max(0.0, started + slot * INTERVAL_S - time.monotonic()))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(DEADLINE_S + 5)
        self.writer.close(ended_at=time.time(), interrupted=False)


def record_load(server, folder: Path, name: str) -> dict:
    _, load, seconds, _ = SCENARIOS[name]
    wait_until_idle(server.metrics_url)
    with Recorder(server.metrics_url, folder / "capture.tar.gz", seconds) as recorder:
        time.sleep(2 * INTERVAL_S)  # an idle page or two first
        run = load(server)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.5)
        run.stop()
        stats = run.wait()
        time.sleep(2 * INTERVAL_S)
    return {"requests": stats.completed, "failed": stats.failed, "errors": stats.errors[:2],
            "fetch_seconds_max": max(recorder.late)}


def record_restart(folder: Path, build, log: Path) -> dict:
    venv, model = build
    with vllm_server(model_dir=model, venv=venv, log_path=log) as server:
        port = server.port
        recorder = Recorder(server.metrics_url, folder / "capture.tar.gz", 120.0).__enter__()
        run = shared_prefix_load(server.base_url, duration=15.0, seed=19)
        first = run.wait()
        time.sleep(2)
    restarted_at = time.time()
    with vllm_server(port=port, model_dir=model, venv=venv, log_path=log) as server:
        run = shared_prefix_load(server.base_url, duration=30.0, seed=19)
        second = run.wait()
        time.sleep(3)
        recorder.__exit__(None, None, None)
    return {"requests_before": first.completed, "requests_after": second.completed,
            "stopped_at": restarted_at, "fetch_seconds_max": max(recorder.late)}


CHANGED_FLAGS = ("--no-enable-prefix-caching", "--kv-cache-dtype", "fp8", "--enable-lora", "--max-loras", "1",
                 "--max-lora-rank", "8")
CHANGED_MODEL = "tiny-llama-b"
ADAPTERS = ("lora-a", "lora-b")


def record_changes(folder: Path, build, log: Path) -> dict:
    venv, model = build
    adapter = write_tiny_lora(folder.parent / "tiny-lora")
    modules = ("--lora-modules", *(f"{name}={adapter}" for name in ADAPTERS))
    with vllm_server(model_dir=model, venv=venv, log_path=log) as server:
        port = server.port
        recorder = Recorder(server.metrics_url, folder / "capture.tar.gz", 120.0).__enter__()
        time.sleep(2 * INTERVAL_S)
        first = distinct_load(server.base_url, duration=10.0).wait()
        time.sleep(2)
    restarted_at = time.time()
    with vllm_server(port=port, model_dir=model, venv=venv, log_path=log, served_model_name=CHANGED_MODEL,
                     extra_args=(*CHANGED_FLAGS, *modules)) as server:
        after = [distinct_load(server.base_url, duration=10.0, model=CHANGED_MODEL).wait()]
        after += [distinct_load(server.base_url, duration=4.0, model=name).wait() for name in ADAPTERS]
        time.sleep(3)
        recorder.__exit__(None, None, None)
    return {"requests_before": first.completed, "requests_after": [stats.completed for stats in after],
            "failed": first.failed + sum(stats.failed for stats in after), "stopped_at": restarted_at,
            "fetch_seconds_max": max(recorder.late)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args(argv)
    from .harness import build_tiny_model, default_model_dir, ensure_vllm_venv
    venv = ensure_vllm_venv()
    build = (venv, build_tiny_model(default_model_dir(venv), venv=venv))
    names = args.only or list(SCENARIOS)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "server.log"
    results = {}
    for kind, flags in (("plain", ()), ("residency", RESIDENCY_FLAGS)):
        chosen = [n for n in names if SCENARIOS[n][0] == kind]
        if not chosen:
            continue
        with vllm_server(model_dir=build[1], venv=venv, extra_args=flags, log_path=log) as server:
            for name in chosen:
                folder = args.out / name
                folder.mkdir(exist_ok=True)
                results[name] = record_load(server, folder, name)
                print(name, results[name], file=sys.stderr, flush=True)
    if "restart" in names:
        folder = args.out / "restart"
        folder.mkdir(exist_ok=True)
        results["restart"] = record_restart(folder, build, log)
        print("restart", results["restart"], file=sys.stderr, flush=True)
    dtype_change = this_cpu_kv_cache_dtype_change()
    if "changes" in names and not dtype_change.dtype:
        # Its ground truth includes cache_dtype_changed: recorded without it, the capture would lie.
        print(f"changes: not recorded on this machine: {dtype_change.reason}", file=sys.stderr, flush=True)
    elif "changes" in names:
        folder = args.out / "changes"
        folder.mkdir(exist_ok=True)
        results["changes"] = record_changes(folder, build, log)
        print("changes", results["changes"], file=sys.stderr, flush=True)
    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    for name, result in results.items():
        server, _, _, truth = SCENARIOS[name]
        flags = SERVER_FLAGS + (" " + " ".join(RESIDENCY_FLAGS) if server == "residency" else "")
        if server == "changes":
            flags += (f"; then --served-model-name {CHANGED_MODEL} " + " ".join(CHANGED_FLAGS)
                      + " --lora-modules " + " ".join(f"{name}=<tiny LoRA>" for name in ADAPTERS))
        manifest = Capture(args.out / name / "capture.tar.gz").manifest
        (args.out / name / "README.md").write_text("\n".join([
            f"# {name}: vLLM {VLLM_VERSION} (CPU), recorded {day}",
            "",
            f"Server: `{flags}`.",
            f"Recorder: kvwatch's Fetcher every {INTERVAL_S:g} s, deadline {DEADLINE_S:g} s "
            "(tests/vllm_tier/record_scenarios.py); a late page is kept with its lateness.",
            f"Load (tests/vllm_tier/scenarios.py): {truth}.",
            f"Machine: 2 shared CPU cores under other work. Pages: {manifest.get('pages')}, "
            f"failed: {manifest.get('failed')}.",
            f"Measured: `{json.dumps(result)}`.",
            "",
            f"Ground truth: {truth.split(':')[0]}.",
            "",
        ]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
