"""The house style of the Grafana dashboards, a thin layer over grafanalib:
the boards' names (DASHBOARDS), a board that lays panels out on the grid with
ids that do not move (Board), what every panel must have (PanelSpec: a unit,
a description, a runbook link, the datasource variable; thresholds and value
mappings coloured from the catalogue's good side), the dashboard variables
and annotations, and the scopes and fragments the boards' queries are built
from (Views). The boards themselves are in dashboards.py."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from grafanalib import core as g

from kvwatch.mixin.config import ALERTS, MixinConfig
from kvwatch.mixin.promql import Fragments, Scope, num
from kvwatch.signals import ENGINE_SERIES, QUANTILES, SIGNALS_BY_NAME, UNITS, good_direction

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
GRID_WIDTH = 24
# Grafana 10.4's schema; Grafana migrates older ones on import, newer ones load as they are.
SCHEMA_VERSION = 39
# Colours of a threshold's two sides: the good side is GOOD, the other the
# panel's bad_color; a panel without a threshold claims neither.
GOOD = "green"
NEUTRAL = "text"


# dashboard key -> (uid suffix, title, description)
DASHBOARDS = {
    "overview": ("overview", "kvwatch / Overview",
                 "vLLM KV cache per model and engine: usage and headroom, prefix-cache hit ratio, preemptions, time "
                 "to first token and its parts, queue, throughput, failures, and kvwatch's active findings."),
    "exhaustion": ("exhaustion", "kvwatch / KV cache exhaustion",
                   "Is the KV cache full, and is it too many requests or too long ones? The panels behind "
                   "VllmKvCacheExhausted."),
    "prefix_cache": ("prefix-cache", "kvwatch / Prefix cache",
                     "Why is the prefix-cache hit ratio low: caching off, a cold cache, a changed prefix, eviction "
                     "before reuse, or no reuse? The panels behind VllmPrefixCacheHitRateLow, and the LMCache tier's "
                     "row where kvwatch reads one (--lmcache-target)."),
    "first_token": ("first-token", "kvwatch / First token",
                    "Where does the time to first token go: queue (for KV or for compute), prefill, front end, "
                    "upstream? The panels behind VllmTimeToFirstTokenSlow."),
    "fleet": ("fleet", "kvwatch / Fleet",
              "One replica against the other replicas of its model, a row per replica: imbalance (one exhausted "
              "or queueing while peers have room), lost prefix affinity, a cold replica. The panels behind "
              "VllmFleetReplicaOutlier."),
}


@dataclass
class PanelSpec:
    key: str
    title: str
    description: str
    unit: str
    targets: list[tuple[str, str]]  # (expr, legend)
    kind: str = "timeseries"  # timeseries | stat | table
    width: int = 12
    height: int = 8
    runbook: str | None = None  # runbook anchor
    threshold: float | None = None
    stacked: bool = False
    instant: bool = False
    # The catalogue entry (signals/catalogue.py) the threshold and value mappings are
    # about: its declared good side ("high" or "low") colours them.
    signal: str | None = None
    mappings: tuple[tuple[float, str], ...] = ()  # (value, text) of a stat
    bad_color: str = "red"  # "orange" where the bad side is not harm (too little traffic to judge)


@dataclass
class Board:
    key: str
    config: MixinConfig
    panels: list = field(default_factory=list)
    ids: dict = field(default_factory=dict)
    specs: dict = field(default_factory=dict)
    _x: int = 0
    _y: int = 0
    _line_height: int = 0
    _taken: dict = field(default_factory=dict)
    # Laid out after the catalogue's panels (a board's closing rows).
    closing: list = field(default_factory=list)

    @property
    def uid(self) -> str:
        return f"{self.config.dashboard_uid_prefix}-{DASHBOARDS[self.key][0]}"

    def _new_line(self) -> None:
        if self._x:
            self._y += self._line_height
        self._x, self._line_height = 0, 0

    def _take_id(self, key: str) -> int:
        """A panel's id comes from its key, not its position, so adding a
        panel changes that panel alone in the generated JSON (and links to
        the others' viewPanel stay valid)."""
        panel_id = zlib.crc32(key.encode()) % 1_000_000_000 + 1
        if panel_id in self._taken:
            raise ValueError(f"panel keys {key!r} and {self._taken[panel_id]!r} share id {panel_id} on {self.key}")
        self._taken[panel_id] = key
        return panel_id

    def row(self, title: str) -> None:
        self._new_line()
        self.panels.append(g.RowPanel(title=title, id=self._take_id(f"row:{title}"),
                                      gridPos=g.GridPos(h=1, w=GRID_WIDTH, x=0, y=self._y)))
        self._y += 1

    def add(self, spec: PanelSpec) -> None:
        if spec.key in self.ids:
            raise ValueError(f"duplicate panel key {spec.key} on {self.key}")
        if self._x + spec.width > GRID_WIDTH:
            self._new_line()
        grid = g.GridPos(h=spec.height, w=spec.width, x=self._x, y=self._y)
        self._x += spec.width
        self._line_height = max(self._line_height, spec.height)
        panel_id = self._take_id(spec.key)
        self.ids[spec.key] = panel_id
        self.specs[spec.key] = spec
        self.panels.append(_panel(spec, panel_id, grid, self.config))

    def build(self) -> g.Dashboard:
        _, title, description = DASHBOARDS[self.key]
        return g.Dashboard(
            title=title,
            uid=self.uid,
            description=description,
            tags=list(self.config.dashboard_tags),
            panels=self.panels,
            templating=g.Templating(list=_variables()),
            annotations=g.Annotations(list=dashboard_annotations(self.config)),
            time=g.Time("now-1h", "now"),
            refresh="30s",
            timezone="browser",
            graphTooltip=g.GRAPH_TOOLTIP_MODE_SHARED_CROSSHAIR,
            schemaVersion=SCHEMA_VERSION,
            editable=True,
            links=[{
                "asDropdown": True, "icon": "external link", "includeVars": True, "keepTime": True,
                "tags": [self.config.dashboard_tags[0]] if self.config.dashboard_tags else [],
                "targetBlank": False, "title": "kvwatch dashboards", "type": "dashboards",
            }],
        )


def _panel(spec: PanelSpec, panel_id: int, grid: g.GridPos, config: MixinConfig):
    targets = [
        g.Target(expr=expr, legendFormat=legend, refId=chr(ord("A") + i), datasource=DATASOURCE,
                 instant=spec.instant, format="table" if spec.kind == "table" else "time_series",
                 intervalFactor=1)
        for i, (expr, legend) in enumerate(spec.targets)
    ]
    links = []
    if spec.runbook:
        links.append({"title": "Runbook", "url": config.runbook_link(spec.runbook),
                      "targetBlank": True})
    steps = threshold_steps(spec)
    common = dict(title=spec.title, description=spec.description, id=panel_id, gridPos=grid,
                  dataSource=DATASOURCE, targets=targets, links=links, maxDataPoints=None)
    if spec.kind == "stat":
        return g.Stat(format=spec.unit, reduceCalc="lastNotNull", graphMode="none", thresholds=steps,
                      mappings=value_mappings(spec, steps), noValue="no data", **common)
    if spec.kind == "table":
        # Several instant queries become one row per series (per replica)
        # with a column per query.
        merge = [{"id": "merge", "options": {}}] if len(spec.targets) > 1 else []
        return g.Table(unit=spec.unit, thresholds=steps, transformations=merge + [
            {"id": "organize", "options": {"excludeByName": {"Time": True}, "renameByName": {}}}], **common)
    return g.TimeSeries(unit=spec.unit, thresholds=steps, fillOpacity=10 if spec.stacked else 0,
                        stacking={"mode": "normal"} if spec.stacked else {"mode": "none"},
                        thresholdsStyleMode="line" if spec.threshold is not None else "off",
                        legendDisplayMode="table", legendPlacement="bottom",
                        legendCalcs=["lastNotNull", "max"], tooltipMode="multi", **common)


def threshold_steps(spec: PanelSpec) -> list[dict]:
    """Grafana's threshold steps (a step colours values at or above it) from
    the good side the catalogue declares for the panel's signal: green on the
    good side, bad_color on the other."""
    if spec.threshold is None:
        if spec.mappings:
            raise ValueError(f"panel {spec.key}: value mappings need a threshold to colour them")
        return [{"color": NEUTRAL, "value": None}]
    if spec.signal is None:
        raise ValueError(f"panel {spec.key}: a threshold needs the signal whose good side it marks")
    good = good_direction(spec.signal)
    if good not in ("high", "low"):
        raise ValueError(f"panel {spec.key}: {spec.signal} declares no good side (good=), so no threshold")
    below, above = (spec.bad_color, GOOD) if good == "high" else (GOOD, spec.bad_color)
    return [{"color": below, "value": None}, {"color": above, "value": spec.threshold}]


def color_at(steps: list[dict], value: float) -> str:
    """The colour Grafana gives a value: that of the last step at or below it."""
    color = steps[0]["color"]
    for step in steps[1:]:
        if value >= step["value"]:
            color = step["color"]
    return color


def value_mappings(spec: PanelSpec, steps: list[dict]) -> list[dict]:
    """A stat's value -> text mappings, each in the colour its value has
    under the thresholds (so a mapping cannot contradict them)."""
    if not spec.mappings:
        return []
    return [{"type": "value", "options": {
        f"{value:g}": {"text": text, "color": color_at(steps, value), "index": i}
        for i, (value, text) in enumerate(spec.mappings)}}]


def _variables() -> list:
    def query_variable(name: str, label: str, query: str) -> g.Template:
        variable = g.Template(name=name, label=label, query=query, dataSource=DATASOURCE, includeAll=True,
                              multi=True, allValue=".*", default="$__all", refresh=g.REFRESH_ON_TIME_RANGE_CHANGE)
        # Grafana's own shape for "All" selected in a multi-value variable.
        variable._current = {"selected": True, "text": ["All"], "value": ["$__all"]}
        return variable

    return [
        g.Template(name="datasource", label="Data source", query="prometheus", type="datasource",
                   default="Prometheus"),
        query_variable("namespace", "Namespace", "label_values(kvwatch_up, namespace)"),
        query_variable("job", "Job", 'label_values(kvwatch_up{namespace=~"$namespace"}, job)'),
        query_variable("model", "Model", 'label_values(kvwatch_engine_info{namespace=~"$namespace",job=~"$job"}, '
                                         "model_name)"),
        query_variable("engine", "Engine", 'label_values(kvwatch_engine_info{namespace=~"$namespace",job=~"$job",'
                                           'model_name=~"$model"}, engine)'),
    ]


TARGET_SEL = 'namespace=~"$namespace",job=~"$job"'
ENGINE_SEL = TARGET_SEL + ',model_name=~"$model",engine=~"$engine"'
# The LMCache tier's series (kvwatch_lmcache_*) are per model, without `engine`.
TIER_SEL = TARGET_SEL + ',model_name=~"$model"'
# kvwatch_finding carries model_name="*" for findings about the whole target.
FINDING_SEL = TARGET_SEL + ',model_name=~"$model|\\\\*"'


def dashboard_annotations(config: MixinConfig) -> list[dict]:
    """Marks on every board's time axis: engine restarts (the engine's
    prompt-token counter reset, from Prometheus' own history), cache-config,
    model and adapter changes (kvwatch's change findings, as they appear),
    and kvwatch's alerts while they fire. Over $__rate_interval, which
    overlaps consecutive steps by a scrape, so no reset falls between two."""
    inst = config.instance_label
    by = ", ".join((*config.group_labels, inst, "model_name", "engine"))
    change = f'kvwatch_finding{{{FINDING_SEL},symptom="change",cause!="engine_restarted"}}'
    alert_names = "|".join(sorted(ALERTS))

    def query(name: str, color: str, expr: str, title: str, text: str, tags: str) -> dict:
        return {"datasource": DATASOURCE, "enable": True, "hide": False, "iconColor": color, "name": name,
                "expr": expr, "step": "30s", "titleFormat": title, "textFormat": text, "tagKeys": tags,
                "useValueForTime": False}

    return [
        query("Engine restarts", "orange",
              f"sum by ({by}) (resets(kvwatch_engine_prompt_tokens_total{{{ENGINE_SEL}}}[{RATE}])) > 0",
              "engine restarted", "{{model_name}} engine {{engine}} on {{" + inst + "}}: counters reset, "
              "the prefix cache starts cold", "model_name,engine"),
        query("Config and model changes", "purple",
              f"max by (cause, {by}) (\n  {change}\n  unless\n  {change} offset {RATE}\n)",
              "{{cause}}", "{{model_name}} engine {{engine}} on {{" + inst + "}}: comparisons across this "
              "change do not hold (kvwatch_finding symptom=change; /api/v1/diagnosis has the detail)",
              "cause,model_name"),
        query("Firing alerts", "red",
              f'ALERTS{{alertstate="firing",alertname=~"{alert_names}",{TARGET_SEL},model_name=~"$model|"}}',
              "{{alertname}} ({{severity}})", "{{cause}} {{model_name}} on {{" + inst + "}}",
              "alertname,severity,cause"),
    ]


class Views:
    """Scopes and fragments of the dashboards: per engine and per model."""

    def __init__(self, config: MixinConfig):
        self.config = config
        inst = config.instance_label
        self.engine = Scope(ENGINE_SEL, RATE, (inst, "model_name", "engine"))
        self.model = Scope(ENGINE_SEL, RATE, ("model_name",))
        self.fe = Fragments(self.engine, config)
        self.fm = Fragments(self.model, config)
        # A replica first, by the config's instance_label (pod on Kubernetes).
        self.instance_legend = "{{" + inst + "}}"
        self.engine_legend = self.instance_legend + " {{model_name}} engine {{engine}}"
        self.model_legend = "{{model_name}}"

    def sig(self, name: str, scope: str = "engine", q: float | None = None) -> str:
        return (self.engine if scope == "engine" else self.model).signal(name, q)

    def help(self, name: str) -> str:
        return SIGNALS_BY_NAME[name].help

    def unit(self, name: str) -> str:
        return UNITS[SIGNALS_BY_NAME[name].unit].grafana

    def quantile_targets(self, name: str, scope: str = "engine", legend_prefix: str = "") -> list[tuple[str, str]]:
        legend = self.engine_legend if scope == "engine" else self.model_legend
        return [(self.sig(name, scope, q), f"{legend_prefix}p{q * 100:g} {legend}") for q in QUANTILES]

    def findings(self, symptom: str | None = None) -> str:
        extra = f',symptom="{symptom}"' if symptom else ""
        inst = self.config.instance_label
        return (f"max by (symptom, cause, severity, model_name, engine, {inst}) "
                f"(kvwatch_finding{{{FINDING_SEL}{extra}}})")

    def engine_quantile_targets(self, histogram: str) -> list[tuple[str, str]]:
        """Quantiles per model of an engine histogram kvwatch re-exports (kvwatch_engine_<histogram>)."""
        return [(self.length_quantile(histogram, q), f"p{q * 100:g} {self.model_legend}") for q in QUANTILES]

    def engine_help(self, histogram: str) -> str:
        return next(e.help for e in ENGINE_SERIES if e.name == f"kvwatch_engine_{histogram}")

    def length_quantile(self, histogram: str, q: float) -> str:
        return (f"histogram_quantile({num(q)}, sum by (model_name, le) "
                f"(rate(kvwatch_engine_{histogram}_bucket{{{ENGINE_SEL}}}[{RATE}])))")
