"""The committed dashboards import into Grafana 10+: valid dashboard JSON with
stable uids, the datasource variable everywhere (never a fixed datasource),
the variables namespace/job/model/engine, unique panel ids, panels inside a
24-column grid without overlaps, and on every panel a unit, a description and
a runbook link into alerts/runbooks.md."""

from __future__ import annotations

import copy
import re

import pytest

from kvwatch.mixin.alerts import ALERT_PANELS
from kvwatch.mixin.config import MixinConfig
from kvwatch.mixin.dashboards import DASHBOARDS, Board, PanelSpec, boards
from kvwatch.signals import (ENGINE_SERIES, GOOD_DIRECTIONS, HEALTH, SCRAPE, SIGNALS, SIGNALS_BY_NAME, TIER_HEALTH,
                             TIER_SERIES, TIER_SIGNALS_BY_NAME, good_direction)
from mixin_support import REPO, iter_panels, load_dashboards, metric_names

EXPECTED_UIDS = {"kvwatch-overview", "kvwatch-exhaustion", "kvwatch-prefix-cache", "kvwatch-first-token",
                 "kvwatch-fleet"}
DATASOURCE_REFS = ("${datasource}", "$datasource")


@pytest.fixture(scope="module")
def dashboards():
    found = load_dashboards()
    assert len(found) == len(DASHBOARDS)
    return found


def test_uids_are_stable_and_unique(dashboards):
    uids = [d["uid"] for d in dashboards.values()]
    assert set(uids) == EXPECTED_UIDS and len(uids) == len(set(uids))
    for dashboard in dashboards.values():
        assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", dashboard["uid"])


def test_top_level_structure_grafana_10_accepts(dashboards):
    for dashboard in dashboards.values():
        assert isinstance(dashboard["title"], str) and dashboard["title"]
        assert dashboard["id"] is None  # imports as a new dashboard
        assert dashboard["schemaVersion"] >= 36
        assert isinstance(dashboard["panels"], list) and dashboard["panels"]
        assert dashboard.get("rows") in (None, [])  # rows are pre-Grafana-5 layout
        assert set(dashboard["time"]) == {"from", "to"}
        assert isinstance(dashboard["templating"]["list"], list)
        assert "kvwatch" in dashboard["tags"]


def test_variables(dashboards):
    for dashboard in dashboards.values():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert list(variables) == ["datasource", "namespace", "job", "model", "engine"]
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        for name in ("namespace", "job", "model", "engine"):
            variable = variables[name]
            assert variable["type"] == "query"
            assert variable["datasource"]["uid"] in DATASOURCE_REFS
            assert variable["includeAll"] and variable["multi"] and variable["allValue"] == ".*"
            assert variable["query"].startswith("label_values(")
        assert variables["model"]["query"].endswith(", model_name)")


def test_no_fixed_datasource_anywhere(dashboards):
    for dashboard in dashboards.values():
        for panel in iter_panels(dashboard):
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] in DATASOURCE_REFS, panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] in DATASOURCE_REFS, (panel["title"], target["refId"])
        # No uid of a real datasource hides anywhere in the file.
        text = str(dashboard)
        assert "'uid': 'prometheus'" not in text


def layout_problems(dashboard: dict) -> list[str]:
    """Duplicate panel ids, panels outside the 24-column grid, overlaps."""
    problems = []
    panels = list(iter_panels(dashboard))
    ids = [p["id"] for p in panels]
    if len(ids) != len(set(ids)):
        problems.append(f"duplicate panel ids in {sorted(ids)}")
    problems += [f"bad id {i!r}" for i in ids if not isinstance(i, int) or i <= 0]
    cells = {}
    for panel in panels:
        grid = panel["gridPos"]
        if grid["w"] < 1 or grid["h"] < 1 or grid["x"] < 0 or grid["y"] < 0 or grid["x"] + grid["w"] > 24:
            problems.append(f"{panel['title']!r} outside the grid: {grid}")
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                if (x, y) in cells:
                    problems.append(f"{panel['title']!r} overlaps {cells[(x, y)]!r}")
                    break
                cells[(x, y)] = panel["title"]
            else:
                continue
            break
    return problems


def test_panel_ids_unique_and_grid_without_overlaps(dashboards):
    for dashboard in dashboards.values():
        assert layout_problems(dashboard) == [], dashboard["uid"]


