"""`kvwatch sweep`: measure a running OpenAI-compatible server (vLLM) across a
grid of prompt lengths x output lengths x concurrency levels.

Each cell keeps `concurrency` streaming `/v1/completions` requests in flight
for a fixed number of requests or a fixed duration, measures time to first
token at the client, and polls the server's /metrics in a background thread
for what the engine saw: its own TTFT histogram, peak KV usage, running and
waiting requests, preemptions and token counters. Beside each cell stands the
capacity bound of `kvwatch capacity` for that length.

This module owns the command line, the order of a run (checks, prompt
calibration, warm-up, cells) and stopping on Ctrl-C. The HTTP client is in
kvwatch/sweep/client.py, prompts in kvwatch/sweep/prompts.py, /metrics
polling in kvwatch/sweep/metrics.py and the files in kvwatch/sweep/output.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from kvwatch import __version__
from kvwatch.capacity import arithmetic as cap
from kvwatch.sidecar.settings import parse_duration
from kvwatch.snapshot import Snapshot, capacity_tokens, config_number
from kvwatch.sweep.client import Client, RequestResult, ServerError, Worker, split_base_url
from kvwatch.sweep.metrics import CellMetrics, MetricsPoller, select_engines
from kvwatch.sweep.output import (
    COLUMNS,
    KV_PLOT,
    TTFT_PLOT,
    append_requests,
    write_plots,
    write_results,
)
from kvwatch.sweep.prompts import (
    PromptError,
    PromptMaker,
    calibrate_with_probes,
    calibrate_with_tokenize,
    tokenize_counter,
)

EXIT_INTERRUPTED = 130  # the shell's code for a run ended by SIGINT
DEFAULT_BLOCK_SIZE = 16  # vLLM's GPU default, when the server does not say
# After Ctrl-C, requests in flight get this long to finish before their
# connections are cut; then the workers get JOIN_AFTER_CUT_S to notice.
ABANDON_GRACE_S = 3.0
JOIN_AFTER_CUT_S = 2.0
IDLE_WAIT_S = 60.0
# Polls fewer than this in a cell make its peaks a guess.
FEW_POLLS = 3
# So do polls at under this share of the rate --poll-interval asks for.
SLOW_POLL_SHARE = 0.25
MAX_GRID_CELLS = 10_000


class SweepInputError(ValueError):
    """An input the sweep cannot use; exit status 2."""


class SweepRunError(RuntimeError):
    """The server could not be measured; exit status 1."""


# ---------------------------------------------------------------------------
# Command line.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, metavar="URL",
                        help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    parser.add_argument("--metrics-url", metavar="URL",
                        help="its Prometheus metrics (default: BASE-URL/metrics)")
    parser.add_argument("--model", required=True, metavar="NAME",
                        help="the served model name sent with every request")
    parser.add_argument("--input-tokens", required=True, metavar="N,N,...",
                        help="prompt lengths in tokens, e.g. 128,512")
    parser.add_argument("--output-tokens", required=True, metavar="N,N,...",
                        help="generated tokens per request (max_tokens, sent with ignore_eos), "
                        "e.g. 64,256")
    parser.add_argument("--concurrency", required=True, metavar="N,N,...",
                        help="requests kept in flight, e.g. 1,4,16")
    amount = parser.add_mutually_exclusive_group(required=True)
    amount.add_argument("--requests", type=int, metavar="N", help="requests per cell")
    amount.add_argument("--duration", metavar="TIME",
                        help="time per cell (30s, 2m): new requests start until it has passed, "
                        "then those in flight finish")
    parser.add_argument("--out", metavar="DIR",
                        help="folder for the results (default: ./kvwatch-sweep-<date>-<time>)")
    parser.add_argument("--model-config", metavar="PATH",
                        help="the model's config.json (file or folder): compute the capacity "
                        "bound from the attention structure instead of the server's reported pool")
    parser.add_argument("--kv-dtype", default="auto", metavar="DTYPE",
                        help="KV cache dtype for --model-config: " + "|".join(cap.KV_DTYPE_CHOICES)
                        + " (auto: the server's cache_dtype, else the config's torch_dtype)")
    parser.add_argument("--kv-budget", metavar="SIZE",
                        help="KV bytes for --model-config (e.g. 3GiB); default: the server's "
                        "kv_cache_memory_bytes")
    parser.add_argument("--poll-interval", default="0.5s", metavar="TIME",
                        help="how often /metrics is polled during a cell (default 0.5s)")
    parser.add_argument("--timeout", default="300s", metavar="TIME",
                        help="limit for one request (default 300s)")
    parser.add_argument("--warmup", type=int, default=1, metavar="N",
                        help="unmeasured requests sent before the first cell (default 1)")
    parser.add_argument("--seed", metavar="TEXT",
                        help="seed of the prompt words (default: random, so a rerun never hits "
                        "the prefix cache left by the previous one)")
    parser.add_argument("--api-key-file", metavar="PATH",
                        help="file holding a bearer token for the server's /v1 endpoints")
    parser.add_argument("--no-plots", action="store_true", help="do not draw the PNG plots")


def _int_list(flag: str, text: str, minimum: int) -> list[int]:
    values: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise SweepInputError(f"{flag}: {part!r} is not a whole number "
                                  f"(give a comma-separated list such as 1,4,16)") from None
        if value < minimum:
            raise SweepInputError(f"{flag}: {value} is below the minimum of {minimum}")
        if value not in values:
            values.append(value)
    if not values:
        raise SweepInputError(f"{flag}: give at least one value")
    return values


def _duration(flag: str, text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as error:
        raise SweepInputError(f"{flag}: {error}") from None


@dataclass
class SweepConfig:
    base_url: str
    metrics_url: str
    model: str
    input_tokens: list[int]
    output_tokens: list[int]
    concurrency: list[int]
    requests: int | None
    duration: float | None
    out_dir: Path
    poll_interval: float
    timeout: float
    warmup: int
    seed: str
    model_config: dict[str, Any] | None
    model_config_path: str | None
    kv_dtype: str
    kv_budget: int | None
    api_key: str | None
    plots: bool

    @property
    def cells(self) -> list[tuple[int, int, int]]:
        return [(inp, out, conc) for inp in self.input_tokens for out in self.output_tokens
                for conc in self.concurrency]

    def to_dict(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url, "metrics_url": self.metrics_url, "model": self.model,
            "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
            "concurrency": self.concurrency, "requests": self.requests,
            "duration_s": self.duration, "poll_interval_s": self.poll_interval,
            "timeout_s": self.timeout, "warmup": self.warmup, "seed": self.seed,
            "model_config": self.model_config_path, "kv_dtype": self.kv_dtype,
            "kv_budget_bytes": self.kv_budget, "out_dir": str(self.out_dir),
        }


def _load_model_config(path_text: str) -> dict[str, Any]:
    path = Path(path_text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SweepInputError(f"--model-config: {path} not found")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SweepInputError(f"--model-config: cannot read {path}: {error}") from None
    if not isinstance(config, dict):
        raise SweepInputError(f"--model-config: {path} is not a JSON object of model fields")
    return config


def build_config(args: argparse.Namespace) -> SweepConfig:
    """Check every flag before any network traffic."""
    try:
        scheme, host, port, prefix = split_base_url(args.base_url)
    except ValueError as error:
        raise SweepInputError(f"--base-url: {error}") from None
    netloc = f"[{host}]" if ":" in host else host
    base_url = f"{scheme}://{netloc}:{port}{prefix}"
    metrics_url = args.metrics_url or f"{base_url}/metrics"
    try:
        split_base_url(metrics_url)
    except ValueError as error:
        raise SweepInputError(f"--metrics-url: {error}") from None
    if not args.model.strip():
        raise SweepInputError("--model: give the served model name")
    inputs = _int_list("--input-tokens", args.input_tokens, 1)
    outputs = _int_list("--output-tokens", args.output_tokens, 1)
    levels = sorted(_int_list("--concurrency", args.concurrency, 1))
    if args.requests is not None and args.requests < 1:
        raise SweepInputError(f"--requests must be at least 1, got {args.requests}")
    duration = _duration("--duration", args.duration) if args.duration is not None else None
    poll_interval = _duration("--poll-interval", args.poll_interval)
    timeout = _duration("--timeout", args.timeout)
    if args.warmup < 0:
        raise SweepInputError(f"--warmup cannot be negative, got {args.warmup}")
    if len(inputs) * len(outputs) * len(levels) > MAX_GRID_CELLS:
        raise SweepInputError(f"the grid has more than {MAX_GRID_CELLS} cells; make it smaller")
    kv_dtype = args.kv_dtype.lower()
    if kv_dtype not in cap.KV_DTYPE_CHOICES:
        raise SweepInputError(f"--kv-dtype {args.kv_dtype!r} is not one of "
                              + ", ".join(cap.KV_DTYPE_CHOICES))
    model_config = _load_model_config(args.model_config) if args.model_config else None
    if model_config is None and (args.kv_budget or kv_dtype != "auto"):
        raise SweepInputError("--kv-budget and --kv-dtype size the bound computed from "
                              "--model-config; give --model-config too")
    kv_budget = None
    if args.kv_budget:
        try:
            kv_budget = cap.parse_size(args.kv_budget)
        except cap.CapacityInputError as error:
            raise SweepInputError(f"--kv-budget: {error}") from None
    api_key = None
    if args.api_key_file:
        try:
            api_key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except OSError as error:
            raise SweepInputError(f"--api-key-file: {error}") from None
    out_dir = Path(args.out) if args.out else Path(
        f"kvwatch-sweep-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    if out_dir.exists() and not out_dir.is_dir():
        raise SweepInputError(f"--out: {out_dir} exists and is not a folder")
    return SweepConfig(
        base_url=base_url, metrics_url=metrics_url, model=args.model.strip(),
        input_tokens=inputs, output_tokens=outputs, concurrency=levels, requests=args.requests,
        duration=duration, out_dir=out_dir, poll_interval=poll_interval, timeout=timeout,
        warmup=args.warmup, seed=args.seed or os.urandom(6).hex(), model_config=model_config,
        model_config_path=args.model_config, kv_dtype=kv_dtype, kv_budget=kv_budget,
        api_key=api_key, plots=not args.no_plots)


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except SweepInputError as error:
        print(f"kvwatch sweep: error: {error}", file=sys.stderr)
        return 2
    return Sweep(config).run()


# ---------------------------------------------------------------------------
# Statistics.


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _rate(amount: float | None, seconds: float) -> float | None:
    if amount is None or seconds <= 0:
        return None
    return amount / seconds


def cell_notes(cell: dict[str, Any], metrics: CellMetrics, poll_interval: float) -> list[str]:
    """What makes a cell's engine figures doubtful, said next to them."""
    number, notes = cell["cell"], []
    if metrics.polls < FEW_POLLS:
        notes.append(f"cell {number}: only {metrics.polls} /metrics poll(s); its peaks "
                     "may be missed (lower --poll-interval or lengthen the cell)")
    elif metrics.polls * poll_interval < cell["seconds"] * SLOW_POLL_SHARE:
        # Each poll waits for the last: a server whose /metrics answers late
        # under the cell's load (its front end is busy streaming) is polled
        # far less often than asked, and short peaks fall between polls.
        notes.append(f"cell {number}: {metrics.polls} /metrics polls in {cell['seconds']:.1f} s, not the "
                     f"{cell['seconds'] / poll_interval:.0f} asked for: the server's /metrics answered slowly "
                     "under the load; its peaks may be missed")
    if metrics.polls >= FEW_POLLS and cell["completed"] and not metrics.peak_running:
        # Its requests ran, yet no poll landed while one did (a loaded machine
        # can delay the poller past a short cell): a peak of 0 would read as
        # an idle engine.
        notes.append(f"cell {number}: none of its {metrics.polls} /metrics polls saw one of its "
                     f"{cell['completed']} requests running; its peak KV usage, running and waiting "
                     "were not measured (lower --poll-interval or lengthen the cell)")
    if metrics.restarts:
        notes.append(f"cell {number}: the engine's counters reset during the cell "
                     "(restart?); its engine figures are partial")
    return notes


