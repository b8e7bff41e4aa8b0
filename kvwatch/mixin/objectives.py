"""Objectives and their burn-rate alerts: what pages.

Users feel two things: a first token that comes late, and a request that
fails. Each is an objective over an engine's requests, read from vLLM's own
counters (re-exported by kvwatch as kvwatch_engine_*):

- first_token: the share of requests whose first token came within
  `ttft_objective_seconds` (a bound of vLLM's TTFT histogram, so the share is
  read from one bucket, not interpolated), against `ttft_objective`;
- availability: the share of finished requests that did not end in `error`
  (vllm:request_success_total{finished_reason="error"}), against
  `availability_objective`;
- aborts: the share that did not end in `abort`, against `abort_objective`.
  Clients abort for their own reasons (a user closing a tab, a gateway
  timeout), so this one never pages: its alerts are warnings at most.

Each objective's error ratio is recorded per engine over every window the
burn-rate pairs name (`level:metric:operations`, e.g.
instance_model_name_engine:kvwatch_time_to_first_token_slow:ratio_rate1h),
and each pair alerts in the style of the SRE workbook's multi-window,
multi-burn-rate alerts: the error ratio over the long window AND over the
short window above `factor x (1 - objective)`. The long window says enough
budget is gone to matter; the short one that it is still burning, so the
page resolves minutes after the harm stops and a short spike (the short
window burning while the long one has not) never pages.

A page is per model (and the group labels: namespace, job), over every
replica's requests: an incident across 8 replicas is one page, the replicas
burning listed in its description. The ratios are recorded per model too
(model_name:...:ratio_rate1h), and a pair pages only when the model served
`objective_min_requests` in its long window: a handful of requests, two of
them slow, is no budget burning. The per-engine ratios stay for the
dashboards and the page's list of replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.diagnose.vocabulary import SEVERITIES
from kvwatch.mixin.promql import num
from kvwatch.units import is_prometheus_duration, parse_prometheus_duration


# objective -> (alert, symptom label, recorded metric, what counts as bad)
OBJECTIVE_ALERTS = {
    "first_token": ("VllmTimeToFirstTokenBudgetBurn", "slow_first_token", "kvwatch_time_to_first_token_slow"),
    "availability": ("VllmRequestErrorBudgetBurn", "request_errors", "kvwatch_requests_failed"),
    "aborts": ("VllmRequestAbortBudgetBurn", "request_aborts", "kvwatch_requests_aborted"),
}
# The aborts objective is a signal, not a page: its alerts are capped at this severity.
ABORT_MAX_SEVERITY = "warning"

DEFAULT_BURN_RATE_WINDOWS = (
    # 2% of a 30-day budget in one hour: page.
    {"long": "1h", "short": "5m", "factor": 14.4, "severity": "critical"},
    # 5% in six hours: page.
    {"long": "6h", "short": "30m", "factor": 6, "severity": "critical"},
    # 10% in a day: a ticket for the owning team.
    {"long": "1d", "short": "2h", "factor": 3, "severity": "warning"},
)


@dataclass(frozen=True)
class BurnWindow:
    long: str
    short: str
    factor: float
    severity: str


def burn_windows(config) -> list[BurnWindow]:
    return [BurnWindow(str(w["long"]), str(w["short"]), float(w["factor"]), str(w["severity"]))
            for w in config.burn_rate_windows]


def windows(config) -> list[str]:
    """Every window a pair names, each once, in the order first named."""
    out: list[str] = []
    for pair in burn_windows(config):
        for w in (pair.short, pair.long):
            if w not in out:
                out.append(w)
    return out


def objective_target(config, objective: str) -> float:
    return {"first_token": config.ttft_objective, "availability": config.availability_objective,
            "aborts": config.abort_objective}[objective]


def budget(config, objective: str) -> float:
    """The error budget: the share of requests allowed to miss."""
    return round(1 - objective_target(config, objective), 12)


def level(config) -> str:
    return "_".join(label for label in config.engine_labels if label not in config.group_labels)


def record_name(config, objective: str, window: str) -> str:
    return f"{level(config)}:{OBJECTIVE_ALERTS[objective][2]}:ratio_rate{window}"


def model_level(config) -> str:
    return "_".join(label for label in config.model_labels if label not in config.group_labels)


def model_record_name(config, objective: str, window: str) -> str:
    """The objective's error ratio over every replica of a model: what pages."""
    return f"{model_level(config)}:{OBJECTIVE_ALERTS[objective][2]}:ratio_rate{window}"


# objective -> the counter of the requests its ratio is over (the guard counts them)
OBJECTIVE_REQUESTS = {"first_token": "kvwatch_engine_time_to_first_token_seconds_count",
                      "availability": "kvwatch_engine_requests_finished_total",
                      "aborts": "kvwatch_engine_requests_finished_total"}


def requests_record_name(config, objective: str, window: str) -> str:
    metric = OBJECTIVE_REQUESTS[objective].removesuffix("_total")
    return f"{model_level(config)}:{metric}:increase{window}"


