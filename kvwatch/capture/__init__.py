"""Captures: a target's /metrics pages recorded with their fetch times
(`kvwatch capture`), and replayed through the sidecar's own pipeline at their
recorded times (`kvwatch diagnose --replay`, `kvwatch serve --replay`).
The format is in bundle.py and docs/capture.md."""