def summarize_cell(number: int, inp: int, out: int, conc: int,
                   results: list[RequestResult], metrics: CellMetrics,
                   bound: dict[str, Any] | None) -> dict[str, Any]:
    """One row of the results: client measurements beside the engine's."""
    completed = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    first_sent = min((r.started for r in results), default=0.0)
    last_end = max((r.started + (r.latency or 0.0) for r in results), default=0.0)
    seconds = max(last_end - first_sent, 0.0)
    ttfts = [r.ttft for r in completed if r.ttft is not None]
    latencies = [r.latency for r in completed if r.latency is not None]
    usage_prompt = [r.prompt_tokens for r in completed if r.prompt_tokens is not None]
    cell: dict[str, Any] = {
        "cell": number, "input_tokens": inp, "output_tokens": out, "concurrency": conc,
        "requests_sent": len(results), "completed": len(completed), "failed": len(failed),
        "seconds": seconds,
        "client_ttft_p50_s": percentile(ttfts, 0.50),
        "client_ttft_p95_s": percentile(ttfts, 0.95),
        "client_latency_p50_s": percentile(latencies, 0.50),
        "client_latency_p95_s": percentile(latencies, 0.95),
    }
    histogram = metrics.histograms.get("ttft")
    for key, q in (("engine_ttft_p50_s", 0.50), ("engine_ttft_p95_s", 0.95)):
        quantile = histogram.quantile(q) if histogram is not None else None
        cell[key] = quantile.value if quantile else None
        cell[f"{key}_pinned"] = quantile.pinned if quantile else None
    cell["engine_ttft_mean_s"] = histogram.mean() if histogram is not None else None
    cell["engine_ttft_count"] = histogram.count if histogram is not None else None
    cell["peak_kv_usage"] = metrics.peak_kv_usage
    cell["peak_running"] = metrics.peak_running
    cell["peak_waiting"] = metrics.peak_waiting
    cell["capacity_bound"] = bound["bound"] if bound else None
    cell["capacity_source"] = bound["source"] if bound else None
    cell["preemptions"] = metrics.counter("preemptions")
    finished = metrics.finished()
    cell["engine_finished"] = finished
    prompt_tokens = metrics.counter("prompt_tokens")
    divisor = finished if finished else (len(completed) or None)
    cell["prompt_tokens_mean"] = (prompt_tokens / divisor
                                  if prompt_tokens is not None and divisor else None)
    cell["prompt_tokens_client_mean"] = (sum(usage_prompt) / len(usage_prompt)
                                         if usage_prompt else None)
    cell["prompt_tokens_per_s"] = _rate(prompt_tokens, seconds)
    cell["generation_tokens_per_s"] = _rate(metrics.counter("generation_tokens"), seconds)
    cell["client_prompt_tokens_per_s"] = _rate(sum(usage_prompt) if usage_prompt else None,
                                               seconds)
    cell["client_generation_tokens_per_s"] = _rate(
        float(sum(r.generated_tokens for r in completed)), seconds)
    cell["polls"] = metrics.polls
    cell["poll_errors"] = metrics.poll_errors
    cell["first_error"] = next((r.error for r in failed if r.error), None)
    cell["engine_restarts"] = metrics.restarts
    assert all(column in cell for column in COLUMNS)
    return cell


