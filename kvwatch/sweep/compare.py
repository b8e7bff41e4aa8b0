"""`kvwatch sweep --compare BEFORE AFTER` (and `--baseline DIR`): two sweeps'
results, cell by cell, with what changed between them said first.

Reads only the sweeps' `sweep.json`. Three parts:

- **what changed**: the server each sweep recorded (model, vLLM and kvwatch
  versions, every `cache_config_info` label, KV bytes per token, the grid,
  the prompts). A change of the server's settings is what the comparison is
  for; a change of the conditions a cell was measured under (another model,
  another amount of load per cell, prompts of other lengths, other traffic on
  the server) makes its difference no result, so such a cell is refused, with
  the condition named, unless `force`.
- **quality**: the quality probes of both sweeps (kvwatch/sweep/probe.py),
  prompt by prompt: the share of identical outputs, the first token where
  they part, and the mean absolute difference of the logprobs of the tokens
  both runs chose (the common prefix: after the first different token the
  contexts differ, and so do the distributions). When the cache's precision
  changed, quality leads: capacity bought by a cheaper cache is only half of
  the answer. A probe that could not run is said to be unmeasured, never
  passed.
- **cells**: for each (input, output, concurrency) in both, before, after and
  the change of TTFT (client and engine), peak KV usage, the capacity bound,
  peak running, preemptions, completed and failed requests, tokens per second.

Writes compare.json, compare.md and, with matplotlib, PNG plots with both runs
on one axis.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvwatch.sweep.output import finish_plot
from kvwatch.sweep.probe import ANSWERED
from kvwatch.units import finite_number

COMPARE_JSON = "compare.json"
COMPARE_MD = "compare.md"
PLOTS = {
    "compare_ttft_p95.png": ("client_ttft_p95_s", "Client TTFT p95 (solid: before, dashed: after)",
                             "seconds"),
    "compare_kv_usage_peak.png": ("peak_kv_usage", "Peak KV cache usage (solid: before, dashed: after)",
                                  "KV usage (0-1)"),
    "compare_generation_tps.png": ("generation_tokens_per_s",
                                   "Generated tokens per second (solid: before, dashed: after)",
                                   "tokens / s"),
}

# Cell figures compared, in table order: key -> (label, lower is better).
METRICS: dict[str, tuple[str, bool | None]] = {
    "client_ttft_p50_s": ("TTFT p50 client (s)", True),
    "client_ttft_p95_s": ("TTFT p95 client (s)", True),
    "engine_ttft_p50_s": ("TTFT p50 engine (s)", True),
    "engine_ttft_p95_s": ("TTFT p95 engine (s)", True),
    "peak_kv_usage": ("peak KV", None),
    "capacity_bound": ("bound (requests)", False),
    "peak_running": ("peak running", False),
    "preemptions": ("preemptions", True),
    "completed": ("completed", False),
    "failed": ("failed", True),
    "generation_tokens_per_s": ("gen tok/s (engine)", False),
    "client_generation_tokens_per_s": ("gen tok/s (client)", False),
}
TABLE_METRICS = ("client_ttft_p50_s", "client_ttft_p95_s", "engine_ttft_p95_s", "peak_kv_usage",
                 "capacity_bound", "peak_running", "preemptions", "completed", "failed",
                 "generation_tokens_per_s")

# Cache settings named first among the changes; every other label follows.
CACHE_KEYS = ("cache_dtype", "block_size", "num_gpu_blocks", "kv_cache_size_tokens",
              "kv_cache_memory_bytes", "gpu_memory_utilization", "enable_prefix_caching")
# Prompt tokens the server counted differing by more than this share (and one
# token) mean the prompts were not the same length.
PROMPT_TOKENS_TOLERANCE = 0.01


class CompareInputError(ValueError):
    """A folder that holds no readable sweep; exit status 2."""


# What --compare reads of a sweep folder: sweep.json up to this many bytes
# (a real sweep's is tens of KB), at most this many cells, JSON nested no
# deeper than Python's parser manages (deeper is one sentence, not a
# RecursionError), numbers of cells' coordinates within MAX_COORDINATE.
MAX_SWEEP_BYTES = 64 * 1024 * 1024
MAX_CELLS = 10_000
MAX_COORDINATE = 10**9


def load_sweep(folder: str | Path) -> dict[str, Any]:
    """A sweep's sweep.json, checked to have the shape kvwatch sweep writes
    where the comparison relies on it; CompareInputError, one sentence,
    for anything else."""
    path = Path(folder)
    target = path / "sweep.json" if path.is_dir() else path
    if not target.is_file():
        raise CompareInputError(f"{folder}: no sweep.json (give the folder a sweep wrote)")
    try:
        with open(target, "rb") as handle:
            data = handle.read(MAX_SWEEP_BYTES + 1)
    except OSError as error:
        raise CompareInputError(f"{target}: cannot read: {error.strerror or error}") from None
    if len(data) > MAX_SWEEP_BYTES:
        raise CompareInputError(f"{target} is over {MAX_SWEEP_BYTES:,} bytes: not the result of kvwatch sweep")
    try:
        report = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise CompareInputError(f"{target}: cannot read: not UTF-8 text") from None
    except RecursionError:
        raise CompareInputError(f"{target}: cannot read: JSON nested too deeply") from None
    except ValueError as error:  # JSONDecodeError, or an integer of thousands of digits
        raise CompareInputError(f"{target}: cannot read: {str(error)[:200]}") from None
    if not isinstance(report, dict) or not isinstance(report.get("cells"), list) \
            or not isinstance(report.get("config"), dict):
        raise CompareInputError(f"{target} is not the result of kvwatch sweep")
    report.setdefault("server", {})
    problem = _shape_problem(report)
    if problem:
        raise CompareInputError(f"{target} is not the result of kvwatch sweep: {problem}")
    return report


def _shape_problem(report: dict[str, Any]) -> str | None:
    """What in a sweep.json the comparison cannot read, or None."""
    if not isinstance(report["server"], dict):
        return "server is not an object"
    caches = report["server"].get("cache_config")
    if caches is not None and not isinstance(caches, dict):
        return "server.cache_config is not an object"
    if len(report["cells"]) > MAX_CELLS:
        return f"more than {MAX_CELLS:,} cells"
    for index, cell in enumerate(report["cells"], start=1):
        if not isinstance(cell, dict):
            return f"cell {index} is not an object"
        for key in ("input_tokens", "output_tokens", "concurrency"):
            value = cell.get(key)
            if type(value) is not int or not 0 <= value <= MAX_COORDINATE:
                return f"cell {index}'s {key} is not a whole number from 0 to {MAX_COORDINATE:,}"
    probe = report.get("quality_probe")
    if probe is not None and not isinstance(probe, dict):
        return "quality_probe is not an object"
    return None


# ---------------------------------------------------------------------------
# What each sweep recorded of its server.


def _engine_caches(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    caches = report["server"].get("cache_config") or {}
    return {str(k): v for k, v in caches.items() if isinstance(v, dict)}


def kv_bytes_per_token(cache: dict[str, Any]) -> float | None:
    """Bytes the KV cache spends on one token: a property of the model and the
    cache's precision alone (the pool's size cancels out)."""
    memory = finite_number(cache.get("kv_cache_memory_bytes"))
    tokens = finite_number(cache.get("kv_cache_size_tokens"))
    if tokens is None:
        blocks, block = finite_number(cache.get("num_gpu_blocks")), finite_number(cache.get("block_size"))
        tokens = blocks * block if blocks and block else None
    if not memory or not tokens:
        return None
    return memory / tokens


def run_facts(report: dict[str, Any]) -> dict[str, Any]:
    """The facts of one sweep the comparison weighs, from its sweep.json."""
    config, server = report["config"], report["server"]
    caches = _engine_caches(report)
    first = caches[sorted(caches)[0]] if caches else {}
    probe = report.get("quality_probe")
    return {
        "model": config.get("model"),
        "model_root": server.get("model_root"),
        "vllm_version": server.get("vllm_version"),
        "kvwatch_version": report.get("kvwatch_version"),
        "engines": len(caches) or len(server.get("engines") or []) or None,
        "cache": {str(k): (None if v is None else str(v)) for k, v in first.items()},
        "kv_bytes_per_token": kv_bytes_per_token(first),
        "max_model_len": server.get("max_model_len"),
        "input_tokens": config.get("input_tokens"),
        "output_tokens": config.get("output_tokens"),
        "concurrency": config.get("concurrency"),
        "per_cell": _per_cell(config),
        "poll_interval_s": config.get("poll_interval_s"),
        "seed": config.get("seed"),
        "prompt_recipe": server.get("prompt_recipe"),
        "probe_status": probe.get("status") if isinstance(probe, dict) else None,
    }


def _per_cell(config: dict[str, Any]) -> str | None:
    if config.get("requests"):
        return f"{config['requests']} requests"
    if config.get("duration_s"):
        return f"{config['duration_s']:g} s"
    return None


def _show(value: Any) -> str:
    if value is None:
        return "not recorded"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def what_changed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Run-level differences: `settings` (what the comparison is for),
    `conditions` (what makes every cell's difference meaningless), `precision`
    (the cache's precision changed: a sentence, else None)."""
    b, a = run_facts(before), run_facts(after)
    settings: list[dict[str, Any]] = []
    conditions: list[dict[str, Any]] = []

    def differ(kind: list, what: str, x: Any, y: Any, why: str | None = None) -> None:
        if x != y:
            kind.append({"what": what, "before": x, "after": y, **({"why": why} if why else {})})

    differ(conditions, "served model", b["model"], a["model"])
    if b["model_root"] and a["model_root"]:
        differ(conditions, "model path (/v1/models root)", b["model_root"], a["model_root"])
    differ(conditions, "load per cell", b["per_cell"], a["per_cell"])

    precision = None
    bpt_b, bpt_a = b["kv_bytes_per_token"], a["kv_bytes_per_token"]
    dtype_b, dtype_a = b["cache"].get("cache_dtype"), a["cache"].get("cache_dtype")
    if dtype_b != dtype_a and dtype_b is not None and dtype_a is not None:
        precision = f"the KV cache dtype changed: {_show(dtype_b)} -> {_show(dtype_a)}"
    if bpt_b and bpt_a and abs(bpt_b - bpt_a) > 0.01 * max(bpt_b, bpt_a):
        settings.append({"what": "KV bytes per token", "before": round(bpt_b, 2),
                         "after": round(bpt_a, 2),
                         "why": "the same model holding each token in other bytes: the cache's "
                                "precision changed"})
        if precision is None and not any(c["what"].startswith(("served model", "model path"))
                                         for c in conditions):
            precision = (f"the KV cache holds a token in {bpt_a:g} B instead of {bpt_b:g} B under "
                         f"cache_dtype {_show(dtype_a)}, which follows the model's dtype: the "
                         "model's dtype, and with it the cache's precision, changed")
    # Beyond the main settings, labels one sweep did not record (an older kvwatch
    # kept six) or one vLLM version does not have are not changes of the server.
    for key in CACHE_KEYS + tuple(sorted((set(b["cache"]) & set(a["cache"])) - set(CACHE_KEYS)
                                         - {"engine"})):
        differ(settings, f"cache_config_info {key}", b["cache"].get(key), a["cache"].get(key))
    differ(settings, "vLLM version", b["vllm_version"], a["vllm_version"])
    differ(settings, "kvwatch version", b["kvwatch_version"], a["kvwatch_version"])
    differ(settings, "engines", b["engines"], a["engines"])
    differ(settings, "max_model_len", b["max_model_len"], a["max_model_len"])
    differ(settings, "/metrics poll interval (s)", b["poll_interval_s"], a["poll_interval_s"],
           "peaks are sampled at this interval")
    for key in ("input_tokens", "output_tokens", "concurrency"):
        differ(settings, f"grid {key}", b[key], a[key], "only the cells both ran are compared")
    same_prompts = b["seed"] == a["seed"] and b["prompt_recipe"] == a["prompt_recipe"] \
        and b["prompt_recipe"] is not None
    if not same_prompts:
        settings.append({"what": "prompt words", "before": f"seed {b['seed']}",
                         "after": f"seed {a['seed']}",
                         "why": "other random words of the same lengths (the lengths are checked "
                                "cell by cell); --baseline repeats a sweep's prompts"})
    if precision is None and (dtype_b or "auto") == (dtype_a or "auto") == "auto" \
            and not (bpt_b and bpt_a):
        unchecked = ("the cache's precision could not be checked: its dtype is auto (the model's) "
                     "and a sweep did not record the KV bytes per token (no kv_cache_memory_bytes)")
    else:
        unchecked = None
    return {"before": b, "after": a, "settings": settings, "conditions": conditions,
            "precision": precision, "precision_unchecked": unchecked,
            "same_prompts": same_prompts}


