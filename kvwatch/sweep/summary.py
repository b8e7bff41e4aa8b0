"""One cell's figures from its requests and the engine's window: percentiles,
rates, notes on what the polls could not see, and the capacity bound beside
the peak concurrency observed."""

from __future__ import annotations

import math
from typing import Any

from kvwatch.capacity import arithmetic as cap
from kvwatch.snapshot import Snapshot, capacity_tokens, config_number
from kvwatch.sweep.config import DEFAULT_BLOCK_SIZE, SweepConfig, SweepInputError
from kvwatch.sweep.client import RequestResult
from kvwatch.sweep.metrics import CellMetrics, select_engines
from kvwatch.sweep.output import COLUMNS

# Polls fewer than this in a cell make its peaks a guess.
FEW_POLLS = 3
# So do polls at under this share of the rate --poll-interval asks for.
SLOW_POLL_SHARE = 0.25


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


def foreign_note(cell: dict[str, Any]) -> str:
    return (f"cell {cell['cell']}: other traffic: the server finished {cell['engine_finished']:.0f} requests, "
            f"{cell['foreign_requests']} more than the {cell['requests_sent']} the sweep sent; the cell's engine "
            "figures (prompt tokens per request, engine TTFT, peaks, tokens per second) include them")


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
    if cell.get("foreign_requests"):
        notes.append(foreign_note(cell))
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
        # As the sidecar reports it: pinned in the first bucket, the value is
        # that bucket's bound; `_pinned` is the bound's side, "<" or ">".
        quantile = histogram.reported_quantile(q) if histogram is not None else None
        cell[key] = quantile.value if quantile else None
        cell[f"{key}_pinned"] = quantile.bound if quantile else None
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
    # The server finished more requests than the sweep sent: someone else's
    # (a lower bound: foreign requests still running at the end are not counted).
    cell["foreign_requests"] = max(0, round(finished) - len(results)) if finished is not None else None
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
    missing = [column for column in COLUMNS if column not in cell]
    if missing:  # a check -O keeps: a column of results.csv nothing fills
        raise ValueError(f"a sweep cell lacks the columns {', '.join(missing)}")
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
    read = [(info, capacity_tokens(info), config_number(info, "block_size")) for info in infos]
    live = [(info, tokens, block) for info, tokens, block in read if tokens and block]
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
            budget: int | None = config.kv_budget
            budget_source = "--kv-budget"
            if budget is None:
                memory = config_number(info, "kv_cache_memory_bytes")
                budget = int(memory) if memory else None
                budget_source = "the server's kv_cache_memory_bytes"
            if config.model_config is None:  # the caller reads the config only when one was given
                raise cap.CapacityInputError("no --model-config to size the requests with")
            if budget is None:
                raise cap.CapacityInputError(
                    "the server does not report kv_cache_memory_bytes; give --kv-budget")
            result = cap.compute_capacity(config.model_config, dtype, block, budget, inp, out)
            request = result.requests[0]
            total += request.pool_bound or 0
            steps.extend(request.steps)
            note = (f"computed from {config.model_config_path} ({result.bytes_per_token} B per "
                    f"token, {dtype}) with budget {budget:,} B from {budget_source}, blocks of "
                    f"{block}" + (f", x {len(targets)} engines" if len(targets) > 1 else "")
                    + "; pool bound after block rounding and the null block")
        bounds[(inp, out)] = {"bound": total, "source": "model config", "steps": steps}
    return bounds, note
