"""alerts/runbooks.md: one section per alert and one per cause, each saying
what it means, how to confirm it on the dashboards, what to do and what not
to do. The anchors are the ones the alerts' runbook_url and the panels'
runbook links point at.

The prose is not here: each alert's introduction and each cause's sections
are Markdown files beside the cause catalogue (kvwatch/diagnose/runbooks/,
package data), with {placeholders} for the mixin config's values, which this
module fills in and composes with the alerts' own queries and severities."""

from __future__ import annotations

import re
from dataclasses import fields
from importlib import resources

from kvwatch.diagnose.causes import ALERTS as ALERTS_BY_NAME
from kvwatch.diagnose.causes import CAUSE
from kvwatch.mixin import objectives
from kvwatch.mixin.alerts import alert_specs, runbook_anchor
from kvwatch.mixin.alerts import runbook_anchor as anchor_of
from kvwatch.mixin.config import ALERT_CAUSES, MixinConfig
from kvwatch.mixin.dashboards import DASHBOARDS
from kvwatch.mixin.promql import num
from kvwatch.units import parse_prometheus_duration

D_TTFT = DASHBOARDS["first_token"][1]
THROUGHPUT_ANCHOR = "throughput-and-failures"
# The prose: one Markdown file per alert (its introduction) and per cause (the
# sections below), beside the cause catalogue (kvwatch/diagnose/runbooks/).
PROSE = resources.files("kvwatch.diagnose").joinpath("runbooks")
PROSE_MAX_BYTES = 64 * 1024
# A cause's file: its sections, in this order, each a `## ` heading.
SECTIONS = ("First five minutes", "What it means", "Confirm on the dashboard", "Medium term", "What not to do")
# {name} is a mixin config value (or one of _values' own), {name:pct} a
# ratio as a percentage, {dashboard:key} a dashboard's title. Other braces
# (jsonpath, PromQL matchers) are text.
_PLACEHOLDER = re.compile(r"\{([a-z_]+)(?::([a-z_]+))?\}")


class RunbookProseError(ValueError):
    pass


def _pct(x: float) -> str:
    return f"{x * 100:g}%"


def _values(c: MixinConfig, alert: str) -> dict[str, str]:
    """What a placeholder may name, for `alert`'s sections."""
    values = {}
    names = [field.name for field in fields(c)] + sorted(
        name for name, member in vars(type(c)).items() if isinstance(member, property) and not name.startswith("_"))
    for name in names:
        value = getattr(c, name)
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (int, float)):
            values[name] = num(value)
        elif isinstance(value, str):
            values[name] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            values[name] = ", ".join(value)
    values["for"] = c.for_duration(alert)
    upstream = c.upstream_histogram
    values["upstream_histogram_name"] = upstream or "upstream_histogram"
    values["upstream_counting"] = f" (counting the upstream stage {upstream} before the engine)" if upstream else ""
    values["and_upstream"] = ", and upstream" if upstream else ""
    return values


def _fill(text: str, c: MixinConfig, alert: str, where: str) -> str:
    values = _values(c, alert)

    def one(match: re.Match) -> str:
        name, form = match.group(1), match.group(2)
        if name == "dashboard":
            if form not in DASHBOARDS:
                raise RunbookProseError(f"{where}: no dashboard {form!r} (known: {', '.join(DASHBOARDS)})")
            return DASHBOARDS[form][1]
        if name not in values:
            raise RunbookProseError(f"{where}: {{{name}}} names no mixin config value")
        if form == "pct":
            return _pct(float(getattr(c, name)))
        if form is not None:
            raise RunbookProseError(f"{where}: {{{name}:{form}}}: the only form is :pct")
        return values[name]
    return _PLACEHOLDER.sub(one, text)