def test_layout_check_catches_overlaps_and_duplicate_ids(dashboards):
    dashboard = copy.deepcopy(dashboards["kvwatch-overview.json"])
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    panels[1]["gridPos"] = dict(panels[0]["gridPos"])
    panels[2]["id"] = panels[3]["id"]
    problems = layout_problems(dashboard)
    assert any("overlaps" in p for p in problems) and any("duplicate" in p for p in problems)


def test_every_panel_has_unit_description_targets_and_runbook_link():
    # Every panel links its runbook section where the config says the runbooks are (by default as published).
    import json

    from kvwatch.commands.generate import render_all
    from kvwatch.mixin.config import MixinConfig

    files = render_all(MixinConfig())
    linked = [json.loads(text) for name, text in files.items() if name.startswith("dashboards/")]
    assert len(linked) == len(DASHBOARDS)
    runbooks = (REPO / "alerts" / "runbooks.md").read_text()
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', runbooks))
    for dashboard in linked:
        for panel in iter_panels(dashboard):
            if panel["type"] == "row":
                continue
            where = f"{dashboard['uid']} {panel['title']!r}"
            assert panel["description"] and len(panel["description"]) > 20, where
            assert panel["fieldConfig"]["defaults"]["unit"], where
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), where
            ref_ids = [t["refId"] for t in panel["targets"]]
            assert len(ref_ids) == len(set(ref_ids)), where
            links = [link["url"] for link in panel["links"] if link["title"] == "Runbook"]
            assert links, where
            for url in links:
                assert url.split("#", 1)[1] in anchors, (where, url)


def test_overview_covers_what_an_operator_asks(dashboards):
    titles = {p["title"] for p in iter_panels(dashboards["kvwatch-overview.json"])}
    for wanted in ("KV cache usage", "KV headroom (free tokens)", "Prefix-cache hit ratio", "Preemptions",
                   "Time to first token", "Time to first token: mean and its parts", "Queue time",
                   "Tokens per second", "Failed requests (abort, error)", "Active findings"):
        assert wanted in titles
    findings = next(p for p in iter_panels(dashboards["kvwatch-overview.json"]) if p["title"] == "Active findings")
    assert "kvwatch_finding" in findings["targets"][0]["expr"]
    # Past the first token: the gap per output token and the whole request, both exported and
    # both what users feel (the overview had neither).
    panels = {p["title"]: p for p in iter_panels(dashboards["kvwatch-overview.json"])}
    for title, family in (("Inter-token latency (per output token)", "kvwatch_engine_inter_token_latency_seconds"),
                          ("End-to-end request latency", "kvwatch_engine_e2e_request_latency_seconds")):
        exprs = [t["expr"] for t in panels[title]["targets"]]
        assert exprs and all(f"{family}_bucket" in e and "histogram_quantile" in e and "sum by (model_name, le)" in e
                             for e in exprs), exprs
        assert panels[title]["fieldConfig"]["defaults"]["unit"] == "s"


def test_every_alert_links_to_a_panel_that_exists():
    built = boards(MixinConfig())
    for alert, (board, panel) in ALERT_PANELS.items():
        assert panel in built[board].ids, (alert, board, panel)


def test_generated_json_is_sorted_and_indented():
    for path in sorted((REPO / "dashboards").glob("*.json")):
        text = path.read_text()
        assert text.startswith("{\n  \"__inputs\"")  # sort_keys puts __inputs first, indent=2
        assert text.endswith("}\n")


# ---------------------------------------------------------------- thresholds and value mappings


def rendered_color(steps: list[dict], value: float) -> str:
    """The colour Grafana shows a value in: the last threshold step at or below it."""
    color = steps[0]["color"]
    for step in steps[1:]:
        if value >= step["value"]:
            color = step["color"]
    return color