# ---------------------------------------------------------------------------
# Capacity bound beside each cell.


def capacity_bounds(snapshot: Snapshot, config: SweepConfig,
                    pairs: list[tuple[int, int]]) -> tuple[dict[tuple[int, int], dict], str]:
    """(bound per (input, output), a line saying how it was derived). The bound
    is summed over the engines serving the model: each has its own pool."""
    engine_ids = sorted({engine for _, engine in select_engines(snapshot, config.model)})
    infos = [snapshot.cache_config[e] for e in engine_ids if e in snapshot.cache_config]
    bounds: dict[tuple[int, int], dict] = {}
    if config.model_config is not None:
        targets = infos or ([{}] if config.kv_budget is not None else [])
        if targets:
            try:
                return _bounds_from_config(targets, config, pairs)
            except cap.CapacityInputError as error:
                raise SweepInputError(f"--model-config: {error}") from None
        note = ("--model-config given but the server reports no cache_config_info and no "
                "--kv-budget was given, so there is no budget to size")
        return bounds, note
    live = [(info, capacity_tokens(info), config_number(info, "block_size")) for info in infos]
    live = [(info, tokens, block) for info, tokens, block in live if tokens and block]
    if not live:
        return bounds, "the server reports no cache_config_info with a pool size; no bound"
    for inp, out in pairs:
        total, steps = 0, []
        for info, tokens, block in live:
            row = cap.live_bounds(int(tokens), int(block), inp, out)[0]
            total += row["bound"]
            steps.append(row["step"])
        bounds[(inp, out)] = {"bound": total, "source": "cache_config_info", "steps": steps}
    engines = f" x {len(live)} engines" if len(live) > 1 else ""
    info, tokens, block = live[0]
    return bounds, (f"from the server's cache_config_info: {int(tokens):,} tokens in blocks of "
                    f"{int(block)}{engines}, one block kept aside, each request counted at "
                    "ceil((input + output) / block) blocks")