# ---------------------------------------------------------------------------
# Quality.


def _probe_entries(report: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    probe = report.get("quality_probe")
    if not isinstance(probe, dict):
        return None, "it has no quality probe (a sweep from before kvwatch recorded one)"
    if probe.get("status") not in ANSWERED:
        return None, f"its quality probe did not run or failed ({probe.get('note')})"
    return probe, None


def _divergence(x: list[str], y: list[str]) -> int | None:
    for index, (p, q) in enumerate(zip(x, y)):
        if p != q:
            return index
    return None if len(x) == len(y) else min(len(x), len(y))


def compare_quality(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Prompt by prompt, what greedy decoding gave in each run."""
    probes = {}
    for name, report in (("before", before), ("after", after)):
        probe, why = _probe_entries(report)
        if probe is None:
            return {"measured": False, "reason": f"not measured: the {name} sweep: {why}"}
        probes[name] = probe
    pb, pa = probes["before"], probes["after"]
    if pb.get("max_tokens") != pa.get("max_tokens") or pb.get("version") != pa.get("version"):
        return {"measured": False,
                "reason": "not measured: the two probes differ (probe version or max_tokens), so "
                          "their outputs cannot be set side by side"}
    answered_b = {e["prompt"]: e for e in pb.get("results", []) if e.get("error") is None}
    answered_a = {e["prompt"]: e for e in pa.get("results", []) if e.get("error") is None}
    prompts = [p for p in answered_b if p in answered_a]
    if not prompts:
        return {"measured": False, "reason": "not measured: no probe prompt was answered in both "
                                             "sweeps"}
    rows = []
    diffs: list[float] = []
    logprobs_missing: list[str] = []
    for prompt in prompts:
        eb, ea = answered_b[prompt], answered_a[prompt]
        tb, ta = eb.get("tokens"), ea.get("tokens")
        row: dict[str, Any] = {"prompt": prompt, "before": eb.get("text"), "after": ea.get("text")}
        if tb is not None and ta is not None:
            diverge = _divergence(tb, ta)
            row["identical"] = diverge is None
            row["diverge_at_token"] = diverge
            row["tokens"] = [len(tb), len(ta)]
            shared = len(tb) if diverge is None else diverge
            lb, la = eb.get("token_logprobs") or [], ea.get("token_logprobs") or []
            pairs = [(lb[i], la[i]) for i in range(min(shared, len(lb), len(la)))
                     if lb[i] is not None and la[i] is not None]
            if pairs:
                prompt_diffs = [abs(p - q) for p, q in pairs]
                diffs.extend(prompt_diffs)
                row["logprob_mean_abs_diff"] = sum(prompt_diffs) / len(prompt_diffs)
                row["logprob_max_abs_diff"] = max(prompt_diffs)
            else:
                row["logprob_mean_abs_diff"] = None
        else:
            # Without tokens only the texts can be held side by side.
            row["identical"] = eb.get("text") == ea.get("text")
            row["diverge_at_token"] = None
            row["logprob_mean_abs_diff"] = None
            logprobs_missing.append(prompt)
        rows.append(row)
    identical = sum(1 for row in rows if row["identical"])
    positions = [row["diverge_at_token"] for row in rows if row["diverge_at_token"] is not None]
    total = max(len(pb.get("results", [])), len(pa.get("results", [])))
    result: dict[str, Any] = {
        "measured": True,
        "prompts": total, "compared": len(rows),
        "identical": identical, "identical_share": identical / len(rows),
        "first_divergence_token": min(positions) if positions else None,
        "median_divergence_token": sorted(positions)[len(positions) // 2] if positions else None,
        "max_tokens": pb.get("max_tokens"),
        "logprob_mean_abs_diff": sum(diffs) / len(diffs) if diffs else None,
        "logprob_max_abs_diff": max(diffs) if diffs else None,
        "logprob_tokens_compared": len(diffs),
        "per_prompt": rows, "notes": [],
    }
    if logprobs_missing or not diffs:
        whose = [name for name, probe in probes.items() if probe.get("status") == "no-logprobs"]
        result["notes"].append(
            "logprob difference not measured: "
            + (f"the {' and '.join(whose)} sweep's server gave no logprobs" if whose
               else "no token was chosen by both runs with a logprob")
            + ("; identical outputs compared by text, divergence positions unknown"
               if logprobs_missing else ""))
    if len(rows) < total:
        result["notes"].append(f"{total - len(rows)} of {total} probe prompts were not answered in "
                               "both sweeps and are left out")
    return result


# ---------------------------------------------------------------------------
# Cells.


def _key(cell: dict[str, Any]) -> tuple[int, int, int]:
    return (int(cell["input_tokens"]), int(cell["output_tokens"]), int(cell["concurrency"]))


def _prompt_tokens(cell: dict[str, Any]) -> float | None:
    for key in ("prompt_tokens_mean", "prompt_tokens_client_mean"):
        value = finite_number(cell.get(key))
        if value is not None:
            return value
    return None


def cell_conditions(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs in the conditions of two cells at the same coordinates."""
    reasons = []
    # Other traffic first: it is what makes the server's counts differ (two
    # identical sweeps against the busy demo counted 844 and 999 tokens per
    # 128-token prompt, and every cell was refused for its "prompt length").
    for name, cell in (("before", before), ("after", after)):
        foreign = cell.get("foreign_requests")
        if foreign:
            reasons.append(f"other traffic: the server finished {foreign} requests the {name} sweep did not send "
                           f"during the cell; its engine figures include them")
        elif cell.get("other_traffic"):
            reasons.append(f"other traffic: the server was still busy when the {name} cell started")
    pb, pa = _prompt_tokens(before), _prompt_tokens(after)
    if pb is not None and pa is not None and \
            abs(pb - pa) > max(1.0, PROMPT_TOKENS_TOLERANCE * max(pb, pa)):
        reasons.append(f"prompt length: the server counted {pb:g} tokens per prompt before, {pa:g} after"
                       + (" (with the other traffic's prompts)" if reasons else ""))
    for name, cell in (("before", before), ("after", after)):
        if cell.get("engine_restarts"):
            reasons.append(f"engine restart: the engine's counters reset during the {name} cell")
    return reasons


def _change(before: Any, after: Any) -> dict[str, Any]:
    b, a = finite_number(before), finite_number(after)
    return {"before": b, "after": a,
            "delta": (a - b) if a is not None and b is not None else None,
            "ratio": (a / b) if a is not None and b not in (None, 0.0) else None}


def compare_cells(before: dict[str, Any], after: dict[str, Any], run_conditions: list[dict],
                  force: bool) -> dict[str, Any]:
    cells_b = {_key(cell): cell for cell in before["cells"]}
    cells_a = {_key(cell): cell for cell in after["cells"]}
    run_reasons = [f"{c['what']}: {_show(c['before'])} before, {_show(c['after'])} after"
                   for c in run_conditions]
    compared, refused = [], []
    for key in sorted(set(cells_b) & set(cells_a)):
        cb, ca = cells_b[key], cells_a[key]
        reasons = run_reasons + cell_conditions(cb, ca)
        row: dict[str, Any] = {"input_tokens": key[0], "output_tokens": key[1], "concurrency": key[2]}
        if reasons and not force:
            refused.append({**row, "reasons": reasons})
            continue
        row["forced"] = reasons
        row["metrics"] = {metric: _change(cb.get(metric), ca.get(metric)) for metric in METRICS}
        compared.append(row)
    only = {"before": [list(k) for k in sorted(set(cells_b) - set(cells_a))],
            "after": [list(k) for k in sorted(set(cells_a) - set(cells_b))]}
    return {"compared": compared, "refused": refused, "only_in": only}


# ---------------------------------------------------------------------------
# The whole comparison.


def compare(before: dict[str, Any], after: dict[str, Any], force: bool = False,
            names: tuple[str, str] = ("before", "after")) -> dict[str, Any]:
    changes = what_changed(before, after)
    quality = compare_quality(before, after)
    cells = compare_cells(before, after, changes["conditions"], force)
    headline = []
    if changes["precision"]:
        headline.append(f"The cache's precision changed ({changes['precision']}). Capacity gains "
                        "are only half the answer: the quality probe comes first.")
    return {"before": names[0], "after": names[1], "force": force, "headline": headline,
            "changes": changes, "quality": quality, "cells": cells}


# ---------------------------------------------------------------------------
# Markdown.


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e6:
            return str(int(value))
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _cell_text(change: dict[str, Any]) -> str:
    b, a, ratio = change["before"], change["after"], change["ratio"]
    if b is None and a is None:
        return "-"
    text = f"{_fmt(b)} → {_fmt(a)}"
    if ratio is not None and b != a:
        text += f" ({(ratio - 1) * 100:+.0f}%)"
    return text


def _quality_lines(quality: dict[str, Any]) -> list[str]:
    lines = ["## Quality probe", ""]
    if not quality["measured"]:
        lines += [f"**{quality['reason']}.** Nothing is known about what the change did to the "
                  "answers.", ""]
        return lines
    share = quality["identical_share"]
    lines.append(f"- identical outputs: {quality['identical']} of {quality['compared']} prompts "
                 f"({share:.0%}), greedy decoding, at most {quality['max_tokens']} tokens each")
    if quality["first_divergence_token"] is not None:
        lines.append(f"- outputs part at token {quality['first_divergence_token']} at the earliest "
                     f"(median {quality['median_divergence_token']}; tokens counted from 0)")
    if quality["logprob_mean_abs_diff"] is not None:
        lines.append(f"- logprobs of the tokens both runs chose (before any divergence): mean "
                     f"absolute difference {quality['logprob_mean_abs_diff']:.3g}, largest "
                     f"{quality['logprob_max_abs_diff']:.3g}, over "
                     f"{quality['logprob_tokens_compared']} tokens")
    lines += [f"- {note}" for note in quality["notes"]]
    lines.append("")
    differing = [row for row in quality["per_prompt"] if not row["identical"]]
    if differing:
        lines += ["| prompt | parts at token | before | after |", "|---|---|---|---|"]
        for row in differing:
            cells = [row["prompt"], _fmt(row["diverge_at_token"]), row["before"], row["after"]]
            lines.append("| " + " | ".join(_md_text(str(c)) for c in cells) + " |")
        lines.append("")
    return lines


def _md_text(text: str, limit: int = 60) -> str:
    text = text.replace("\n", "\\n").replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_markdown(result: dict[str, Any]) -> str:
    """compare.md; markup in what the sweeps recorded (a model name, a cache
    setting, a probe's output) is written as text: compare.md carried a
    crafted sweep's raw `<script>`."""
    return _escape_markup(_render_markdown(result))


# Markdown's own syntax here uses none of these; each in a value is text.
_MARKUP = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;"})


def _escape_markup(text: str) -> str:
    return text.translate(_MARKUP)


def _render_markdown(result: dict[str, Any]) -> str:
    changes, quality, cells = result["changes"], result["quality"], result["cells"]
    b, a = changes["before"], changes["after"]
    lines = ["# kvwatch sweep comparison", ""]
    lines.append(f"- before: `{result['before']}`: model `{b['model']}`, vLLM "
                 f"{_show(b['vllm_version'])}, kvwatch {_show(b['kvwatch_version'])}")
    lines.append(f"- after: `{result['after']}`: model `{a['model']}`, vLLM "
                 f"{_show(a['vllm_version'])}, kvwatch {_show(a['kvwatch_version'])}")
    lines.append("")
    for line in result["headline"]:
        lines += [f"**{line}**", ""]
    lines += ["## What changed", ""]
    if not changes["settings"] and not changes["conditions"]:
        lines.append("- nothing the sweeps recorded: the difference is the machine's, or noise")
    for item in changes["conditions"]:
        lines.append(f"- **condition** {item['what']}: {_show(item['before'])} → "
                     f"{_show(item['after'])} (every cell refused"
                     + (", compared anyway: --force" if result["force"] else " unless --force")
                     + ")")
    for item in changes["settings"]:
        lines.append(f"- {item['what']}: {_show(item['before'])} → {_show(item['after'])}"
                     + (f" ({item['why']})" if item.get("why") else ""))
    if changes["precision_unchecked"]:
        lines.append(f"- {changes['precision_unchecked']}")
    if changes["same_prompts"]:
        lines.append(f"- prompts: the same words in both (seed {b['seed']}, same recipe)")
    lines.append("")
    if changes["precision"]:
        lines += _quality_lines(quality)
    lines += ["## Cells", ""]
    if cells["compared"]:
        headers = ["in", "out", "conc"] + [METRICS[m][0] for m in TABLE_METRICS]
        lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        for row in cells["compared"]:
            values = [row["input_tokens"], row["output_tokens"], row["concurrency"]]
            values += [_cell_text(row["metrics"][m]) for m in TABLE_METRICS]
            lines.append("| " + " | ".join(str(v) for v in values) + " |")
        lines.append("")
        forced = [row for row in cells["compared"] if row["forced"]]
        for row in forced:
            lines.append(f"- compared with --force: in {row['input_tokens']} out "
                         f"{row['output_tokens']} c {row['concurrency']}: "
                         + "; ".join(row["forced"]))
        if forced:
            lines.append("")
    else:
        lines += ["No cell could be compared.", ""]
    if cells["refused"]:
        lines += ["Refused (their conditions differ; --force compares them anyway):", ""]
        for row in cells["refused"]:
            lines.append(f"- in {row['input_tokens']} out {row['output_tokens']} c "
                         f"{row['concurrency']}: " + "; ".join(row["reasons"]))
        lines.append("")
    for side in ("before", "after"):
        if cells["only_in"][side]:
            listed = ", ".join(f"{i}/{o}/c{c}" for i, o, c in cells["only_in"][side])
            lines += [f"Only in the {side} sweep (in/out/concurrency): {listed}", ""]
    if not changes["precision"]:
        lines += _quality_lines(quality)
    lines.append("Each cell reads before → after (change). Times are seconds; the bound is "
                 "kvwatch capacity's arithmetic on each run's KV pool, peak running what the "
                 "engine reached. One run against one run: differences of a few percent in "
                 "times are within what a shared machine varies between runs.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# Files.


def write_plots(out_dir: Path, result: dict[str, Any]) -> list[Path]:
    """Both runs on one axis: solid before, dashed after, one colour per length.
    Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = result["cells"]["compared"]
    lengths: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for row in rows:
        lengths.setdefault((row["input_tokens"], row["output_tokens"]), []).append(row)
    levels = sorted({row["concurrency"] for row in rows})
    written = []
    for name, (metric, title, ylabel) in PLOTS.items():
        figure, axes = plt.subplots(figsize=(7, 4.5), dpi=110)
        for index, ((inp, out), group) in enumerate(sorted(lengths.items())):
            group = sorted(group, key=lambda row: row["concurrency"])
            color = f"C{index % 10}"
            for side, style, marker in (("before", "-", "o"), ("after", "--", "x")):
                points = [(row["concurrency"], row["metrics"][metric][side]) for row in group
                          if row["metrics"][metric][side] is not None]
                if points:
                    axes.plot(*zip(*points), marker=marker, linestyle=style, color=color,
                              label=f"in {inp} / out {out} ({side})")
        (out_dir / name).write_bytes(finish_plot(plt, figure, axes, levels, metric, title, ylabel, bool(lengths)))
        written.append(out_dir / name)
    return written


def write_comparison(out_dir: Path, result: dict[str, Any], plots: bool = True) -> list[str]:
    """compare.json, compare.md and the plots; returns the names written (the
    plots are left out, with no error, when matplotlib is missing)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / COMPARE_JSON).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out_dir / COMPARE_MD).write_text(render_markdown(result), encoding="utf-8")
    written = [COMPARE_JSON, COMPARE_MD]
    if plots and result["cells"]["compared"]:
        try:
            written += [path.name for path in write_plots(out_dir, result)]
        except ImportError:
            pass
    return written
