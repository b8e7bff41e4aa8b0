"""What `kvwatch sweep` writes: the per-cell CSV and JSON, the per-request CSV,
a short markdown summary and the PNG plots. Each file is replaced atomically
(written beside it, then renamed), so a sweep stopped at any moment leaves
complete files describing the cells measured so far.

matplotlib is imported only when plots are drawn; it comes with the `sweep`
extra (`pip install 'kvwatch[sweep]'`).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable

from kvwatch.snapshot import bounded_text

JSON_FILE = "sweep.json"
CSV_FILE = "sweep.csv"
REQUESTS_FILE = "requests.csv"
SUMMARY_FILE = "summary.md"
TTFT_PLOT = "ttft_p95.png"
KV_PLOT = "kv_usage_peak.png"

# Column -> meaning, in CSV order. docs/sweep.md explains each at length.
COLUMNS: dict[str, str] = {
    "cell": "position of the cell in the grid, from 1",
    "input_tokens": "requested prompt length, tokens",
    "output_tokens": "requested generated tokens per request (max_tokens, sent with ignore_eos)",
    "concurrency": "requests the client keeps in flight",
    "requests_sent": "requests started in the cell",
    "completed": "requests whose stream ended with a finish_reason or [DONE]",
    "failed": "requests that got an HTTP error, an error event, a broken stream or a timeout",
    "seconds": "wall time from the first request sent to the last one ended",
    "client_ttft_p50_s": "median time from sending a request to its first chunk of generated output (completed requests)",
    "client_ttft_p95_s": "95th percentile of the same",
    "client_latency_p50_s": "median time from sending a request to the end of its stream",
    "client_latency_p95_s": "95th percentile of the same",
    "engine_ttft_p50_s": "median of vLLM's time_to_first_token histogram over the cell (bucket-interpolated)",
    "engine_ttft_p95_s": "95th percentile of the same",
    "engine_ttft_mean_s": "mean of the same (histogram sum / count)",
    "engine_ttft_count": "observations the TTFT histogram gained in the cell",
    "peak_kv_usage": "highest KV cache usage (0-1) any poll saw in the cell",
    "peak_running": "highest num_requests_running any poll saw (summed over engines)",
    "peak_waiting": "highest num_requests_waiting any poll saw (summed over engines)",
    "capacity_bound": "requests of this length the KV pool holds (kvwatch capacity, after block rounding)",
    "capacity_source": "where the bound came from: the model config or the server's cache_config_info",
    "preemptions": "increase of vLLM's num_preemptions over the cell",
    "engine_finished": "increase of vLLM's request_success over the cell (all finish reasons)",
    "foreign_requests": "requests the server finished in the cell beyond those the sweep sent: other traffic, "
                        "which the cell's engine figures (prompt tokens per request, TTFT, peaks) include",
    "prompt_tokens_mean": "prompt tokens per finished request, from the server's counters",
    "prompt_tokens_client_mean": "prompt tokens per completed request, from the responses' usage",
    "prompt_tokens_per_s": "increase of the server's prompt_tokens counter / seconds",
    "generation_tokens_per_s": "increase of the server's generation_tokens counter / seconds",
    "client_prompt_tokens_per_s": "prompt tokens of completed requests (usage) / seconds",
    "client_generation_tokens_per_s": "generated tokens the client received (usage, else chunks) / seconds",
    "polls": "successful /metrics polls in the cell",
    "poll_errors": "failed /metrics polls in the cell",
    "first_error": "the first request error of the cell, if any",
}

REQUEST_COLUMNS = ("cell", "input_tokens", "output_tokens", "concurrency", "index", "start_s", "ok",
                   "ttft_s", "latency_s", "prompt_tokens", "completion_tokens", "chunks",
                   "finish_reason", "error")


def _atomic_write(path: Path, text: str | bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    if isinstance(text, bytes):
        with open(temporary, "wb") as binary:
            binary.write(text)
    else:
        with open(temporary, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
    os.replace(temporary, path)


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def write_results(out_dir: Path, report: dict[str, Any]) -> None:
    """sweep.json, sweep.csv and summary.md for the cells measured so far."""
    _atomic_write(out_dir / JSON_FILE, json.dumps(report, indent=2, sort_keys=False) + "\n")
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(COLUMNS)
    for cell in report["cells"]:
        writer.writerow([_csv_value(cell.get(column)) for column in COLUMNS])
    _atomic_write(out_dir / CSV_FILE, buffer.getvalue())
    _atomic_write(out_dir / SUMMARY_FILE, render_summary(report))


def append_requests(out_dir: Path, rows: Iterable[dict[str, Any]], first: bool) -> None:
    """Add one cell's requests to requests.csv (created on the first cell)."""
    path = out_dir / REQUESTS_FILE
    with open(path, "w" if first else "a", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        if first:
            writer.writerow(REQUEST_COLUMNS)
        for row in rows:
            writer.writerow([_csv_value(row.get(column)) for column in REQUEST_COLUMNS])


# ---------------------------------------------------------------------------
# Markdown.


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _quantile_text(cell: dict[str, Any], key: str) -> str:
    """An engine quantile pinned at a bucket edge only says 'at most' or 'at
    least': written as kvwatch writes a bound everywhere ("< 0.1", "> 5")."""
    text = _fmt(cell.get(key))
    return text if text == "-" else bounded_text(text, cell.get(f"{key}_pinned"))


def render_summary(report: dict[str, Any]) -> str:
    server = report["server"]
    config = report["config"]
    cells = report["cells"]
    lines = ["# kvwatch sweep", ""]
    lines.append(f"- server: {server['base_url']} (metrics {server['metrics_url']}), "
                 f"model `{config['model']}`")
    lines.append(f"- started {report['started_at']}, "
                 + (f"finished {report['finished_at']}" if report.get("finished_at") else "running"))
    per_cell = (f"{config['requests']} requests" if config.get("requests")
                else f"{config['duration_s']:g} s")
    lines.append(f"- grid: input {config['input_tokens']} x output {config['output_tokens']} x "
                 f"concurrency {config['concurrency']}, {per_cell} per cell; "
                 f"{len(cells)} of {report['planned_cells']} cells measured")
    lines.append(f"- prompts: {server.get('prompt_method', '-')}")
    if server.get("capacity_note"):
        lines.append(f"- capacity bound: {server['capacity_note']}")
    probe = report.get("quality_probe")
    if isinstance(probe, dict):
        answered = sum(1 for entry in probe.get("results", []) if entry.get("error") is None)
        lines.append(f"- quality probe: {probe.get('status')}, {answered} of "
                     f"{len(probe.get('results', []))} greedy prompts answered (in sweep.json; "
                     "`kvwatch sweep --compare` sets two sweeps' answers side by side)")
    if config.get("baseline"):
        lines.append(f"- baseline: {config['baseline']} (see compare.md)")
    if report.get("interrupted"):
        lines.append("- **interrupted**: the sweep was stopped; the cells below are complete, the "
                     "one running at the stop was dropped")
    lines.append("")
    if cells:
        headers = ["in", "out", "conc", "ok", "fail", "TTFT p50 (client)", "TTFT p95 (client)",
                   "TTFT p95 (engine)", "peak KV", "peak running", "bound", "preempt",
                   "prompt tok (engine)", "gen tok/s"]
        lines.append("| " + " | ".join(headers) + " |")
        lines.append("|" + "---|" * len(headers))
        for cell in cells:
            row = [cell["input_tokens"], cell["output_tokens"], cell["concurrency"],
                   cell["completed"], cell["failed"], _fmt(cell.get("client_ttft_p50_s")),
                   _fmt(cell.get("client_ttft_p95_s")), _quantile_text(cell, "engine_ttft_p95_s"),
                   _fmt(cell.get("peak_kv_usage")), _fmt(cell.get("peak_running")),
                   _fmt(cell.get("capacity_bound")), _fmt(cell.get("preemptions")),
                   _fmt(cell.get("prompt_tokens_mean"), 4),
                   _fmt(cell.get("generation_tokens_per_s"))]
            lines.append("| " + " | ".join(str(v) for v in row) + " |")
        lines.append("")
    notes = list(report.get("notes", []))
    if notes:
        lines.append("Notes:")
        lines += [f"- {note}" for note in notes]
        lines.append("")
    lines.append("Times are seconds. Client TTFT includes the network and the server's HTTP "
                 "layer; engine TTFT comes from vLLM's histogram buckets, so its quantiles are "
                 "interpolated; \"<\" and \">\" mark a quantile pinned at a bucket edge, at most "
                 "the first bound or at least the last finite one. Peaks are what "
                 "the /metrics polls saw, every "
                 f"{config['poll_interval_s']:g} s; a shorter peak between polls is missed. "
                 "The bound is arithmetic on the KV pool at the requested lengths, not a "
                 "promise (see docs/capacity.md).")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# Plots.


def write_plots(out_dir: Path, cells: list[dict[str, Any]]) -> list[Path]:
    """TTFT p95 and peak KV usage against concurrency, one line per (input,
    output) length. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    lengths: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for cell in cells:
        lengths.setdefault((cell["input_tokens"], cell["output_tokens"]), []).append(cell)
    levels = sorted({cell["concurrency"] for cell in cells})
    written = []
    for name, title, key, engine_key, ylabel in (
        (TTFT_PLOT, "Time to first token, p95 (solid: client, dashed: engine)",
         "client_ttft_p95_s", "engine_ttft_p95_s",
         "seconds"),
        (KV_PLOT, "Peak KV cache usage", "peak_kv_usage", None, "KV usage (0-1)"),
    ):
        figure, axes = plt.subplots(figsize=(7, 4.5), dpi=110)
        for index, ((inp, out), group) in enumerate(sorted(lengths.items())):
            group = sorted(group, key=lambda c: c["concurrency"])
            color = f"C{index % 10}"
            points = [(c["concurrency"], c[key]) for c in group if c.get(key) is not None]
            if points:
                axes.plot(*zip(*points), marker="o", color=color, label=f"in {inp} / out {out}")
            if engine_key:
                engine = [(c["concurrency"], c[engine_key]) for c in group
                          if c.get(engine_key) is not None]
                if engine:
                    axes.plot(*zip(*engine), marker="x", linestyle="--", color=color,
                              label=f"in {inp} / out {out} (engine)")
        _atomic_write(out_dir / name, finish_plot(plt, figure, axes, levels, key, title, ylabel, bool(lengths)))
        written.append(out_dir / name)
    return written


def finish_plot(plt, figure, axes, levels: list[int], key: str, title: str, ylabel: str, legend: bool) -> bytes:
    """The sweep's plots' common axes (concurrency on x, log2 when the levels
    span 8x or more; usage capped just above 1), then the PNG bytes."""
    if levels:
        if levels[-1] >= 8 * levels[0]:
            axes.set_xscale("log", base=2)
        axes.set_xticks(levels)
        axes.set_xticklabels([str(level) for level in levels])
    axes.set_xlabel("concurrency (requests in flight)")
    axes.set_ylabel(ylabel)
    if key == "peak_kv_usage":
        axes.set_ylim(0, 1.05)
        axes.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    else:
        axes.set_ylim(bottom=0)
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    if legend:
        axes.legend(fontsize="small")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()
