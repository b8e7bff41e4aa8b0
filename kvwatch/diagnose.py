"""Diagnosis: symptom -> likely cause, with the evidence that decided it.

(The rules are being written in their own change; this module fixes the
interface the monitor, the exporter and the API use.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_THRESHOLDS: dict[str, Any] = {}


@dataclass(frozen=True)
class Finding:
    symptom: str  # exhaustion | low_hit_rate | slow_first_token | change
    cause: str
    severity: str  # critical | warning | info
    confidence: str  # high | medium | low
    model: str
    engine: str | None
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    next_check: str = ""


def validate_thresholds(thresholds: dict[str, Any]) -> list[str]:
    return [f"unknown threshold {key!r}" for key in thresholds if key not in DEFAULT_THRESHOLDS]


def diagnose(window, per_engine, per_model, events, thresholds: dict[str, Any], upstream=None) -> list[Finding]:
    return []
