"""The mixin config's fields are typed: each declares its kind (what a
value must be), and a value is checked by its kind; a field without one is
refused when its class is built (kvwatch/mixin/config_kinds.py)."""

from __future__ import annotations

import pytest

from kvwatch.mixin.config import MixinConfig, MixinConfigError, config_from_mapping


def test_every_config_field_declares_its_kind_or_the_class_is_refused():
    """A new threshold without a declared kind is refused when its class is
    built: it can never accept any value unnoticed."""
    from dataclasses import dataclass, field

    from kvwatch.mixin.config_kinds import RATIO, UndeclaredKindError, described, require_kinds

    @dataclass(frozen=True)
    class WithNewThreshold:
        hit_ratio_low: float = field(default=0.1, metadata=described(RATIO, "a declared one"))
        queue_share_high: float = field(default=0.5, metadata={"help": "a new threshold, no kind"})

    with pytest.raises(UndeclaredKindError, match="WithNewThreshold.queue_share_high declares no kind"):
        require_kinds(WithNewThreshold)


@pytest.mark.parametrize(("name", "value", "problem"), [
    ("hit_ratio_low", 1.5, "hit_ratio_low: 1.5 must be a number in (0, 1]"),
    ("fleet_affinity_fraction", "half", "fleet_affinity_fraction: 'half' must be a number in (0, 1]"),
    ("ttft_mean_seconds", 0, "ttft_mean_seconds: 0 must be a positive number"),
    ("exhaustion_eta_minutes", True, "exhaustion_eta_minutes: True must be a positive number"),
    ("kvwatch_absent_window", "an hour", "kvwatch_absent_window: 'an hour' is not a Prometheus duration"),
    ("abort_objective", 1, "abort_objective: 1 must be a number strictly between 0 and 1"),
    ("group_labels", ["ok", "not-a-label"], "group_labels: ['ok', 'not-a-label'] must be a list of label names"),
    ("for_durations", {"VllmKvCacheExhausted": "soon"},
     "for_durations: VllmKvCacheExhausted: 'soon' is not a Prometheus duration"),
    ("severities", {"prefill": "urgent"}, "severities: prefill: 'urgent' is not one of critical, warning, info"),
    ("grafana_org_id", 0, "grafana_org_id: 0 must be a positive integer"),
])
def test_each_field_is_checked_by_its_kind(name, value, problem):
    with pytest.raises(MixinConfigError) as caught:
        config_from_mapping({name: value})
    assert any(problem in line for line in caught.value.problems), caught.value.problems


def test_every_field_of_the_config_is_checked():
    """Each field refuses a value of the wrong type (none accepts anything)."""
    from dataclasses import fields

    for f in fields(MixinConfig):
        with pytest.raises(MixinConfigError, match=f.name):
            config_from_mapping({f.name: object()})
