"""The diagnosis' thresholds as a typed, frozen dataclass: each field's check
comes from its metadata, so a configured value is checked by the same list
the type declares, and a field added without a check cannot be imported."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvwatch.diagnose.thresholds import (DEFAULT_THRESHOLDS, Thresholds, field_checks, resolve_thresholds,
                                         validate_thresholds)

NAMES = [f.name for f in dataclasses.fields(Thresholds)]


def test_a_field_without_a_check_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Extended(Thresholds):
        new_ratio: float = 0.5

    with pytest.raises(TypeError, match="'new_ratio' has no check"):
        field_checks(Extended)


@pytest.mark.parametrize("name", NAMES)
def test_every_field_checks_its_configured_value(name):
    default = getattr(DEFAULT_THRESHOLDS, name)
    # The default passes its own check (None is max_num_seqs' "not configured").
    assert validate_thresholds({name: default}) == []
    problems = validate_thresholds({name: "not a value"})
    assert len(problems) == 1 and problems[0].startswith(f"{name}: "), problems


def test_a_misspelt_key_is_named_with_the_nearest_and_the_known_ones():
    problems = validate_thresholds({"hit_ratio_lwo": 0.3, "hit_ratio_low": 2})
    assert problems[0].startswith("unknown threshold 'hit_ratio_lwo': did you mean 'hit_ratio_low'? (known: ")
    assert all(name in problems[0] for name in NAMES)
    assert problems[1] == "hit_ratio_low: 2 must be a ratio in (0, 1]"


def test_resolved_values_are_parsed_typed_and_frozen():
    resolved = resolve_thresholds({"ttft_p95_seconds": "500ms", "ttft_min_requests": 7.0, "hit_ratio_low": 5,
                                   "unknown": 1})
    assert resolved.ttft_p95_seconds == 0.5
    assert resolved.ttft_min_requests == 7 and isinstance(resolved.ttft_min_requests, int)
    assert resolved.hit_ratio_low == DEFAULT_THRESHOLDS.hit_ratio_low  # invalid: the default
    assert resolve_thresholds(resolved) is resolved
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.hit_ratio_low = 0.5  # type: ignore[misc]
    assert dataclasses.replace(resolved, hit_ratio_low=0.5).hit_ratio_low == 0.5


def test_the_json_keeps_every_key_in_the_old_order():
    # The page and the API read the thresholds by name from the JSON.
    assert list(json.loads(json.dumps(dataclasses.asdict(DEFAULT_THRESHOLDS)))) == NAMES
    assert NAMES[:3] == ["exhaustion_usage_ratio", "long_request_capacity_share", "max_num_seqs"]