def requests_expr(config, objective: str, window: str) -> str:
    sel = config.kvwatch_selector
    return _sum(config, f"increase({OBJECTIVE_REQUESTS[objective]}{{{sel}}}[{window}])", config.model_labels)


def le_matcher(bound: float) -> str:
    """A matcher for one `le` bound however the exporter spelled it (2.5,
    2.50; 1, 1.0): vLLM and prometheus_client write 1.0, others 1."""
    text = num(bound)
    if "e" in text:
        return f'le="{text}"'
    whole, _, fraction = text.partition(".")
    if fraction:
        return f'le=~"{whole}\\\\.{fraction}0*"'
    return f'le=~"{whole}(\\\\.0+)?"'


def _sum(config, inner: str, labels: tuple[str, ...] | None = None) -> str:
    return f"sum by ({', '.join(labels or config.engine_labels)}) ({inner})"


def ratio_expr(config, objective: str, window: str, labels: tuple[str, ...] | None = None) -> str:
    """The objective's error ratio over `window`, bad / all, summed by `labels` (default: per engine)."""
    sel = config.kvwatch_selector
    if objective == "first_token":
        total = _sum(config, f"rate(kvwatch_engine_time_to_first_token_seconds_count{{{sel}}}[{window}])", labels)
        good = _sum(config, f"rate(kvwatch_engine_time_to_first_token_seconds_bucket"
                            f"{{{sel},{le_matcher(config.ttft_objective_seconds)}}}[{window}])", labels)
        return f"1 - (\n  {good}\n  /\n  {total}\n)"
    reason = {"availability": "error", "aborts": "abort"}[objective]
    finished = _sum(config, f"rate(kvwatch_engine_requests_finished_total{{{sel}}}[{window}])", labels)
    bad = _sum(config, f"rate(kvwatch_engine_requests_finished_total{{{sel},finished_reason=\"{reason}\"}}[{window}])",
               labels)
    # vLLM creates a reason's series at its first request of that reason:
    # none yet is a ratio of 0, not no ratio.
    return f"(\n  {bad}\n  or\n  0 * {finished}\n)\n/\n{finished}"


def recording_rules(config) -> list[dict]:
    """Per engine (dashboards, the page's replicas), per model (what pages), and each model's requests
    over every long window (the minimum-traffic guard)."""
    per_engine = [{"record": record_name(config, objective, w), "expr": ratio_expr(config, objective, w)}
                  for objective in OBJECTIVE_ALERTS for w in windows(config)]
    per_model = [{"record": model_record_name(config, objective, w),
                  "expr": ratio_expr(config, objective, w, config.model_labels)}
                 for objective in OBJECTIVE_ALERTS for w in windows(config)]
    requests = {requests_record_name(config, objective, pair.long): requests_expr(config, objective, pair.long)
                for objective in OBJECTIVE_ALERTS for pair in burn_windows(config)}
    return per_engine + per_model + [{"record": name, "expr": expr} for name, expr in requests.items()]


def severity(objective: str, pair: BurnWindow) -> str:
    if objective == "aborts" and pair.severity == "critical":
        return ABORT_MAX_SEVERITY
    return pair.severity


def burn_threshold(config, objective: str, pair: BurnWindow) -> float:
    return float(num(pair.factor * budget(config, objective)))


def burn_query(config, objective: str, pair: BurnWindow) -> tuple[str, float]:
    """(query, threshold): the query is a model's long-window ratio where its
    short window burns too and it served enough requests to judge; the alert
    compares it with the same threshold."""
    threshold = burn_threshold(config, objective, pair)
    query = (f"{model_record_name(config, objective, pair.long)}\nand\n"
             f"{model_record_name(config, objective, pair.short)} > {num(threshold)}\nand\n"
             f"{requests_record_name(config, objective, pair.long)} >= {num(config.objective_min_requests)}")
    return query, threshold


def check_windows(value) -> list[str]:
    """Problems with a burn_rate_windows value (one sentence each)."""
    if not isinstance(value, (list, tuple)) or not value:
        return ["burn_rate_windows: must be a non-empty list of {long, short, factor, severity}"]
    problems = []
    for i, pair in enumerate(value):
        where = f"burn_rate_windows[{i}]"
        if not isinstance(pair, dict) or set(pair) != {"long", "short", "factor", "severity"}:
            problems.append(f"{where}: must be a mapping with exactly long, short, factor, severity")
            continue
        bad = [k for k in ("long", "short") if not is_prometheus_duration(pair[k])]
        if bad:
            problems.append(f"{where}: {', '.join(bad)} must be Prometheus durations (examples: 5m, 1h)")
        elif parse_prometheus_duration(pair["short"]) >= parse_prometheus_duration(pair["long"]):
            problems.append(f"{where}: short ({pair['short']}) must be shorter than long ({pair['long']})")
        factor = pair["factor"]
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
            problems.append(f"{where}: factor {factor!r} must be a positive number")
        if pair["severity"] not in SEVERITIES:
            problems.append(f"{where}: severity {pair['severity']!r} is not one of {', '.join(SEVERITIES)}")
    return problems