def _bounds_from_config(targets: list[dict[str, str]], config: SweepConfig,
                        pairs: list[tuple[int, int]]) -> tuple[dict[tuple[int, int], dict], str]:
    bounds: dict[tuple[int, int], dict] = {}
    note = ""
    for inp, out in pairs:
        total, steps = 0, []
        for info in targets:
            block = int(config_number(info, "block_size") or DEFAULT_BLOCK_SIZE)
            dtype = config.kv_dtype
            reported = (info.get("cache_dtype") or "auto").lower()
            if dtype == "auto" and reported in cap.DTYPE_BYTES:
                dtype = reported
            if config.kv_budget is not None:
                budget, budget_source = config.kv_budget, "--kv-budget"
            else:
                memory = config_number(info, "kv_cache_memory_bytes")
                budget, budget_source = (int(memory), "the server's kv_cache_memory_bytes") \
                    if memory else (None, None)
            if budget is None:
                raise cap.CapacityInputError(
                    "the server does not report kv_cache_memory_bytes; give --kv-budget")
            result = cap.compute_capacity(config.model_config, dtype, block, budget, inp, out)
            request = result.requests[0]
            total += request.pool_bound
            steps.extend(request.steps)
            note = (f"computed from {config.model_config_path} ({result.bytes_per_token} B per "
                    f"token, {dtype}) with budget {budget:,} B from {budget_source}, blocks of "
                    f"{block}" + (f", x {len(targets)} engines" if len(targets) > 1 else "")
                    + "; pool bound after block rounding and the null block")
        bounds[(inp, out)] = {"bound": total, "source": "model config", "steps": steps}
    return bounds, note


