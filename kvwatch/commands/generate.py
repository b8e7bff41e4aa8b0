"""`kvwatch generate`: write the dashboards, rules, alerts, runbooks, Grafana
alert provisioning and Kubernetes manifests from the signal catalogue and one
mixin config. The output is deterministic (sorted JSON keys, stable uids and
panel ids), so the generated files are committed and a test regenerates them
to prove they are current.

    kvwatch generate [--config mixin.yaml] [--out DIR] [--check] [--print-config]

It writes under the current directory unless --out names another (never into
the installed package), and says where.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from grafanalib._gen import DashboardEncoder

from kvwatch.engines.coverage import engines_markdown
from kvwatch.mixin import metrics_doc, settings_doc
from kvwatch.mixin import dashboards as dash
from kvwatch.mixin import alertmanager, grafana_alerts, rules, runbooks
from kvwatch.mixin.alerts import ALERT_PANELS
from kvwatch.mixin.config import (DASHBOARD_PATH_PATTERN, MixinConfig, MixinConfigError, central_config, describe_config,
                                  load_config)

# The checkout's root, for its tests (`kvwatch generate` itself writes into the current directory).
REPO_ROOT = Path(__file__).resolve().parents[2]
# Directories whose every file `generate` owns: a file there that it no
# longer writes is stale. (deploy/ also holds hand-written files.)
OWNED_DIRS = ("dashboards", "alerts")
RULES_FILE = "alerts/kvwatch-rules.yaml"
PROMETHEUS_RULE_FILE = "alerts/kvwatch-prometheusrule.yaml"
# The same rules over central mode's exports (mode: central): kubernetes/central*/ and the chart's central mode.
CENTRAL_RULES_FILE = "alerts/kvwatch-central-rules.yaml"
CENTRAL_PROMETHEUS_RULE_FILE = "alerts/kvwatch-central-prometheusrule.yaml"
RUNBOOKS_FILE = "alerts/runbooks.md"
GRAFANA_RULES_FILE = "alerts/grafana/kvwatch-alert-rules.json"
GRAFANA_NOTIFICATIONS_FILE = "alerts/grafana/kvwatch-notifications.example.yaml"
ALERTMANAGER_FILE = "alerts/alertmanager.example.yaml"


def to_json(data) -> str:
    return json.dumps(data, cls=DashboardEncoder, sort_keys=True, indent=2) + "\n"


def panel_ids(boards: dict[str, dash.Board]) -> dict[tuple[str, str], tuple[str, int]]:
    return {(key, panel): (board.uid, panel_id) for key, board in boards.items() for panel, panel_id in board.ids.items()}


def render_all(config: MixinConfig) -> dict[str, str]:
    """{path relative to the output root: text} for everything generate writes."""
    boards = dash.boards(config)
    ids = panel_ids(boards)
    files: dict[str, str] = {}
    dashboards = {}
    for key, board in boards.items():
        text = to_json(board.build().to_json_data())
        dashboards[dash.file_name(key)] = text
        files[f"dashboards/{dash.file_name(key)}"] = text
    files[RULES_FILE] = rules.rules_file(config, ids)
    files[PROMETHEUS_RULE_FILE] = rules.prometheus_rule(config, ids)
    files[CENTRAL_RULES_FILE] = rules.rules_file(central_config(config), ids)
    files[CENTRAL_PROMETHEUS_RULE_FILE] = rules.prometheus_rule(central_config(config), ids)
    files[RUNBOOKS_FILE] = runbooks.render(config)
    files[GRAFANA_RULES_FILE] = to_json(grafana_alerts.provisioning(config, ids))
    files[GRAFANA_NOTIFICATIONS_FILE] = (
        "# Example Grafana contact points and notification policy for kvwatch's alerts (docs/alerts.md).\n"
        "# Replace the webhook URLs; provisioning `policies` replaces the organisation's whole policy tree,\n"
        "# so merge these routes into yours instead if you already have one.\n"
        + rules.dump_yaml(grafana_alerts.notification_example(config)))
    files[ALERTMANAGER_FILE] = (
        "# Example Alertmanager configuration for kvwatch's Prometheus rules (docs/alerts.md): one notification\n"
        "# per engine and model, pages for the objectives, cause alerts to the team that can act, inhibitions.\n"
        "# Replace the webhook URLs with your receivers (or merge the routes into your tree).\n"
        + rules.dump_yaml(alertmanager.example(config)))
    files.update({f"deploy/{path}": text for path, text in _manifests(config, files, dashboards, ids).items()})
    files["docs/metrics.md"] = metrics_doc.render()
    files["docs/configuration.md"] = settings_doc.render()
    files["docs/engines-signals.md"] = ("# Signals by engine\n\nGenerated from the engine adapters' tables by `kvwatch generate`; "
                                        "do not edit by hand. What the marks mean: [engines.md](engines.md).\n\n"
                                        + engines_markdown())
    return files


def dashboard_paths(ids: dict[tuple[str, str], tuple[str, int]]) -> dict[str, str]:
    """Each alert's panel as a path under Grafana's URL (the chart's links.dashboardBaseUrl)."""
    return {alert: DASHBOARD_PATH_PATTERN.format(uid=ids[panel][0], panel_id=ids[panel][1],
                                                 model_name="{{ $labels.model_name }}", engine="{{ $labels.engine }}")
            for alert, panel in ALERT_PANELS.items()}


def _manifests(config: MixinConfig, files: dict[str, str], dashboards: dict[str, str],
               ids: dict[tuple[str, str], tuple[str, int]]) -> dict[str, str]:
    try:
        manifests = importlib.import_module("kvwatch.mixin.manifests")
    except ModuleNotFoundError:  # the manifests module is optional
        return {}
    out = manifests.render_manifests(config, prometheus_rule=files[PROMETHEUS_RULE_FILE], dashboards=dashboards,
                                     central_rule=files[CENTRAL_PROMETHEUS_RULE_FILE])
    # The Helm chart, from the same settings, containers, rules and dashboards.
    from kvwatch.mixin import helm
    from kvwatch.mixin.config import deploy_settings

    out.update(helm.render_chart(deploy_settings(config), files[PROMETHEUS_RULE_FILE], dashboards,
                                 config.runbook_base_url, central_rule=files[CENTRAL_PROMETHEUS_RULE_FILE],
                                 dashboard_base=config.dashboard_base_url or "", dashboard_paths=dashboard_paths(ids)))
    return out


def stale_files(files: dict[str, str], out: Path) -> list[str]:
    """Paths under `out` that differ from `files`, are missing, or sit in an
    owned directory without being generated."""
    problems = []
    for relative, text in sorted(files.items()):
        path = out / relative
        if not path.is_file():
            problems.append(f"{relative}: missing")
        elif path.read_text() != text:
            problems.append(f"{relative}: differs")
    for directory in OWNED_DIRS:
        root = out / directory
        if root.is_dir():
            for path in sorted(p for p in root.rglob("*") if p.is_file()):
                relative = path.relative_to(out).as_posix()
                if relative not in files:
                    problems.append(f"{relative}: not generated any more")
    return problems


def write(files: dict[str, str], out: Path) -> list[str]:
    """Write changed files; returns the paths written."""
    written = []
    for relative, text in sorted(files.items()):
        path = out / relative
        if path.is_file() and path.read_text() == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(relative)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="mixin config YAML (fields: kvwatch generate --print-config)")
    parser.add_argument("--out", default=None, help="output root (default: the current directory)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if any generated file is missing or differs")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective config as commented YAML and exit")


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except MixinConfigError as exc:
        print(f"kvwatch generate: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(describe_config(config))
        return 0
    out = Path(args.out) if args.out else Path.cwd()
    where = f"{out.resolve()}" + ("" if args.out else " (the current directory; --out DIR for another)")
    try:
        files = render_all(config)
    except runbooks.RunbookProseError as exc:
        print(f"kvwatch generate: {exc}", file=sys.stderr)
        return 2
    if args.check:
        problems = stale_files(files, out)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print(f"kvwatch generate: {len(problems)} generated file(s) out of date in {where}; run `kvwatch generate`",
                  file=sys.stderr)
            return 1
        print(f"kvwatch generate: {len(files)} files up to date in {where}")
        return 0
    written = write(files, out)
    for relative in written:
        print(out / relative)
    print(f"kvwatch generate: {len(files)} files in {where}, {len(written)} changed", file=sys.stderr)
    return 0
