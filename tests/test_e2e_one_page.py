"""One page per incident, end to end: eight replicas of one model share a
latency incident, a real Prometheus (Debian `prometheus`) evaluates the
generated rules over their kvwatch series and a real Alertmanager (Debian
`prometheus-alertmanager`) with the generated example configuration notifies
this test's webhook. The replicas are scripted kvwatch expositions (the TTFT
histogram kvwatch re-exports, counted from wall time): healthy, then most
first tokens late on all eight at once. Windows and `for:` are scaled down
by a test config of the mixin, as in tests/test_e2e_alerting.py.

The page is per model (the objectives aggregate every replica) and the
example groups by model: one notification to the pager, carrying one page
alert that lists the burning replicas; nothing while the replicas are
healthy. The counts are printed (docs/alerts.md quotes them)."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from kvwatch.commands.generate import RULES_FILE, render_all
from kvwatch.mixin import alertmanager
from kvwatch.mixin.config import config_from_mapping
from pageserver import Answer, LoopbackServer, Request
from promstack import free_port, wait_until
from test_e2e_alerting import ALERTMANAGER, PROMETHEUS, RECEIVERS, Processes, Webhook, _ready

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (PROMETHEUS and ALERTMANAGER),
                                 reason="prometheus and alertmanager not installed (make system-deps)")]

REPLICAS = 8
HEALTHY_S = 12.0  # wall seconds before the incident starts on every replica
PER_SECOND = 20  # requests per replica
SLOW_SHARE = 0.6  # of first tokens later than the objective's bound during the incident
CONFIG = {
    "rule_interval": "1s",
    "burn_rate_windows": [{"long": "60s", "short": "15s", "factor": 14.4, "severity": "critical"}],
    "objective_min_requests": 5,
    "for_durations": {"VllmTimeToFirstTokenBudgetBurn": "3s"},
}


def replica_series(engine: str, start: float, labels: str = "") -> dict[str, list[str]]:
    """One replica's kvwatch series, {family: sample lines}: its engine's TTFT histogram and its parts
    (the late first tokens are prefill), counted from the shared start; `labels` leads each sample's."""
    elapsed = max(0.0, time.time() - start)
    total = PER_SECOND * elapsed
    slow = PER_SECOND * SLOW_SHARE * max(0.0, elapsed - HEALTHY_S)
    own = f'{labels}model_name="m",engine="{engine}"'
    out = {}
    for name, fast_s, slow_s in (("time_to_first_token", 0.2, 5.0), ("request_prefill_time", 0.1, 4.5),
                                 ("request_queue_time", 0.05, 0.1)):
        family = f"kvwatch_engine_{name}_seconds"
        out[family] = [f'{family}_bucket{{{own},le="0.5"}} {total - slow:.3f}',
                       f'{family}_bucket{{{own},le="2.5"}} {total - slow:.3f}',
                       f'{family}_bucket{{{own},le="+Inf"}} {total:.3f}',
                       f"{family}_sum{{{own}}} {fast_s * (total - slow) + slow_s * slow:.3f}",
                       f"{family}_count{{{own}}} {total:.3f}"]
    out["kvwatch_up"] = [f"kvwatch_up{{{labels.rstrip(',')}}} 1" if labels else "kvwatch_up 1"]
    return out


def exposition(families: dict[str, list[str]]) -> str:
    types = {"kvwatch_up": "gauge"}
    return "".join(f"# TYPE {name} {types.get(name, 'histogram')}\n" + "\n".join(lines) + "\n"
                   for name, lines in families.items())


class Replica(LoopbackServer):
    """One replica's kvwatch /metrics (a sidecar)."""

    def __init__(self, engine: str, start: float):
        self.engine, self.start = engine, start
        super().__init__(name=f"replica-{engine}")

    def respond(self, request: Request) -> Answer:
        return Answer(exposition(replica_series(self.engine, self.start)))


@pytest.fixture(scope="module")
def incident():
    config = config_from_mapping(CONFIG)
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-e2e-one-page-"))
    processes = Processes(workdir)
    start = time.time() + 3.0
    replicas = [Replica(str(i), start) for i in range(REPLICAS)]
    try:
        with Webhook() as webhook:
            for replica in replicas:
                replica.__enter__()
            (workdir / "rules.yaml").write_text(render_all(config)[RULES_FILE])
            example = alertmanager.example(config, {name: f"{webhook.base_url}/{name}" for name in RECEIVERS})
            # Scaled down, but a group is notified again only when it changes (repeat far away).
            example["route"].update({"group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"})
            (workdir / "alertmanager.yml").write_text(yaml.safe_dump(example))
            am_port, prom_port = free_port(), free_port()
            processes.start("alertmanager", [
                ALERTMANAGER, f"--config.file={workdir / 'alertmanager.yml'}",
                f"--storage.path={workdir / 'am-data'}", f"--web.listen-address=127.0.0.1:{am_port}",
                "--cluster.listen-address="])
            targets = [{"targets": [r.base_url.split("//")[1]], "labels": {"namespace": "llm"}} for r in replicas]
            (workdir / "prometheus.yml").write_text(yaml.safe_dump({
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
                "rule_files": [str(workdir / "rules.yaml")],
                "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
                "scrape_configs": [{"job_name": "kvwatch", "static_configs": targets}]}))
            processes.start("prometheus", [
                PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'prom-data'}", f"--web.listen-address=127.0.0.1:{prom_port}"])
            wait_until(lambda: _ready(f"http://127.0.0.1:{am_port}/-/ready"), 30, "alertmanager ready")
            wait_until(lambda: _ready(f"http://127.0.0.1:{prom_port}/-/ready"), 30, "prometheus ready")
            try:
                wait_until(lambda: webhook.sent_to("pager"), start + HEALTHY_S + 45 - time.time(), "the page")
            except AssertionError:
                raise AssertionError(f"no page; logs: {processes.log('prometheus')} {processes.log('alertmanager')}") from None
            paged = time.time()
            # The incident goes on: a second notification now would be a second page for one incident.
            threading.Event().wait(12.0)
            yield {"webhook": webhook, "start": start, "paged": paged}
    finally:
        processes.stop_all()
        for replica in replicas:
            replica.__exit__(None, None, None)
        shutil.rmtree(workdir, ignore_errors=True)


def test_eight_replicas_sharing_one_incident_page_once(incident):
    webhook = incident["webhook"]
    pages = webhook.sent_to("pager")
    alerts = [a for _, payload in pages for a in payload["alerts"]]
    print(f"{REPLICAS} replicas, one incident: {len(pages)} pager notification(s), {len(alerts)} page alert(s), "
          f"paged {incident['paged'] - incident['start'] - HEALTHY_S:.1f} s after the incident began; "
          f"{len(webhook.notifications)} notifications to any receiver")
    assert len(pages) == 1 and len(alerts) == 1, pages
    (page,) = alerts
    assert page["labels"]["alertname"] == "VllmTimeToFirstTokenBudgetBurn" and "instance" not in page["labels"]
    assert set(pages[0][1]["groupLabels"]) == {"namespace", "job", "model_name"}
    # The page names the replicas burning (each of the eight), per replica detail stays out of its labels.
    assert page["annotations"]["burning_replicas"].count("(engine ") == REPLICAS
    # Nothing while the replicas were healthy.
    assert all(at >= incident["start"] + HEALTHY_S for _, at, _ in webhook.notifications)
