"""`kvwatch capacity`: how many requests a KV budget holds, with the arithmetic
shown. Reads a local config.json or a live vLLM's /metrics, calls the
arithmetic in kvwatch/capacity/arithmetic.py, prints a table or JSON.

A live target is read through kvwatch.capacity.live: the sidecar's fetcher
and adapter, so every vLLM spelling the sidecar knows works here too.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any, cast

from kvwatch.capacity import arithmetic as cap
from kvwatch.capacity import hardware, live
from kvwatch.capacity.arithmetic import CapacityInputError
from kvwatch.capacity.model_config import load_model_config
from kvwatch.present import printable, public_host
from kvwatch.routing.tenants import lora_rows
from kvwatch.stream_report import KVEventsReport
from kvwatch.units import parse_duration
from kvwatch.signals import worth

DEFAULT_BLOCK_SIZE = 16  # vLLM's default block size on GPUs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-config", metavar="PATH",
                        help="the model's config.json (a local file or the folder holding it)")
    parser.add_argument("--kv-dtype", default="auto", metavar="DTYPE",
                        help="KV cache dtype: " + "|".join(cap.KV_DTYPE_CHOICES)
                        + " (auto = the config's torch_dtype; default auto)")
    parser.add_argument("--kv-budget", metavar="SIZE",
                        help="bytes left for the KV cache after weights and runtime memory, e.g. "
                        "3GiB (binary) or 3GB (decimal) or plain bytes")
    parser.add_argument("--block-size", type=int, default=None, metavar="TOKENS",
                        help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE}, vLLM's GPU "
                        "default; with --target, the target's own)")
    parser.add_argument("--input-tokens", metavar="N|DIST",
                        help="prompt tokens per request: 2048, or p50=512,p95=2048")
    parser.add_argument("--output-tokens", metavar="N|DIST",
                        help="generated tokens per request: 1024, or p50=256,p95=1024")
    parser.add_argument("--per-request-bytes", metavar="SIZE",
                        help="KV bytes per request given directly (e.g. 384MiB) instead of a "
                        "model config and lengths")
    parser.add_argument("--target", metavar="URL",
                        help="a live vLLM (http://host:8000 or its /metrics URL): read the "
                        "capacity it reports instead of, or to compare with, a budget")
    hw = parser.add_argument_group(
        "KV budget from the hardware (instead of --kv-budget; needs --model-config)")
    hw.add_argument("--gpu-memory", metavar="SIZE",
                    help="memory of one GPU as the card reports it, e.g. 80GiB")
    hw.add_argument("--gpu-memory-utilization", metavar="SHARE", default=None,
                    help="vLLM's --gpu-memory-utilization (default "
                    f"{hardware.DEFAULT_GPU_MEMORY_UTILIZATION}, vLLM's default)")
    hw.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                    help="vLLM's --tensor-parallel-size: GPUs per replica (default 1)")
    hw.add_argument("--runtime-reserve", metavar="SIZE", default=None,
                    help="memory per GPU vLLM keeps for activations, CUDA graphs and the "
                    f"runtime (default {hardware.DEFAULT_RUNTIME_RESERVE}, a round figure: vLLM "
                    "measures it at start-up)")
    hw.add_argument("--weights-bytes", metavar="SIZE", default=None,
                    help="weights per GPU given directly (quantized checkpoints, unusual "
                    "layers) instead of counted from the config")
    parser.add_argument("--kvwatch", metavar="URL",
                        help="a running kvwatch reading the engine's KV-cache events (serve --kv-events), e.g. "
                        "http://127.0.0.1:9400: print its sizing curve, the extra cache that would have kept the "
                        "blocks stored again after their eviction, estimated from the stream")
    needed = parser.add_argument_group(
        "what an objective needs, from history (--prometheus, as kvwatch diagnose --prometheus)")
    needed.add_argument("--prometheus", metavar="URL",
                        help="a Prometheus-compatible query API holding vLLM's series: invert --ttft-p95 over its "
                        "history into the replicas or KV cache per replica the observed peak needs")
    needed.add_argument("--ttft-p95", metavar="SECONDS", help="the objective: first-token p95 under this, e.g. 2s")
    needed.add_argument("--since", default="6h", help="range ending now (default 6h)")
    needed.add_argument("--from", dest="from_", metavar="TIME", help="range start: Unix seconds or RFC 3339")
    needed.add_argument("--to", metavar="TIME", help="range end: Unix seconds or RFC 3339 (default now)")
    needed.add_argument("--step", help="time between points (default: from the range, at least 15s)")
    needed.add_argument("--rate-window", default="5m", help="the first-token p95's rate window (default 5m)")
    needed.add_argument("--selector", default="", help="label selector of the series, e.g. '{namespace=\"llm\"}'")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _lengths(args: argparse.Namespace) -> tuple[Any, Any]:
    if args.input_tokens is None or args.output_tokens is None:
        raise CapacityInputError(
            "--input-tokens and --output-tokens are both needed to size a request "
            "(use --output-tokens 0 to count the prompt only)")
    inputs = cap.parse_token_lengths(args.input_tokens)
    outputs = cap.parse_token_lengths(args.output_tokens)
    cap.combine_lengths(inputs, outputs)  # validates before any network or file work
    return inputs, outputs


def _check_dtype(kv_dtype: str) -> str:
    kv_dtype = kv_dtype.lower()
    if kv_dtype not in cap.KV_DTYPE_CHOICES:
        raise CapacityInputError(
            f"--kv-dtype {kv_dtype!r} is not one of {', '.join(cap.KV_DTYPE_CHOICES)}")
    return kv_dtype


_HARDWARE_FLAGS = (("--gpu-memory-utilization", "gpu_memory_utilization"),
                   ("--tensor-parallel-size", "tensor_parallel_size"),
                   ("--runtime-reserve", "runtime_reserve"), ("--weights-bytes", "weights_bytes"))


def _check_hardware_flags(args: argparse.Namespace) -> None:
    given = [flag for flag, attr in _HARDWARE_FLAGS if getattr(args, attr, None) is not None]
    if given and getattr(args, "gpu_memory", None) is None:
        raise CapacityInputError(f"{', '.join(given)} needs --gpu-memory (the memory of "
                                 "one GPU) to size the KV budget from the hardware")


def _hardware_budget(args: argparse.Namespace,
                     config: dict[str, Any] | None) -> hardware.HardwareBudget | None:
    """The KV budget from --gpu-memory and its companions, or None without it."""
    _check_hardware_flags(args)
    if getattr(args, "gpu_memory", None) is None:
        return None
    if args.kv_budget is not None:
        raise CapacityInputError("give --kv-budget (the KV pool itself) or --gpu-memory (to "
                                 "derive it from the hardware), not both")
    if config is None:
        raise CapacityInputError("--gpu-memory needs --model-config: the weights and the KV "
                                 "layout come from it")
    size = lambda text: cap.parse_size(text) if text is not None else None  # noqa: E731
    return hardware.hardware_budget(
        config, cap.parse_size(args.gpu_memory),
        args.gpu_memory_utilization or hardware.DEFAULT_GPU_MEMORY_UTILIZATION,
        args.tensor_parallel_size if args.tensor_parallel_size is not None else 1,
        size(args.runtime_reserve), size(args.weights_bytes))


def _ignores(hw: hardware.HardwareBudget | None) -> list[str]:
    if hw is None:
        return list(cap.IGNORED)
    # The budget's reserves are its own terms now; what they leave out replaces
    # the warning that a budget must already exclude them.
    return [item for item in cap.IGNORED if not item.startswith("Reserves:")] \
        + list(hardware.IGNORED)


def build_report(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the command prints, as one JSON-ready dict."""
    if getattr(args, "kvwatch", None):
        return _stream_report(args.kvwatch)
    if getattr(args, "prometheus", None):
        return _needed_report(args)
    kv_dtype = _check_dtype(args.kv_dtype)
    if args.block_size is not None and args.block_size <= 0:
        raise CapacityInputError(f"--block-size must be a positive integer, got {args.block_size}")
    budget = cap.parse_size(args.kv_budget) if args.kv_budget is not None else None
    _check_hardware_flags(args)
    if getattr(args, "gpu_memory", None) is not None and args.per_request_bytes is not None:
        raise CapacityInputError("--gpu-memory sizes the budget from a model config; "
                                 "--per-request-bytes has none: drop one of them")

    if args.per_request_bytes is not None:
        clashes = [flag for flag, value in (("--model-config", args.model_config),
                                            ("--target", args.target),
                                            ("--input-tokens", args.input_tokens),
                                            ("--output-tokens", args.output_tokens))
                   if value is not None]
        if clashes:
            raise CapacityInputError(
                "--per-request-bytes gives the bytes per request directly; drop "
                + ", ".join(clashes))
        if budget is None:
            raise CapacityInputError("--per-request-bytes needs --kv-budget")
        per_request = cap.parse_size(args.per_request_bytes)
        result = cap.capacity_from_request_bytes(budget, per_request)
        return {"mode": "per-request-bytes", "result": result.to_dict(), "live": None}

    if args.target is None and args.model_config is None:
        raise CapacityInputError(
            "give --model-config with --kv-budget, or --target URL, or --kv-budget with "
            "--per-request-bytes")
    if args.target is None and budget is None and getattr(args, "gpu_memory", None) is None:
        raise CapacityInputError(
            "--model-config needs --kv-budget (the bytes left for the KV cache), --gpu-memory "
            "(to derive it from the hardware), or --target to read the capacity from a live vLLM")
    inputs, outputs = _lengths(args)
    config = load_model_config(args.model_config) if args.model_config is not None else None
    hw = _hardware_budget(args, config)
    budget_source = "--kv-budget"
    if hw is not None:
        budget, budget_source = hw.kv_budget_bytes, "--gpu-memory, from the hardware"

    if args.target is None:
        if config is None or budget is None:  # both required above
            raise CapacityInputError("--model-config and a KV budget are needed without --target")
        block_size = args.block_size or DEFAULT_BLOCK_SIZE
        result = cap.compute_capacity(config, kv_dtype, block_size, budget, inputs, outputs)
        result.ignores = _ignores(hw)
        return {"mode": "config", "result": result.to_dict(), "live": None,
                "hardware": hw.to_dict() if hw else None}
    report = _live_report(args, config, kv_dtype, budget, inputs, outputs, budget_source)
    report["hardware"] = hw.to_dict() if hw else None
    report["ignores"] = _ignores(hw)
    return report