def read_prose(name: str) -> str:
    """The Markdown file of an alert or a cause, its title line checked."""
    path = PROSE.joinpath(f"{name}.md")
    if not path.is_file():
        raise RunbookProseError(f"kvwatch/diagnose/runbooks/{name}.md is missing: every alert and every alerted "
                                "cause the diagnosis names has its runbook prose there")
    with path.open("rb") as handle:
        data = handle.read(PROSE_MAX_BYTES + 1)
    if len(data) > PROSE_MAX_BYTES:
        raise RunbookProseError(f"runbooks/{name}.md is over {PROSE_MAX_BYTES} bytes")
    text = data.decode("utf-8")
    title, _, body = text.partition("\n\n")
    if title != f"# {name}":
        raise RunbookProseError(f"runbooks/{name}.md must start with the line '# {name}' and a blank line")
    return body


def _paragraphs(text: str) -> str:
    """Markdown paragraphs wrapped for editing, joined back into lines."""
    return "\n\n".join(" ".join(line.strip() for line in para.splitlines())
                        for para in text.strip().split("\n\n"))


def alert_intro(c: MixinConfig, alert: str) -> str:
    return _fill(_paragraphs(read_prose(alert)), c, alert, f"runbooks/{alert}.md")


def cause_sections(c: MixinConfig, alert: str, cause: str) -> dict[str, str]:
    """{section title: its text} of a cause's runbook, from its Markdown file;
    a cause only its alert names (diagnosed=False) may have none, and then its
    records say it (_record_sections)."""
    if not CAUSE[cause].diagnosed and not PROSE.joinpath(f"{cause}.md").is_file():
        return _record_sections(c, alert, cause)
    body = read_prose(cause)
    parts = re.split(r"^## (.+)\n", body, flags=re.M)
    titles = tuple(parts[1::2])
    if parts[0].strip() or titles != SECTIONS:
        raise RunbookProseError(f"runbooks/{cause}.md: the sections are {', '.join(SECTIONS)}, each a '## ' "
                                f"heading, in this order (found: {', '.join(titles) or 'none'})")
    return {title: _fill(_paragraphs(text), c, alert, f"runbooks/{cause}.md")
            for title, text in zip(titles, parts[2::2])}


def _record_sections(c: MixinConfig, alert: str, cause: str) -> dict[str, str]:
    """A section from the records alone: the cause's advice first, then what
    its alert's description says (its labels and value named in words), and
    the dashboard its alert links; nothing made up for the rest."""
    record = CAUSE[cause]
    spec = next((s for s in alert_specs(c) if (s.alert, s.cause) == (alert, cause)), None)
    meaning = spec.description.rsplit(" Next: ", 1)[0] if spec else (record.title or cause.replace("_", " "))
    meaning = re.sub(r"\{\{ \$labels\.(\w+) \}\}", r"<\1>", meaning)
    meaning = re.sub(r"\{\{ VALUE \| \w+ \}\}", "the alert's value", meaning)
    dashboard = DASHBOARDS[ALERTS_BY_NAME[alert].panel[0]][1]
    return dict(zip(SECTIONS, (record.next_check, meaning, f"{dashboard}: the panel the alert links.", "", "")))


def _first_five(config: MixinConfig, alert: str, first_five: str, spec_list) -> list[str]:
    """The first-five-minutes block: the alert's PromQL to paste, how to
    read the pod's vLLM arguments, and the cause's immediate step."""
    deploy = config.deploy_settings
    out = [f"**First five minutes.** {first_five}", ""]
    if spec_list:
        out += ["Paste into Prometheus (the alert's own query; one series per affected engine):", "", "```promql",
                spec_list[0].query, "```", ""]
    if alert.startswith("Vllm"):
        out += ["Read the pod's vLLM arguments (cache size, `--max-num-seqs`, `--max-model-len`, prefix caching):",
                "", "```sh",
                f"kubectl get pod -n {deploy.namespace} <pod> -o jsonpath='{{.spec.containers[?(@.name==\"vllm\")].args}}'",
                "```", ""]
    return out


def _severity_text(spec_list) -> str:
    by_variant = {spec.variant: spec.severity for spec in spec_list}
    if set(by_variant) == {"preempting", ""}:
        return f"{by_variant['preempting']} with preemptions, {by_variant['']} without"
    return ", ".join(sorted(set(by_variant.values())))