def catalogue_metrics(name: str) -> set[str]:
    """The series a catalogue entry is read from."""
    if name in SIGNALS_BY_NAME:
        return metric_names(SIGNALS_BY_NAME[name].promql.format(sel="", w="5m", by="x", q="0.5"))
    if name in TIER_SIGNALS_BY_NAME:
        return metric_names(TIER_SIGNALS_BY_NAME[name].promql.format(sel="", w="5m", by="x"))
    from kvwatch.signals import STREAM_HEALTH, STREAM_SIGNALS, STREAM_SIZING

    for stream in STREAM_SIGNALS + STREAM_SIZING:
        if name == stream.name:
            return metric_names(stream.promql.format(sel="", w="5m", by="x"))
    from kvwatch.signals.health import ROUTER_HEALTH

    for entry in ENGINE_SERIES + HEALTH + SCRAPE + TIER_HEALTH + TIER_SERIES + STREAM_HEALTH + ROUTER_HEALTH:
        if name in (entry.name, entry.sample_name):
            return {entry.sample_name} | {entry.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    raise KeyError(name)


def colour_problems(dashboard: dict, specs: dict) -> list[str]:
    """Every threshold and value mapping, rendered as Grafana would, against
    the good side its panel's signal declares in the catalogue: green on the
    good side, never green on the other; a panel without a threshold claims
    neither good nor bad."""
    problems = []
    for panel in iter_panels(dashboard):
        if panel["type"] == "row":
            continue
        where = f"{dashboard['uid']} {panel['title']!r}"
        defaults = panel["fieldConfig"]["defaults"]
        steps = defaults["thresholds"]["steps"]
        mappings = [(float(value), option) for mapping in defaults.get("mappings", [])
                    for value, option in mapping["options"].items()]
        if len(steps) == 1:
            if steps[0]["color"] in ("green", "red", "orange") or mappings:
                problems.append(f"{where}: colours values without a threshold")
            continue
        spec = specs[(dashboard["uid"], panel["id"])]
        good = good_direction(spec.signal) if spec.signal else None
        if good not in ("high", "low"):
            problems.append(f"{where}: thresholds without a declared good side ({spec.signal})")
            continue
        shown = set().union(*(metric_names(t["expr"]) for t in panel["targets"]))
        if not catalogue_metrics(spec.signal) & shown:
            problems.append(f"{where}: coloured by {spec.signal}, which it does not show")
        limits = [step["value"] for step in steps[1:]]
        for limit in limits:
            below, at = rendered_color(steps, limit - 1e-9), rendered_color(steps, limit)
            good_color, bad_color = (at, below) if good == "high" else (below, at)
            if good_color != "green" or bad_color == "green":
                problems.append(f"{where}: {good_color} on the good ({good}) side of {limit:g}, {bad_color} on the "
                                f"other")
        for value, option in mappings:
            on_good_side = value >= max(limits) if good == "high" else value < min(limits)
            if option.get("color") != rendered_color(steps, value) or (option.get("color") == "green") != on_good_side:
                problems.append(f"{where}: {value:g} shown as {option.get('text')!r} in {option.get('color')}, "
                                f"but good is {good}")
    return problems


def board_specs() -> dict:
    return {(board.uid, panel_id): board.specs[key]
            for board in boards(MixinConfig()).values() for key, panel_id in board.ids.items()}


def test_every_threshold_and_value_mapping_is_green_on_the_declared_good_side(dashboards):
    specs = board_specs()
    coloured = 0
    for dashboard in dashboards.values():
        assert colour_problems(dashboard, specs) == [], dashboard["uid"]
        coloured += sum(len(p.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])) > 1
                        for p in iter_panels(dashboard))
    assert coloured >= 14


def test_the_colour_check_catches_an_inverted_threshold_and_mapping(dashboards):
    dashboard = copy.deepcopy(dashboards["kvwatch-overview.json"])
    up = next(p for p in iter_panels(dashboard) if p["title"] == "Prometheus scraping kvwatch")
    # What the overview shipped: red at 1, green below, and an unmapped 0.
    up["fieldConfig"]["defaults"]["thresholds"]["steps"] = [{"color": "green", "value": None},
                                                           {"color": "red", "value": 1}]
    problems = colour_problems(dashboard, board_specs())
    assert any("Prometheus scraping kvwatch" in p and "good (high)" in p for p in problems)
    assert any("'up' in green" in p or "'down' in red" in p for p in problems)


def test_good_sides_are_declared_in_the_catalogue():
    for entry in SIGNALS + ENGINE_SERIES + HEALTH + SCRAPE:
        assert entry.good in GOOD_DIRECTIONS, entry.name
    assert good_direction("up") == "high" and good_direction("kvwatch_up") == "high"
    assert good_direction("kvwatch_kv_cache_usage_ratio") == "low"
    assert good_direction("kvwatch_prefix_cache_hit_ratio") == "high"
    assert good_direction("kvwatch_poll_errors_total") == "low"
    assert good_direction("kvwatch_requests_running") is None


