"""An example Alertmanager configuration for the Prometheus rules
(alerts/alertmanager.example.yaml): one notification per model, pages for
what users feel, the cause alerts to the team that can act on them,
and inhibitions that keep one fault from notifying twice.

- Grouping: by the group labels and model_name, the labels of a page (an
  objective burns over every replica of a model), so an incident across 8
  replicas is one notification, and the page and the cause alerts that
  explain it (each naming its replica) share one group key.
- Routes: critical (the objectives' fast burns, an unreachable or stuck
  engine, a cache that preempts) to the pager, in the model's group; info to tickets; the objectives' slow burns to the platform team
  (aborts: the application team); cause alerts by cause to the team that owns
  the fix (the same split as the Grafana example, grafana_alerts.py).
- Inhibitions: an objective's page silences its own slower burn for the same
  model; an exhausted cache silences its forecast; a kvwatch that Prometheus
  cannot scrape silences what kvwatch would have said about its engine.

The page carries the cause beside it in its `cause_alerts` annotation (the
cause alerts firing for its engine, read from ALERTS when it is sent), and
the cause alert itself reaches its team in the same engine's group.
"""

from __future__ import annotations

from kvwatch.mixin.config import MixinConfig
from kvwatch.mixin.grafana_alerts import APPLICATION_CAUSES, PLATFORM_CAUSES

RECEIVERS = {
    "pager": "https://pager.example.com/hooks/kvwatch",
    "platform": "https://chat.example.com/hooks/llm-platform",
    "application": "https://chat.example.com/hooks/llm-application",
    "tickets": "https://tickets.example.com/hooks/kvwatch",
}


def group_by(config: MixinConfig) -> list[str]:
    return list(config.model_labels)


def example(config: MixinConfig, urls: dict[str, str] | None = None) -> dict:
    """The configuration; `urls` replaces the receivers' webhook URLs (tests)."""
    urls = {**RECEIVERS, **(urls or {})}
    model = group_by(config)
    engine = list(config.engine_labels)
    target = [*config.group_labels, config.instance_label]

    def route(receiver: str, *matchers: str, **extra) -> dict:
        return {"receiver": receiver, "matchers": list(matchers), **extra}

    return {
        "route": {
            "receiver": "tickets",
            "group_by": model,
            "group_wait": "30s",
            "group_interval": "5m",
            "repeat_interval": "4h",
            "routes": [
                # What users feel, fast: the objectives' fast burns, an engine that does not answer or is stuck,
                # a cache that preempts (the page's critical exhaustion), grouped by model with the page.
                route("pager", 'severity="critical"', repeat_interval="1h"),
                # Facts (caching off, a cold cache, a restarted replica): tickets.
                route("tickets", 'severity="info"'),
                # An objective's slow burn: the team that runs the engines; aborts: the application's.
                route("platform", 'objective=~"first_token|availability"'),
                route("application", 'objective="aborts"'),
                # The cause alerts, by who can act on the cause.
                route("platform", f'cause=~"{"|".join(PLATFORM_CAUSES)}"'),
                route("application", f'cause=~"{"|".join(APPLICATION_CAUSES)}"'),
            ],
        },
        "inhibit_rules": [
            # A fast burn pages; the same objective's slow burn on that model adds nothing.
            {"source_matchers": ['severity="critical"', 'objective=~".+"'],
             "target_matchers": ['severity="warning"', 'objective=~".+"'],
             "equal": [*model, "objective"]},
            # The cache is full now: the forecast that it will be is moot.
            {"source_matchers": ['alertname="VllmKvCacheExhausted"'],
             "target_matchers": ['alertname="VllmKvCacheExhaustionSoon"'],
             "equal": engine},
            # kvwatch not scraped: whatever else it would say about its engine is stale.
            {"source_matchers": ['alertname="KvwatchDown"'],
             "target_matchers": ['alertname=~"KvwatchEngineUnreachable|VllmEngineStatsDisabled"'],
             "equal": target},
        ],
        "receivers": [{"name": name, "webhook_configs": [{"url": url, "send_resolved": True}]}
                      for name, url in urls.items()],
    }