def _flag(flag: str, parse: Callable[[str], float], text: str) -> float:
    """A flag's value parsed, or one sentence naming that flag alone."""
    try:
        return parse(text)
    except ValueError as exc:
        raise CapacityInputError(f"{flag}: {exc}") from None


def _needed_range(args: argparse.Namespace) -> tuple[float, float, float, float]:
    """(objective, start, end, step) from the flags, or one sentence of what is wrong."""
    from kvwatch.commands.diagnose import _time
    from kvwatch.history.query import check_selector, choose_step

    if args.ttft_p95 is None:
        raise CapacityInputError("--prometheus needs the objective: --ttft-p95 SECONDS (first-token p95 under it)")
    objective = _flag("--ttft-p95", parse_duration, args.ttft_p95)
    end = _flag("--to", _time, args.to) if args.to else time.time()
    start = _flag("--from", _time, args.from_) if args.from_ else end - _flag("--since", parse_duration, args.since)
    step = _flag("--step", parse_duration, args.step) if args.step else choose_step(start, end)
    _flag("--rate-window", parse_duration, args.rate_window)
    problem = check_selector(args.selector)
    if problem or objective <= 0 or start >= end:
        raise CapacityInputError(problem or ("--ttft-p95 must be above 0" if objective <= 0 else
                                             "the range is empty: --from must be before --to"))
    return objective, start, end, step