# ---------------------------------------------------------------------------
# The run.


def _now_text() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Sweep:
    def __init__(self, config: SweepConfig, stderr: TextIO | None = None):
        self.config = config
        self.stderr = stderr or sys.stderr
        self.client = Client(config.base_url, config.timeout, config.api_key)
        self.poller = MetricsPoller(config.metrics_url, config.model, config.poll_interval,
                                    timeout=min(10.0, config.timeout))
        self.stop = threading.Event()
        self.cells: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.server: dict[str, Any] = {"base_url": config.base_url,
                                       "metrics_url": config.metrics_url}
        self.bounds: dict[tuple[int, int], dict] = {}
        self.started_at = _now_text()
        self.finished_at: str | None = None
        self.interrupted = False
        self.prompts: PromptMaker | None = None
        self._previous_handlers: dict[int, Any] = {}

    def say(self, message: str) -> None:
        print(message, file=self.stderr, flush=True)

    # -- entry -------------------------------------------------------------------

    def run(self) -> int:
        self._install_signal_handlers()
        try:
            try:
                self._prepare()
            except SweepInputError as error:
                self.say(f"kvwatch sweep: error: {error}")
                return 2
            except (SweepRunError, PromptError, ServerError) as error:
                self.say(f"kvwatch sweep: error: {error}")
                return 1
            self._measure()
            return self._finish()
        except KeyboardInterrupt:
            # A second Ctrl-C: quit now. Every measured cell is already on disk.
            self.client.abandon_all()
            self.interrupted = True
            try:
                self._write()  # only to mark the files interrupted; they were complete already
            except (KeyboardInterrupt, OSError):
                pass
            self.say(f"kvwatch sweep: stopped at once; {len(self.cells)} cell(s) kept in "
                     f"{self.config.out_dir}")
            return EXIT_INTERRUPTED
        finally:
            self.poller.stop()
            self._restore_signal_handlers()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach only the main thread; a caller elsewhere stops via .stop
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.stop.is_set():
            raise KeyboardInterrupt
        self.stop.set()
        # Only sets a flag: the loop sees it, lets requests in flight finish for
        # a moment, cuts the rest and writes what was measured.
        self.say(f"kvwatch sweep: {signal.Signals(signum).name} received: stopping; the running "
                 f"cell is dropped, measured cells are kept (again to quit at once)")

    # -- before the cells --------------------------------------------------------

    def _prepare(self) -> None:
        config = self.config
        try:
            config.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SweepInputError(f"--out: cannot create {config.out_dir}: {error}") from None
        max_model_len = self._check_model()
        self.server["max_model_len"] = max_model_len
        if max_model_len:
            too_long = [(i, o) for i in config.input_tokens for o in config.output_tokens
                        if i + o > max_model_len]
            if too_long:
                listed = ", ".join(f"{i}+{o}" for i, o in too_long)
                raise SweepInputError(
                    f"input + output tokens exceed the server's max_model_len {max_model_len}: "
                    f"{listed}")
        snapshot, error = self.poller.poll()
        if snapshot is None:
            raise SweepRunError(f"cannot read {config.metrics_url}: {error}")
        if not snapshot.engines:
            raise SweepRunError(f"{config.metrics_url} has no vLLM metrics (vllm:* families); "
                                "point --metrics-url at the engine's /metrics")
        engines = select_engines(snapshot, config.model)
        self.server["engines"] = [{"model_name": m, "engine": e} for m, e in engines]
        self.server["cache_config"] = {
            engine: {key: info.get(key) for key in (
                "block_size", "num_gpu_blocks", "kv_cache_size_tokens", "kv_cache_memory_bytes",
                "cache_dtype", "enable_prefix_caching")}
            for engine, info in snapshot.cache_config.items()}
        if not any(m == config.model for m, _ in engines):
            self.notes.append(f"no engine series is labelled model_name={config.model!r}; "
                              "all engines on the page are counted")
        pairs = [(i, o) for i in config.input_tokens for o in config.output_tokens]
        self.bounds, capacity_note = capacity_bounds(snapshot, config, pairs)
        self.server["capacity_note"] = capacity_note
        self.prompts = self._calibrate(max_model_len)
        self.server["prompt_method"] = self.prompts.describe()
        self.server["prompt_checks"] = {str(k): v for k, v in self.prompts.checks.items()}
        too_short = [i for i in config.input_tokens if i < self.prompts.min_tokens()]
        if too_short:
            raise SweepInputError(
                f"--input-tokens {', '.join(map(str, too_short))}: the shortest prompt this "
                f"server's tokenizer makes is {self.prompts.min_tokens()} tokens")
        self._warm_up()

    def _check_model(self) -> int | None:
        """The served models must include --model; returns its max_model_len if listed."""
        url = f"{self.config.base_url}/v1/models"
        try:
            status, body = self.client.get_json("/v1/models", timeout=min(10.0, self.config.timeout))
        except ServerError as error:
            raise SweepRunError(f"cannot reach the server: {error}") from None
        if status in (401, 403):
            raise SweepRunError(f"{url} answered HTTP {status}: the server wants an API key "
                                "(--api-key-file)")
        if status != 200 or not isinstance(body, dict) or not isinstance(body.get("data"), list):
            self.notes.append(f"{url} answered HTTP {status} without a model list; the model "
                              "name and lengths were not checked")
            return None
        served = {m.get("id"): m for m in body["data"] if isinstance(m, dict)}
        if self.config.model not in served:
            names = ", ".join(sorted(str(name) for name in served)) or "none"
            raise SweepInputError(f"--model {self.config.model!r} is not served by "
                                  f"{self.config.base_url} (it serves: {names})")
        length = served[self.config.model].get("max_model_len")
        return int(length) if isinstance(length, int) and length > 0 else None

    def _calibrate(self, max_model_len: int | None) -> PromptMaker:
        count = tokenize_counter(self.client, self.config.model)
        maker = calibrate_with_tokenize(count) if count is not None else None
        if maker is not None:
            for length in self.config.input_tokens:
                maker.check_length(length, self.config.seed)
            if maker.fitted_lengths:
                self.notes.append("prompt lengths "
                                  + ", ".join(map(str, sorted(maker.fitted_lengths)))
                                  + " did not come out exact from word costs; each such prompt "
                                  "is fitted with /tokenize")
            return maker
        if count is not None:
            self.notes.append("/tokenize found fewer than 4 one-token words; prompt lengths are "
                              "calibrated from the server's counts instead")
        return calibrate_with_probes(self._probe_prompt_tokens, max_model_len, self.config.seed)

    def _probe_prompt_tokens(self, text: str) -> int:
        """Prompt tokens the server counts for this text: a one-token completion's
        usage, else the increase of its prompt_tokens counter."""
        before = self._prompt_counter()
        body = {"model": self.config.model, "prompt": text, "max_tokens": 1, "ignore_eos": True}
        try:
            status, answer = self.client.post_json("/v1/completions", body)
        except ServerError as error:
            raise SweepRunError(f"calibration request failed: {error}") from None
        if status != 200:
            detail = answer.get("message") if isinstance(answer, dict) else None
            raise SweepRunError(f"calibration request to /v1/completions answered HTTP {status}"
                                + (f": {detail}" if detail else ""))
        usage = answer.get("usage") if isinstance(answer, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            return usage["prompt_tokens"]
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            after = self._prompt_counter()
            if before is not None and after is not None and after > before:
                return int(after - before)
            time.sleep(0.1)
        raise SweepRunError("cannot calibrate prompt lengths: the server has no /tokenize, its "
                            "completions carry no usage and its prompt_tokens counter did not move")

    def _prompt_counter(self) -> float | None:
        snapshot, _ = self.poller.poll()
        if snapshot is None:
            return None
        values = [snapshot.engines[k].counters.get("prompt_tokens")
                  for k in select_engines(snapshot, self.config.model)]
        values = [v for v in values if v is not None]
        return sum(values) if values else None

    def _request_body(self, prompt: str, output_tokens: int) -> dict[str, Any]:
        return {"model": self.config.model, "prompt": prompt, "max_tokens": output_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    def _warm_up(self) -> None:
        if not self.config.warmup:
            return
        worker = Worker(self.client)
        length = self.config.input_tokens[0]
        try:
            for index in range(self.config.warmup):
                if self.stop.is_set():
                    return
                prompt = self.prompts.make(length, random.Random(f"{self.config.seed}-warmup-{index}"))
                result = self.client.stream_completion(
                    worker, self._request_body(prompt.text, min(16, self.config.output_tokens[0])))
                if not result.ok:
                    raise SweepRunError(f"the warm-up request failed: {result.error}")
        finally:
            worker.close()

    # -- the cells ---------------------------------------------------------------

    def _measure(self) -> None:
        config = self.config
        grid = config.cells
        per_cell = (f"{config.requests} requests" if config.requests is not None
                    else f"{config.duration:g} s")
        self.say(f"kvwatch sweep: {len(grid)} cells ({len(config.input_tokens)} input x "
                 f"{len(config.output_tokens)} output lengths x {len(config.concurrency)} "
                 f"concurrency levels), {per_cell} each, model {config.model!r} at "
                 f"{config.base_url}")
        self.say(f"kvwatch sweep: prompts: {self.prompts.describe()}; results in {config.out_dir}")
        self._write()
        self.poller.start()
        for number, (inp, out, conc) in enumerate(grid, start=1):
            if self.stop.is_set():
                break
            cell = self._run_cell(number, inp, out, conc)
            if cell is None:
                break
            self.cells.append(cell)
            self._write()
            self.say(self._progress_line(number, len(grid), cell))

    def _wait_idle(self, number: int) -> None:
        """Let the previous cell's requests leave the engine, so cells do not overlap.
        A server with other traffic never goes idle: after IDLE_WAIT_S the cell
        starts anyway, with a note."""
        limit = min(self.config.timeout, IDLE_WAIT_S)
        deadline = time.monotonic() + limit
        while not self.stop.is_set():
            snapshot, _ = self.poller.poll()
            if snapshot is not None:
                engines = [snapshot.engines[k] for k in select_engines(snapshot, self.config.model)]
                busy = sum(e.gauges.get("running", 0.0) + e.gauges.get("waiting", 0.0)
                           for e in engines)
                if busy == 0:
                    return
            if time.monotonic() > deadline:
                self.notes.append(f"cell {number}: the server was still busy after {limit:g} s; "
                                  "the cell may include other traffic")
                return
            self.stop.wait(min(0.1, self.config.poll_interval))

    def _run_cell(self, number: int, inp: int, out: int, conc: int) -> dict[str, Any] | None:
        config = self.config
        self._wait_idle(number)
        if self.stop.is_set():
            return None
        workers = [Worker(self.client) for _ in range(conc)]
        for worker in workers:
            worker.open()
        self.poller.begin_cell()
        results: list[tuple[int, RequestResult]] = []
        lock = threading.Lock()
        sent = 0
        cell_deadline = (time.monotonic() + config.duration) if config.duration is not None else None

        def claim() -> int | None:
            nonlocal sent
            with lock:
                if self.stop.is_set():
                    return None
                if config.requests is not None and sent >= config.requests:
                    return None
                if cell_deadline is not None and time.monotonic() >= cell_deadline:
                    return None
                sent += 1
                return sent - 1

        def work(worker: Worker) -> None:
            try:
                while (index := claim()) is not None:
                    prompt = self.prompts.make(inp, random.Random(f"{config.seed}-{number}-{index}"))
                    result = self.client.stream_completion(worker, self._request_body(prompt.text, out))
                    with lock:
                        results.append((index, result))
            except Exception as error:  # a bug must not hang the cell; report it as a failure
                with lock:
                    results.append((-1, RequestResult(ok=False, started=time.monotonic(),
                                                      latency=0.0, error=repr(error))))
            finally:
                worker.close()

        threads = [threading.Thread(target=work, args=(worker,), name=f"kvwatch-sweep-{number}-{i}",
                                    daemon=True) for i, worker in enumerate(workers)]
        for thread in threads:
            thread.start()
        while alive := [thread for thread in threads if thread.is_alive()]:
            if self.stop.is_set():
                self._abandon(threads)
                self.poller.end_cell()
                return None
            alive[0].join(timeout=0.1)
        self._settle(sum(1 for _, r in results if r.ok))
        metrics = self.poller.end_cell()
        ordered = [result for _, result in sorted(results, key=lambda item: item[0])]
        cell = summarize_cell(number, inp, out, conc, ordered, metrics, self.bounds.get((inp, out)))
        self.notes.extend(cell_notes(cell, metrics, config.poll_interval))
        append_requests(config.out_dir, self._request_rows(cell, sorted(results, key=lambda x: x[0])),
                        first=not self.cells)
        return cell

    def _abandon(self, threads: list[threading.Thread]) -> None:
        """Give requests in flight a moment, then cut their connections."""
        grace = time.monotonic() + min(ABANDON_GRACE_S, self.config.timeout)
        for thread in threads:
            thread.join(timeout=max(0.0, grace - time.monotonic()))
        cut = self.client.abandon_all()
        if cut:
            self.say(f"kvwatch sweep: abandoned {cut} request(s) in flight")
        limit = time.monotonic() + JOIN_AFTER_CUT_S
        for thread in threads:
            thread.join(timeout=max(0.0, limit - time.monotonic()))

    def _settle(self, completed: int) -> None:
        """Wait (briefly) until the engine's counters show the cell's requests
        finished, so the closing poll holds all of them."""
        deadline = time.monotonic() + max(2.0, 4 * self.config.poll_interval)
        while time.monotonic() < deadline and not self.stop.is_set():
            snapshot, _ = self.poller.poll()
            metrics = self.poller.current()
            finished = metrics.finished()
            if snapshot is not None:
                engines = [snapshot.engines[k] for k in select_engines(snapshot, self.config.model)]
                idle = all(e.gauges.get("running", 0.0) == 0 for e in engines)
                if idle and (finished is None or finished >= completed):
                    return
            time.sleep(min(0.1, self.config.poll_interval))

    @staticmethod
    def _request_rows(cell: dict[str, Any], results: list[tuple[int, RequestResult]]):
        first = min((r.started for _, r in results), default=0.0)
        for index, result in results:
            yield {"cell": cell["cell"], "input_tokens": cell["input_tokens"],
                   "output_tokens": cell["output_tokens"], "concurrency": cell["concurrency"],
                   "index": index, "start_s": result.started - first, "ok": int(result.ok),
                   "ttft_s": result.ttft, "latency_s": result.latency,
                   "prompt_tokens": result.prompt_tokens,
                   "completion_tokens": result.completion_tokens, "chunks": result.chunks,
                   "finish_reason": result.finish_reason, "error": result.error}

    @staticmethod
    def _progress_line(number: int, total: int, cell: dict[str, Any]) -> str:
        def f(value: Any, digits: int = 3) -> str:
            return "-" if value is None else f"{value:.{digits}g}"

        bound = cell["capacity_bound"]
        return (f"[{number}/{total}] in {cell['input_tokens']} out {cell['output_tokens']} "
                f"c {cell['concurrency']}: {cell['completed']} ok, {cell['failed']} failed in "
                f"{cell['seconds']:.1f} s | TTFT p50 {f(cell['client_ttft_p50_s'])} "
                f"p95 {f(cell['client_ttft_p95_s'])} s (engine p95 "
                f"{f(cell['engine_ttft_p95_s'])}) | peak KV {f(cell['peak_kv_usage'])}, "
                f"running {f(cell['peak_running'])}"
                + (f" (bound {bound})" if bound is not None else "")
                + f" | preempted {f(cell['preemptions'])} | "
                f"{f(cell['generation_tokens_per_s'], 4)} gen tok/s"
                + (f" | first error: {cell['first_error']}" if cell["first_error"] else ""))

    # -- after -------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        return {
            "kvwatch_version": __version__,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "interrupted": self.interrupted,
            "planned_cells": len(self.config.cells),
            "config": self.config.to_dict(),
            "server": self.server,
            "capacity": [{"input_tokens": inp, "output_tokens": out, **bound}
                         for (inp, out), bound in self.bounds.items()],
            "columns": COLUMNS,
            "cells": self.cells,
            "notes": self.notes,
        }

    def _write(self) -> None:
        write_results(self.config.out_dir, self.report())

    def _finish(self) -> int:
        self.interrupted = self.stop.is_set()
        self.finished_at = _now_text()
        self._write()
        out_dir = self.config.out_dir
        if self.config.plots and self.cells:
            try:
                write_plots(out_dir, self.cells)
                plots = f", {TTFT_PLOT}, {KV_PLOT}"
            except ImportError:
                plots = ""
                self.say("kvwatch sweep: plots skipped: matplotlib is not installed "
                         "(pip install 'kvwatch[sweep]')")
        else:
            plots = ""
        written = "sweep.csv, sweep.json, " + ("requests.csv, " if self.cells else "") \
            + f"summary.md{plots}"
        if self.interrupted:
            self.say(f"kvwatch sweep: interrupted; {len(self.cells)} of {len(self.config.cells)} "
                     f"cell(s) kept in {out_dir} ({written})")
            return EXIT_INTERRUPTED
        self.say(f"kvwatch sweep: done; wrote {written} in {out_dir}")
        if any(cell["completed"] == 0 for cell in self.cells):
            self.say("kvwatch sweep: some cells completed no request; see first_error in sweep.csv")
            return 1
        return 0
