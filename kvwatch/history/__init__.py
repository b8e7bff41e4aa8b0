"""Diagnosis over a Prometheus-compatible store's history (`kvwatch diagnose
--prometheus`): query.py reads the series the diagnosis needs over a range,
bounded and costed; pages.py turns each replica's values at each step back
into a metrics page for the engine adapter; replay.py runs the sidecar's
window, signals and diagnosis over those pages; fleet.py adds the findings
that need more than one replica; diagnose/timeline.py folds findings into
episodes (the format of `kvwatch diagnose --replay` too); report.py writes them as text, JSON and a self-contained HTML page."""