def _needed_report(args: argparse.Namespace) -> dict[str, Any]:
    """What the objective needs at the observed peak, per model, from the store's history."""
    from kvwatch.capacity import needed
    from kvwatch.history import needed as history
    from kvwatch.history.query import PrometheusClient, QueryError

    objective, start, end, step = _needed_range(args)
    client = PrometheusClient(args.prometheus, timeout=live.FETCH_TIMEOUT_S * 4)
    try:
        shape = history.read_shape(client, start, end, args.selector)
        steps = history.read_steps(client, start, end, step, args.selector, args.rate_window) if shape else {}
    except QueryError as exc:
        raise CapacityInputError(f"cannot read {args.prometheus}: {exc}") from None
    if shape is None:
        raise CapacityInputError(f"{args.prometheus} holds no vllm:cache_config_info stating num_gpu_blocks in "
                                 "the range: nothing to size the cache from")
    results = [needed.needed(model, model_steps, objective, shape) for model, model_steps in sorted(steps.items())]
    return {"mode": "needed", "prometheus": args.prometheus, "start": start, "end": end, "step": step,
            "objective_ttft_p95_seconds": objective, "models": results}


# Nothing listens at --kvwatch's address (scrape.SENTENCES' "refused", about kvwatch).
KVWATCH_REFUSED = "connection refused by {host}: nothing listens there (is kvwatch running, and on that port?)"