def test_a_threshold_needs_a_signal_with_a_good_side():
    def add(**kwargs):
        Board("overview", MixinConfig()).add(PanelSpec("p", "P", "a panel for the test", "short", [("up", "")],
                                                       threshold=1, **kwargs))

    with pytest.raises(ValueError, match="needs the signal"):
        add()
    with pytest.raises(ValueError, match="no good side"):
        add(signal="kvwatch_requests_running")
    add(signal="kvwatch_up")


KVWATCH_HEALTH = {"up", "kvwatch_up", "kvwatch_poll_errors_total"}


def test_the_overview_leads_with_the_engine_and_keeps_kvwatch_health_below(dashboards):
    dashboard = dashboards["kvwatch-overview.json"]
    specs = board_specs()
    panels = [p for p in iter_panels(dashboard) if p["type"] != "row"]
    top_y = min(p["gridPos"]["y"] for p in panels)
    top = [p for p in panels if p["gridPos"]["y"] == top_y]
    assert [p["type"] for p in top] == ["stat"] * 5
    assert [specs[(dashboard["uid"], p["id"])].signal for p in top] == [
        "kvwatch_kv_cache_usage_ratio", "kvwatch_prefix_cache_hit_ratio", "kvwatch_time_to_first_token_seconds",
        "kvwatch_requests_waiting", "kvwatch_finding"]
    assert "histogram_quantile(0.95," in top[2]["targets"][0]["expr"]

    def reads_health(panel):
        return bool(set().union(*(metric_names(t["expr"]) for t in panel["targets"])) & KVWATCH_HEALTH)

    health = [p for p in panels if reads_health(p)]
    engine = [p for p in panels if not reads_health(p)]
    assert {p["title"] for p in health} == {"Prometheus scraping kvwatch", "kvwatch polling vLLM",
                                            "Failed polls by reason"}
    assert min(p["gridPos"]["y"] for p in health) >= max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in engine)


def test_every_board_marks_restarts_changes_and_firing_alerts(dashboards):
    from kvwatch.mixin.config import ALERTS

    for dashboard in dashboards.values():
        found = {a["name"]: a for a in dashboard["annotations"]["list"]}
        assert set(found) == {"Engine restarts", "Config and model changes", "Firing alerts"}, dashboard["uid"]
        for annotation in found.values():
            assert annotation["datasource"]["uid"] in DATASOURCE_REFS and annotation["enable"]
            assert annotation["titleFormat"] and annotation["step"]
            # Every label a title or text names is one the query keeps.
            kept = set(re.findall(r"by \(([^)]*)\)", annotation["expr"])[0].split(", ")) if "by (" in \
                annotation["expr"] else None
            for label in re.findall(r"\{\{(\w+)\}\}", annotation["titleFormat"] + annotation["textFormat"]):
                assert kept is None or label in kept, (dashboard["uid"], annotation["name"], label)
        # Restarts from Prometheus' own history of the engine's counters, over
        # $__rate_interval so consecutive steps overlap and no reset falls between.
        assert "resets(kvwatch_engine_prompt_tokens_total{" in found["Engine restarts"]["expr"]
        assert "[$__rate_interval]" in found["Engine restarts"]["expr"]
        changes = found["Config and model changes"]["expr"]
        assert 'symptom="change"' in changes and "unless" in changes
        alerts = found["Firing alerts"]["expr"]
        assert alerts.startswith('ALERTS{alertstate="firing"')
        named = re.search(r'alertname=~"([^"]+)"', alerts).group(1).split("|")
        assert sorted(named) == sorted(ALERTS)


def legend_problems(dashboard: dict, instance_label: str) -> list[str]:
    """Legends name replicas by the config's instance_label, before the model, never as
    `@ address`; every label a legend names is one its query keeps (a label
    of an aggregation's by/on list, a label_replace's target, or any label of a bare selector); a query
    kept per replica names the replica."""
    problems = []
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []):
            legend, expr = target.get("legendFormat") or "", target["expr"]
            where = f"{dashboard['uid']} {panel['title']!r} {target['refId']} {legend!r}"
            if target.get("format") == "table":
                continue  # tables show labels as columns, not legends
            if "@" in legend:
                problems.append(f"{where}: an address, not a replica name")
            named = re.findall(r"\{\{\s*(\w+)\s*\}\}", legend)
            groups = [set(re.split(r",\s*", g.strip())) - {"le"}
                      for g in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr)]
            kept = set().union(*groups) if groups else None
            if kept is not None:  # label_replace(..., "dst", "value", "src", "regex") keeps its dst
                kept |= set(re.findall(r'\)\s*,\s*"(\w+)"\s*,\s*"[^"]*"\s*,\s*"[^"]*"\s*,\s*"[^"]*"\s*\)', expr))
            for label in named:
                if kept is not None and label not in kept:
                    problems.append(f"{where}: {{{{{label}}}}} is not a label the query keeps")
            if groups and all(instance_label in g for g in groups):
                if instance_label not in named:
                    problems.append(f"{where}: a per-replica query whose legend does not name {instance_label}")
                elif "model_name" in named and named.index("model_name") < named.index(instance_label):
                    problems.append(f"{where}: the replica is not named before its model")
    return problems


