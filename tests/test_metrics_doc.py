from pathlib import Path

from kvwatch.mixin.metrics_doc import render
from kvwatch.signals import ENGINE_SERIES, SIGNALS

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def test_committed_metrics_doc_is_current():
    assert DOC.read_text() == render(), "docs/metrics.md is stale: run `make generate`"


def test_catalogue_names_follow_prometheus_conventions():
    names = [s.name for s in SIGNALS] + [s.sample_name for s in ENGINE_SERIES]
    assert len(names) == len(set(names))
    for name in names:
        assert name.startswith("kvwatch_") and ":" not in name
    for signal in SIGNALS:
        if signal.unit == "ratio":
            assert signal.name.endswith("_ratio"), signal.name
        if signal.unit == "seconds":
            assert signal.name.endswith("_seconds"), signal.name
        assert not signal.name.endswith("_total")
    for series in ENGINE_SERIES:
        assert series.kind != "counter" or not series.name.endswith("_total")


def test_every_vllm_family_read_is_listed_with_its_releases_and_what_happens_when_missing():
    from kvwatch.engines import vllm

    text = render()
    section = text[text.index("## vLLM families kvwatch reads"):]
    for family in vllm.all_families():
        assert family in vllm.VERSIONS, family
        rows = [line for line in section.splitlines()
                if line.startswith((f"| `vllm:{family}`", f"| `vllm:{family}{{"))]
        assert rows, family
        assert all(vllm.VERSIONS[family] in row for row in rows), family
    gated = [line for line in section.splitlines() if line.startswith("| `vllm:kv_block_reuse_gap_seconds`")]
    assert "--kv-cache-metrics" in gated[0] and "dark_signals" in gated[0]


def test_each_signal_helps_in_one_line_and_the_doc_keeps_the_rest():
    """The exported # HELP and a panel's description are one short line;
    where more needs saying it is the signal's doc, which docs/metrics.md shows."""
    from kvwatch.signals import STREAM_SIGNALS, TIER_SIGNALS

    text = render()
    for signal in (*SIGNALS, *TIER_SIGNALS, *STREAM_SIGNALS):
        assert "\n" not in signal.help and len(signal.help) <= HELP_MAX_CHARS, (signal.name, len(signal.help))
        if signal.doc:
            assert signal.doc.replace("|", "/") in text, signal.name
            assert len(signal.doc) > len(signal.help), signal.name


# What fits one line of a dashboard panel's description.
HELP_MAX_CHARS = 120