def _stream_report(url: str) -> dict[str, Any]:
    """The sizing curve a running kvwatch estimates from the engine's
    KV-cache events (kvwatch/kvevents/source.py: sizing_curve)."""
    from kvwatch.scrape import Fetcher

    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise CapacityInputError(f"--kvwatch {url!r} is not an http(s) URL")
    api = base if base.endswith("/api/v1/diagnosis") else base + "/api/v1/diagnosis"
    class JsonFetcher(Fetcher):
        whole_lines = False  # JSON, not the text format: the byte cap and the deadline are the bounds

    result = JsonFetcher(api, live.FETCH_TIMEOUT_S, live.FETCH_MAX_BYTES).fetch()
    if not result.ok:
        # The fetcher's sentence (as kvwatch diagnose says it), but with a hint
        # about kvwatch where nothing listens: its hint is about an engine.
        sentence = KVWATCH_REFUSED.format(host=public_host(api)) if result.reason == "refused" else result.sentence
        raise CapacityInputError(f"cannot fetch {api}: {sentence}")
    try:
        diagnosis = json.loads(result.text or "")
    except (ValueError, RecursionError):  # RecursionError: brackets nested thousands deep
        raise CapacityInputError(f"{api} did not answer with kvwatch's JSON") from None
    stream = diagnosis.get("kv_events") if isinstance(diagnosis, dict) else None
    if not isinstance(stream, dict):
        raise CapacityInputError(f"the kvwatch at {base} does not read KV-cache events (start it with --kv-events)")
    if not stream.get("up"):
        raise CapacityInputError(f"the kvwatch at {base} has no KV-cache events yet: {printable(stream.get('detail'))}")
    sizing = stream.get("sizing") or {}
    window = stream.get("window") or {}
    wrong = _stream_shape_problem(stream, window, sizing)
    if wrong:
        raise CapacityInputError(f"{api} is not kvwatch's diagnosis: its kv_events {wrong}")
    return {"mode": "kv-events", "kvwatch": base, "window": window, "sizing": sizing,
            "block_size": stream.get("block_size"), "sampling_rate": (stream.get("table") or {}).get("sampling_rate"),
            "page_engine": stream.get("page_engine"),
            # Lost per LoRA adapter, as that kvwatch's own worth section splits it (its shape checked above).
            "lost_by_tenant": worth.lost_by_tenant(lora_rows(cast(KVEventsReport, stream)), worth.priced_rate(stream))}


_STREAM_NUMBERS = {"window": ("seconds", "stored", "stored_again", "stored_again_ratio", "lost_prefill_seconds",
                              "prefill_seconds_per_token", "tokens_per_block"),
                   "sizing": ("hit_ratio_now", "cache_blocks"), "stream": ("block_size",)}
# A row of the window's blocks by medium and adapter (KVEventsLabelRow): its numbers and its names.
_LABEL_NUMBERS, _LABEL_NAMES = ("stored", "stored_again", "reused"), ("medium", "lora_name")
_POINT_NUMBERS = ("extra_cache", "extra_blocks", "extra_bytes", "blocks_kept", "recomputation_avoided_ratio",
                  "hit_ratio", "extra_gib", "saved_prefill_seconds_per_hour")