def _objective_sections(config: MixinConfig, specs) -> list[str]:
    """One section per objective's burn-rate alert: what pages and why."""
    pairs = objectives.burn_windows(config)
    table = ["| long window | short window | burn rate | budget spent when it fires | severity |",
             "|---|---|---|---|---|"]
    for pair in pairs:
        spent = pair.factor * parse_prometheus_duration(pair.long) / (30 * 86400)
        table.append(f"| {pair.long} | {pair.short} | {num(pair.factor)}x | {_pct(round(spent, 4))} of 30 days' | "
                     f"{pair.severity} |")
    texts = {
        "first_token": (
            f"Too many requests got their first token later than {num(config.ttft_objective_seconds)}s: the "
            f"objective is {_pct(config.ttft_objective)} within that bound (mixin config `ttft_objective`, "
            "`ttft_objective_seconds`), read per model over all its replicas from vLLM's TTFT histogram (the bucket at the bound over "
            "the count). Users wait for the first word of every answer; this is the page for it.",
            "Open the cause alerts that fire beside it for the same model (the page's `cause_alerts` annotation "
            "names them, its description the replicas burning; Alertmanager groups them by model): `VllmKvCacheExhausted` and "
            "`VllmTimeToFirstTokenSlow` say whether the queue waits for KV cache, for compute, for prefill or "
            "for something upstream, and their runbook sections say what to do. With no cause alert yet, open "
            f"{D_TTFT}: the largest part of the mean is where the time goes."),
        "availability": (
            f"Requests end in error: the objective is {_pct(config.availability_objective)} of finished requests "
            "without error (`availability_objective`), from vllm:request_success_total by finished_reason. An "
            "error is the engine's (an exception in the model runner, an out-of-memory, a bad request the "
            "engine failed), not the client's.",
            "Read the engine's log for the errors (`kubectl logs -n <namespace> <pod> -c vllm --since=15m`). "
            "Errors together with exhaustion or restarts point at memory; errors alone at the model, the "
            "request payloads or the engine version."),
        "aborts": (
            f"Clients abort requests: the objective is {_pct(config.abort_objective)} not aborted "
            "(`abort_objective`). Clients abort for their own reasons (a closed tab, a retry, a gateway "
            "timeout), so this never pages, whatever the window: rising aborts beside slow first tokens are "
            "users giving up; aborts alone are usually the client's or the gateway's timeouts.",
            "Compare with the first-token objective: aborts rising with it are waits too long for users; "
            "alone, check the gateway's timeouts and the client's retry policy."),
    }
    out = ["## Pages: objectives and burn rates", "",
           "Pages follow what users feel: late first tokens and failed requests, each an objective with an "
           "error budget (1 - objective). Each objective alerts on multi-window, multi-burn-rate pairs (the SRE "
           "workbook's): the share of bad requests over the long window AND over the short one above burn rate "
           "x budget. The long window says enough budget is gone to matter; the short one that it still burns, "
           "so a short spike does not page and the page resolves minutes after the harm stops. A page is per model "
           "over all its replicas (one incident, one page), and only for a model that served "
           f"{config.objective_min_requests} requests in the long window (`objective_min_requests`). The cause "
           "alerts below are warnings, per replica, that say where to look. Pairs (`burn_rate_windows`):", "",
           *table, ""]
    for objective, (alert, _, _) in objectives.OBJECTIVE_ALERTS.items():
        meaning, do = texts[objective]
        spec_list = specs.get((alert, objective), [])
        severity = ", ".join(f"{s.severity} ({s.variant})" for s in spec_list)
        out += [f'<a id="{anchor_of(alert)}"></a>', "", f"### {alert}", "",
                f"*{spec_list[0].summary}* Severity by window: {severity}.", "",
                f"**What it means.** {meaning}", "", f"**First five minutes.** {do}", "",
                "Paste into Prometheus (the first pair's query; one series per affected model):", "",
                "```promql", spec_list[0].query, "```", ""]
    return out