def test_legends_name_replicas_by_the_instance_label(dashboards):
    for dashboard in dashboards.values():
        assert legend_problems(dashboard, "instance") == [], dashboard["uid"]


def test_legends_follow_a_customised_instance_label():
    import json

    from kvwatch.commands.generate import render_all
    from kvwatch.mixin.config import config_from_mapping

    files = render_all(config_from_mapping({"instance_label": "pod", "upstream_histogram": "app_retrieval_seconds",
                                            "upstream_join_labels": ["namespace"]}))
    for name, text in files.items():
        if name.startswith("dashboards/"):
            dashboard = json.loads(text)
            assert legend_problems(dashboard, "pod") == [], name
            legends = [t.get("legendFormat") or "" for p in iter_panels(dashboard) for t in p.get("targets", [])]
            assert not any("{{instance}}" in legend for legend in legends), name
            assert any(legend.startswith("{{pod}} {{model_name}} engine {{engine}}") for legend in legends), name


def test_the_prefix_cache_board_closes_with_what_the_cache_is_worth(dashboards):
    board = dashboards["kvwatch-prefix-cache.json"]
    rows = [p for p in board["panels"] if p["type"] == "row"]
    assert rows[-1]["title"] == "What the cache is worth"
    after = [p for p in board["panels"] if p["gridPos"]["y"] > rows[-1]["gridPos"]["y"]]
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in after}
    assert set(exprs) == {"Prefill seconds the cache saved, by tier", "Prefill seconds lost to recomputation",
                          "Prefill seconds per hour more cache would buy (estimate)"}
    assert "kvwatch_engine_prompt_tokens_cached_by_source_total" not in exprs["Prefill seconds the cache saved, by tier"]
    assert "kvwatch_kv_events_lost_prefill_seconds" in exprs["Prefill seconds lost to recomputation"]
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in after}
    assert units == {"Prefill seconds the cache saved, by tier": "s", "Prefill seconds lost to recomputation": "s",
                     "Prefill seconds per hour more cache would buy (estimate)": "suffix:s/h"}


def test_the_worth_row_plots_the_sidecar_s_own_figures_over_its_window(dashboards):
    # The saved panel plotted the PromQL twin (the fallback rate over the rate
    # interval) under a description of the sidecar's position-priced figure,
    # and the lost panel drew an increase over the rate interval beside the
    # stream's gauge over kvwatch's window, the stream's ignoring $model/$engine.
    board = dashboards["kvwatch-prefix-cache.json"]
    panels = {p["title"]: p for p in iter_panels(board)}
    saved, lost = panels["Prefill seconds the cache saved, by tier"], panels["Prefill seconds lost to recomputation"]
    bought = panels["Prefill seconds per hour more cache would buy (estimate)"]
    for panel in (saved, lost, bought):
        assert "kvwatch's window" in panel["description"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert "$__rate_interval" not in expr and "increase(" not in expr, (panel["title"], expr)
            assert 'model_name=~"$model"' in expr and 'engine=~"$engine"' in expr, (panel["title"], expr)
    assert metric_names(saved["targets"][0]["expr"]) == {"kvwatch_cache_saved_prefill_seconds"}
    assert "{{tier}}" in saved["targets"][0]["legendFormat"]
    legends = {t["legendFormat"].split(" {{")[0]: metric_names(t["expr"]) for t in lost["targets"]}
    assert legends == {"preempted, the page's upper bound": {"kvwatch_cache_lost_prefill_seconds"},
                       "evicted before reuse, the stream's count": {"kvwatch_kv_events_lost_prefill_seconds",
                                                                    "kvwatch_engine_info"}}