def _stream_shape_problem(stream: dict, window: Any, sizing: Any) -> str | None:
    """What in a kvwatch's kv_events answer is not of the shape printed
    (a number where one is printed, finite; lists and objects where they
    are read), or None."""
    parts = {"window": window, "sizing": sizing, "page_engine": stream.get("page_engine") or {},
             "table": stream.get("table") or {}, "stream": stream}
    for name, part in parts.items():
        if not isinstance(part, dict):
            return f"{name} is not an object"
    for name, keys in _STREAM_NUMBERS.items():
        for key in keys:
            if not _number_or_none(parts[name].get(key)):
                return f"{name}.{key} is not a finite number"
    if not _number_or_none(parts["table"].get("sampling_rate")) or not isinstance(sizing.get("note") or "", str):
        return "table.sampling_rate or sizing.note is not of its type"
    rows = window.get("by_label") or []
    if not isinstance(rows, list) or not all(
            isinstance(row, dict) and all(_number_or_none(row.get(key)) for key in _LABEL_NUMBERS)
            and all(isinstance(row.get(key), (str, type(None))) for key in _LABEL_NAMES) for row in rows):
        return "window.by_label is not a list of rows of names and finite numbers"
    points = sizing.get("points") or []
    if not isinstance(points, list) or not all(isinstance(point, dict) for point in points):
        return "sizing.points is not a list of objects"
    knee = sizing.get("diminishing_returns")
    if knee is not None and not (isinstance(knee, dict) and knee.get("extra_cache") is not None
                                 and all(_number_or_none(knee.get(key)) for key in _POINT_NUMBERS)):
        return "sizing.diminishing_returns is not a point of finite numbers"
    for point in points:
        if not all(_number_or_none(point.get(key)) for key in _POINT_NUMBERS) or point.get("extra_cache") is None \
                or point.get("extra_blocks") is None or point.get("blocks_kept") is None:
            return "sizing.points holds a point whose figures are not finite numbers"
    return None


