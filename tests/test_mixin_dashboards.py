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
from kvwatch.mixin.dashboards import DASHBOARDS, boards
from mixin_support import REPO, iter_panels, load_dashboards

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
    # The links exist where the config says where the runbooks are served
    # (by default there is no host to point at, and no link).
    import json

    from kvwatch.commands.generate import render_all
    from kvwatch.mixin.config import config_from_mapping

    files = render_all(config_from_mapping({"runbook_url_pattern": "https://git.example.org/runbooks.md#{anchor}"}))
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


def test_every_alert_links_to_a_panel_that_exists():
    built = boards(MixinConfig())
    for alert, (board, panel) in ALERT_PANELS.items():
        assert panel in built[board].ids, (alert, board, panel)


def test_generated_json_is_sorted_and_indented():
    for path in sorted((REPO / "dashboards").glob("*.json")):
        text = path.read_text()
        assert text.startswith("{\n  \"__inputs\"")  # sort_keys puts __inputs first, indent=2
        assert text.endswith("}\n")
