"""The State's reports of its other sources are typed dicts built by
keyword (kvwatch/pipeline/reports.py): each field names its type, and what
each source returns holds exactly the keys its type declares, no more (a
key the page reads but no source writes) and no fewer."""

from __future__ import annotations

import json
import typing

import pytest

from kvwatch.pipeline import reports
from kvwatch.pipeline.demo import read_status
from kvwatch.pipeline.lmcache import LMCacheSource
from kvwatch.pipeline.monitor import Monitor, State
from kvwatch.pipeline.upstream import UpstreamSource
from kvwatch.settings import Settings

UNREACHABLE = "http://127.0.0.1:9/metrics"  # port 9 (discard): nothing listens, the poll fails at once
TYPED = {"upstream": reports.UpstreamReport, "lmcache": reports.LMCacheReport, "demo": reports.DemoStatus,
         "replay": reports.ReplayProgress, "busy": reports.BusyReport}


def keys_of(typed_dict) -> set[str]:
    return set(typed_dict.__required_keys__) | set(typed_dict.__optional_keys__)


@pytest.mark.parametrize("name", sorted(TYPED))
def test_each_report_field_of_the_state_names_its_typed_dict(name):
    hints = typing.get_type_hints(State)
    assert hints[name] == TYPED[name] | None


def test_the_upstream_report_holds_its_declared_keys():
    source = UpstreamSource(Settings(upstream_target=UNREACHABLE, upstream_histogram="app_seconds_bucket",
                                     poll_interval=1.0), window_seconds=60)
    page = "\n".join(['# TYPE app_seconds histogram', 'app_seconds_bucket{le="1"} 1', 'app_seconds_bucket{le="+Inf"} 2',
                      "app_seconds_sum 3", "app_seconds_count 2", ""])
    assert set(source.ingest(page, now=100.0)) == keys_of(reports.UpstreamReport)
    assert set(source.poll()) == keys_of(reports.UpstreamReport)  # a failed poll says the same keys


def test_the_lmcache_report_holds_its_declared_keys():
    source = LMCacheSource(Settings(target=UNREACHABLE, lmcache_target=UNREACHABLE), window_seconds=60)
    # Every required key; an optional one (the tenants: only where the page carries cache_salt) may be absent.
    keys = set(source.poll())
    assert set(reports.LMCacheReport.__required_keys__) <= keys <= keys_of(reports.LMCacheReport)


def test_the_demo_status_holds_its_declared_keys():
    status = read_status(json.dumps({"phase": "warm", "phases": 2, "clock": "simulated"}))
    assert status is not None and set(status) == keys_of(reports.DemoStatus)


def test_the_busy_report_holds_its_declared_keys():
    monitor = Monitor(Settings(target=UNREACHABLE))
    monitor._last_load = (100.0, 3.0, 1.0)  # the latest page read showed work running and waiting
    busy = monitor._busy(None, 5.0, timed_out=True, at=101.0)
    assert busy is not None and set(busy) == keys_of(reports.BusyReport)