def _number_or_none(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer of hundreds of digits
        return False


def _per_hour(value: float | None) -> str:
    """Seconds per hour as the sentences below the table write them."""
    return "-" if value is None else worth.figure(value)


def _stream_lines(report: dict[str, Any]) -> list[str]:
    window, sizing = report["window"], report["sizing"]
    out = [f"kvwatch at {report['kvwatch']}, engine {((report.get('page_engine') or {}).get('engine'))}: over the "
           f"last {window.get('seconds') or 0:.0f}s, {window.get('stored', 0):,} blocks stored, "
           f"{window.get('stored_again') or 0:,.0f} of them stored again after their eviction "
           f"({(window.get('stored_again_ratio') or 0):.0%})"
           + (f", hit ratio {sizing['hit_ratio_now']:.1%} (the page's)" if sizing.get("hit_ratio_now") is not None
              else ""), ""]
    rows = [["extra cache", "extra blocks", "extra bytes", "blocks kept", "recomputation avoided", "hit ratio",
             "prefill s/h bought"]]
    for point in sizing.get("points") or []:
        rows.append([f"x{point['extra_cache']:g}", _n(point["extra_blocks"]),
                     f"{point['extra_bytes'] / 2**20:,.0f} MiB" if point.get("extra_bytes") is not None else "-",
                     _n(round(point["blocks_kept"])),
                     f"{point['recomputation_avoided_ratio']:.0%}" if point.get("recomputation_avoided_ratio")
                     is not None else "-",
                     f"{point['hit_ratio']:.1%}" if point.get("hit_ratio") is not None else "-",
                     _per_hour(point.get("saved_prefill_seconds_per_hour"))])
    out += _table(rows[0], rows[1:])
    out += [""] + worth.stream_lines(window, sizing)
    adapters = worth.tenants_line(report.get("lost_by_tenant"))
    if adapters:
        out.append(adapters)
    note = sizing.get("note") or ""
    # The note is a clause ("an estimate: ..."): here it opens a sentence.
    out += ["", f"Cache now: {_n(round(sizing.get('cache_blocks') or 0))} blocks."
            + (f" {note[:1].upper()}{note[1:].rstrip('.')}." if note else "")]
    if report.get("sampling_rate") not in (None, 1, 1.0):
        out.append(f"The ledger sampled {report['sampling_rate']:.3g} of the hash space; counts are scaled from it.")
    return out


def _live_report(args, config, kv_dtype, budget, inputs, outputs,
                 budget_source_given="--kv-budget") -> dict[str, Any]:
    url = live.metrics_url(args.target)
    reported = live.read_live_capacity(live.fetch_page(url))
    if not reported["engines"]:
        if reported["engine"] == "vllm":
            raise CapacityInputError(
                f"{url} has no vllm:cache_config_info; is it a vLLM with stats logging on?")
        raise CapacityInputError(
            f"{url} is {reported['engine']}'s page and states no KV capacity; it cannot provide "
            + ", ".join(name[len("kvwatch_"):] for name in reported["dark_signals"]))
    engines = []
    result_dict = None
    notes = []
    if budget is not None and config is None:
        notes.append("--kv-budget is not used without --model-config: the bytes per token "
                     "needed to turn it into blocks come from the config")
    for info in reported["engines"]:
        entry: dict[str, Any] = {"reported": info}
        if info["capacity_tokens"] is None or not info["block_size"]:
            entry["error"] = "cache_config_info lacks num_gpu_blocks or block_size"
            engines.append(entry)
            continue
        block_size = info["block_size"]
        if args.block_size is not None and args.block_size != block_size:
            notes.append(f"engine {info['engine']} reports block_size {block_size}; it is used "
                         f"instead of --block-size {args.block_size}")
        if (info["num_gpu_blocks"] is not None and info["kv_cache_size_tokens"] is not None
                and info["num_gpu_blocks"] * block_size != info["kv_cache_size_tokens"]):
            notes.append(
                f"engine {info['engine']}: num_gpu_blocks x block_size = "
                f"{info['num_gpu_blocks'] * block_size} but kv_cache_size_tokens = "
                f"{info['kv_cache_size_tokens']}; the latter is vLLM's own group-aware figure "
                "(hybrid or MLA models) and is used")
        entry["bounds_from_reported"] = cap.live_bounds(info["capacity_tokens"], block_size,
                                                        inputs, outputs)
        entry["observed"] = cap.observed_occupancy(
            info["num_requests_running"], info["kv_cache_usage"], info["capacity_tokens"],
            block_size)
        if config is not None:
            dtype = kv_dtype
            reported_dtype = (info["cache_dtype"] or "auto").lower()
            if dtype == "auto" and reported_dtype != "auto":
                if reported_dtype in cap.DTYPE_BYTES:
                    dtype = reported_dtype
                else:
                    notes.append(f"engine {info['engine']} reports cache_dtype {reported_dtype}, "
                                 "which kvwatch does not size; computed with the model's "
                                 "torch_dtype instead (pass --kv-dtype to choose)")
            if budget is not None:
                engine_budget, budget_source = budget, budget_source_given
            elif info["kv_cache_memory_bytes"]:
                engine_budget, budget_source = info["kv_cache_memory_bytes"], \
                    "kv_cache_memory_bytes reported by the target"
            else:
                engine_budget, budget_source = None, None
            if engine_budget is None:
                structure = cap.kv_structure(config, dtype)
                engine_budget = info["capacity_tokens"] * structure.bytes_per_token
                budget_source = ("implied: reported capacity x computed bytes per token "
                                 "(no independent budget, so no comparison)")
            result = cap.compute_capacity(config, dtype, block_size, engine_budget, inputs,
                                          outputs)
            result_dict = result_dict or result.to_dict()
            entry["computed"] = {"budget_bytes": engine_budget, "budget_source": budget_source,
                                 "result": result.to_dict()}
            if not budget_source.startswith("implied") and result.pool_blocks is not None \
                    and result.pool_tokens is not None:
                entry["comparison"] = cap.compare_pools(
                    result.pool_blocks, result.pool_tokens, info["num_gpu_blocks"],
                    info["capacity_tokens"])
        engines.append(entry)
    return {"mode": "target", "target": url, "engine": reported["engine"],
            "dark_signals": reported["dark_signals"], "engines": engines, "notes": notes,
            "result": result_dict, "ignores": list(cap.IGNORED)}


def run(args: argparse.Namespace) -> int:
    try:
        report = build_report(args)
    except CapacityInputError as error:
        print(printable(f"kvwatch capacity: error: {error}"), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        # Labels and notes come from the engine or a kvwatch: printed as text, never as escapes.
        print(printable(render_table(report), keep_lines=True))
    return 0


# ---------------------------------------------------------------------------
# Text output.


def _n(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _result_lines(result: dict[str, Any]) -> list[str]:
    out = ["How it is derived:"]
    out += [f"  {step}" for step in result["steps"]]
    out.append("")
    budget = result["kv_budget_bytes"]
    out.append(f"KV budget: {_n(budget)} B ({cap.human_bytes(budget)})"
               + (f"; bytes per token: {_n(result['bytes_per_token'])} B" if
                  result["bytes_per_token"] else "")
               + (f"; block size: {result['block_size']} tokens" if result["block_size"] else ""))
    headers = ["length", "tokens", "bytes/request", "simple bound", "blocks", "rounded bytes",
               "rounded bound", "pool bound (null block)"]
    has_state = any(r["state_bytes_per_request"] is not None for r in result["requests"])
    if has_state:
        headers.append("with state")
    rows = []
    for r in result["requests"]:
        blocks = r["full_layer_blocks"]
        if r["sliding_layer_blocks"] is not None:
            blocks = f"{blocks}/{r['sliding_layer_blocks']}"
        row = [r["label"], _n(r["tokens"]), _n(r["bytes_per_request"]), _n(r["simple_bound"]),
               _n(blocks), _n(r["rounded_bytes_per_request"]), _n(r["rounded_bound"]),
               _n(r["pool_bound"])]
        if has_state:
            row.append(_n(r["bound_with_state"]))
        rows.append(row)
    keep = [i for i in range(len(headers)) if any(row[i] != "-" for row in rows)]
    out += _table([headers[i] for i in keep], [[row[i] for i in keep] for row in rows])
    if any(r["sliding_layer_blocks"] is not None for r in result["requests"]):
        out.append("(blocks: per full-attention layer / per sliding-window layer)")
    return out


def _hardware_lines(hw: dict[str, Any]) -> list[str]:
    """The KV budget's terms, one row each, then the weights by group."""
    tp = hw["tensor_parallel_size"]
    out = [f"KV budget from the hardware (per GPU, tensor parallel size {tp}):"]
    rows = [
        ["gpu memory", _n(hw["gpu_memory_bytes"]), cap.human_bytes(hw["gpu_memory_bytes"]),
         "--gpu-memory"],
        ["x utilization", _n(hw["usable_bytes_per_gpu"]),
         cap.human_bytes(hw["usable_bytes_per_gpu"]),
         f"x {hw['gpu_memory_utilization']} (--gpu-memory-utilization)"],
        ["- weights", _n(hw["weights_bytes_per_gpu"]),
         cap.human_bytes(hw["weights_bytes_per_gpu"]), hw["weights_source"]],
        ["- runtime reserve", _n(hw["runtime_reserve_bytes"]),
         cap.human_bytes(hw["runtime_reserve_bytes"]), hw["runtime_reserve_source"]],
        ["= KV per GPU", _n(hw["kv_budget_per_gpu"]),
         cap.human_bytes(hw["kv_budget_per_gpu"]), ""],
        ["KV budget of the replica", _n(hw["kv_budget_bytes"]),
         cap.human_bytes(hw["kv_budget_bytes"]),
         f"x {hw['kv_shards']} rank(s) holding different KV"],
    ]
    # The source column is text: left-aligned after the numbers.
    table = _table(["term", "bytes", "binary units"], [row[:3] for row in rows])
    sources = ["from", "----"] + [row[3] for row in rows]
    out += [f"  {line}  {source}".rstrip() for line, source in zip(table, sources)]
    weights = hw["weights"]
    if weights:
        out.append("")
        out.append(f"Weights from the config's shapes ({weights['dtype']}, "
                   f"{weights['dtype_bytes']} B per parameter):")
        rows = [[t["name"], _n(t["parameters"]), _n(t["per_gpu_parameters"]), t["split"]]
                for t in weights["terms"]]
        rows.append(["total", _n(weights["parameters"]), _n(weights["per_gpu_parameters"]),
                     f"{weights['parameters'] / 1e9:.2f} B parameters"])
        out += ["  " + line for line in _table(["group", "parameters", "on one GPU", "split"],
                                                rows)]
    out.append("  how:")
    out += [f"    {step}" for step in hw["steps"]]
    out += [f"  note: {note}" for note in hw["notes"]]
    out.append("")
    return out


def _bound_of(row: dict[str, Any]) -> int | None:
    """A row's answer: the tightest bound it has (with a hybrid model's state,
    else the pool's with block rounding and the null block, else the simple one)."""
    for key in ("bound_with_state", "pool_bound", "rounded_bound", "simple_bound", "bound"):
        if row.get(key) is not None:
            return row[key]
    return None


def answer_line(report: dict[str, Any]) -> str:
    """The answer in one line, before the working: how many requests of each
    length fit."""
    if report["mode"] != "target":
        result = report["result"]
        rows = result["requests"]
        budget = f" in a KV budget of {cap.human_bytes(result['kv_budget_bytes'])}"
        where = ""
    else:
        entries = [e for e in report["engines"] if "error" not in e]
        if not entries:
            return "Answer: none (no engine's capacity could be read; see below)"
        rows = entries[0]["bounds_from_reported"]
        budget = f" in the {_n(entries[0]['reported']['capacity_tokens'])}-token KV cache the engine reports"
        where = (f" (engine {entries[0]['reported']['engine']}"
                 + (f"; {len(entries) - 1} more engine(s) below)" if len(entries) > 1 else ")"))
    parts = []
    for row in rows:
        bound = _bound_of(row)
        if row.get("tokens") is None:  # --per-request-bytes: a size, no length
            parts.append(f"{_n(bound)} requests of {cap.human_bytes(row['bytes_per_request'])}")
            continue
        label = "" if row["label"] == "request" else f"{row['label']}: "
        parts.append(f"{label}{_n(bound)} requests of {_n(row['tokens'])} tokens")
    return "Answer: " + "; ".join(parts) + f" fit at once{budget}{where}; the working follows."


def render_table(report: dict[str, Any]) -> str:
    out = [f"kvwatch capacity ({report['mode']})", ""]
    if report["mode"] == "kv-events":
        return "\n".join(out + _stream_lines(report))
    if report["mode"] == "needed":
        from kvwatch.capacity.needed import lines

        if not report["models"]:
            out.append("No vllm:num_requests_running series in the range: nothing to size.")
        for result in report["models"]:
            out += lines(result) + [""]
        return "\n".join(out).rstrip()
    out = [answer_line(report), "", *out]
    if report.get("hardware"):
        out += _hardware_lines(report["hardware"])
    if report["mode"] != "target":
        result = report["result"]
        out += _result_lines(result)
        notes, ignores = result["notes"], result["ignores"]
    else:
        notes, ignores = list(report["notes"]), report["ignores"]
        out.append(f"Target: {report['target']} ({report['engine']})")
        if report["dark_signals"]:
            out.append("  the engine does not provide: "
                       + ", ".join(name[len("kvwatch_"):] for name in report["dark_signals"]))
        for entry in report["engines"]:
            info = entry["reported"]
            out.append("")
            out.append(f"Engine {info['engine']}"
                       + (f" ({info['model_name']})" if info["model_name"] else ""))
            if "error" in entry:
                out.append(f"  {entry['error']}")
                continue
            out.append(f"  reported: num_gpu_blocks {_n(info['num_gpu_blocks'])} x block_size "
                       f"{info['block_size']}; capacity {_n(info['capacity_tokens'])} tokens "
                       f"(from {info['capacity_source']}); cache_dtype {info['cache_dtype']}")
            if info["kv_cache_max_concurrency"] is not None:
                out.append(f"  vLLM's own kv_cache_max_concurrency: "
                           f"{info['kv_cache_max_concurrency']:g} (vLLM computes it at "
                           "max_model_len, not at these lengths)")
            if info.get("hybrid"):
                mamba = info["hybrid"]
                out.append("  hybrid model (Mamba layers): "
                           + ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in mamba.items())
                           + "; each request also holds a fixed-size Mamba state in the pool, and block_size is the "
                           "smallest over the KV groups")
            out.append("  bound from the reported capacity (every layer keeps every token):")
            out += [f"    {row['step']}" for row in entry["bounds_from_reported"]]
            if "computed" in entry:
                computed = entry["computed"]
                out.append(f"  computed from the config with budget "
                           f"{_n(computed['budget_bytes'])} B ({computed['budget_source']}):")
                out += [f"    {line}" for line in _result_lines(computed["result"])]
                notes += [n for n in computed["result"]["notes"] if n not in notes]
                if "comparison" in entry:
                    c = entry["comparison"]
                    out.append(f"  computed vs reported: {_n(c['computed_tokens'])} vs "
                               f"{_n(c['reported_tokens'])} tokens ({c['verdict']}, difference "
                               f"{c['difference_tokens']:+,} tokens)")
            observed = entry["observed"]
            if observed:
                out.append(f"  observed at this scrape: {observed['step']}"
                           + (f"; {info['num_requests_waiting']:g} waiting"
                              if info["num_requests_waiting"] is not None else ""))
                out.append(f"    ({observed['caveat']})")
    if notes:
        out += ["", "Notes:"] + [f"  - {note}" for note in notes]
    out += ["", "What the bound ignores (it is never a guarantee):"]
    out += [f"  - {item}" for item in ignores]
    return "\n".join(out)