def render(config: MixinConfig) -> str:
    specs: dict[tuple[str, str], list] = {}
    for spec in alert_specs(config):
        specs.setdefault((spec.alert, spec.cause), []).append(spec)
    out = [
        "<!-- Generated by `kvwatch generate` (kvwatch/mixin/runbooks.py); edit the generator, not this file. -->",
        "# kvwatch runbooks",
        "",
        "One section per alert and one per cause, each leading with what to do in the first five minutes, then "
        "what it means, how to confirm it and the medium-term fix. The pages come first (the objectives' burn "
        "rates: what users feel), then the cause alerts that explain them. Every alert carries `severity`, "
        "`cause` or `objective` (and `symptom` for the vLLM alerts) labels and a `runbook_url` to its section "
        "here (by default as published with this version's documentation, or where the mixin config's "
        "runbook_base_url says; every kvwatch also serves this text at /runbooks, and `kvwatch runbook "
        "<section>` prints a section in a terminal), and, where the mixin config names Grafana, a "
        "`dashboard_url` to the panel that shows it. The same causes are named "
        "by kvwatch's in-process diagnosis (`kvwatch_finding`, `/api/v1/diagnosis`), which also shows the "
        "evidence. Why each severity and `for:`: docs/alerts.md.",
        "",
        "| alert | cause | severity | for |",
        "|---|---|---|---|",
    ]
    for alert, alert_causes in ALERT_CAUSES.items():
        for cause in alert_causes:
            spec_list = specs.get((alert, cause))
            severity = _severity_text(spec_list) if spec_list else f"{config.severity(cause)} (when configured)"
            out.append(f"| {alert} | [{cause}](#{runbook_anchor(alert, cause)}) | {severity} | "
                       f"{config.for_duration(alert)} |")
    out.append("")
    out += _objective_sections(config, specs)
    out += ["## Cause alerts", "",
            "Warnings (and facts) that explain a page, or come before one: each names the likely cause of a "
            "symptom on one engine and the next check.", ""]
    for alert, alert_causes in ALERT_CAUSES.items():
        out += [f'<a id="{runbook_anchor(alert)}"></a>', "", f"## {alert}", "", alert_intro(config, alert), ""]
        for cause in alert_causes:
            spec_list = specs.get((alert, cause), [])
            first, meaning, confirm, do, dont = cause_sections(config, alert, cause).values()
            if spec_list:
                # The rules' own summary; the finding twin (route=finding) only adds a route to the same cause.
                summary = [s for s in spec_list if s.variant != "finding"][-1].summary
                headline = f"*{summary}* Severity {_severity_text(spec_list)}."
            elif cause == "no_reuse":
                headline = "*Only when the mixin config sets `no_reuse_alert: true`* (not in this generation)."
            else:
                headline = ("*Only when the mixin config names an `upstream_histogram`* (not in this "
                            "generation).")
            out += [f'<a id="{runbook_anchor(alert, cause)}"></a>', "", f"### {alert}: {cause}", "", headline, ""]
            out += _first_five(config, alert, first, spec_list)
            out += [f"**What it means.** {meaning}", "", f"**Confirm on the dashboard.** {confirm}", ""]
            out += [f"**Medium term.** {do}", ""] if do else []
            out += [f"**What not to do.** {dont}", ""] if dont else []
    out += [f'<a id="{THROUGHPUT_ANCHOR}"></a>', "", "## Throughput and failures (no alert)", "",
            "The overview's last row, for context when an alert fires.", "",
            "**Tokens per second.** Prompt tokens (cached ones included) and generated tokens per engine. A drop "
            "with a full queue points at the engine (preemptions recompute work); a drop with an empty queue is "
            "less traffic.", "",
            "**Finished requests by reason.** stop and length are normal ends; abort means the client went "
            "away (often a timeout while waiting for a slow first token: see VllmTimeToFirstTokenSlow); error "
            "and repetition are the engine's.", "",
            "**Failed requests (abort, error).** Rising aborts together with slow first tokens or exhaustion are "
            "users giving up; errors without either are worth the engine's log.", ""]
    return "\n".join(out).rstrip("\n") + "\n"
