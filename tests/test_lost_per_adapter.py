"""What the cache lost per LoRA adapter, in the engine's prefill seconds: each
adapter's recomputed tokens (its GPU blocks stored again after their eviction
x block size) priced at the one rate the stream's window lost is priced at,
so the adapters split that lost; exported as
kvwatch_tenant_lost_prefill_seconds, named in the worth's sentences the
status page, `kvwatch diagnose` and the API show, and absent without a rate."""

from __future__ import annotations

import io

import msgspec
import pytest
from page_support import polled
from test_kv_events import feed_all, rotation

from kvwatch.kvevents import wire
from kvwatch.kvevents.source import KVEventSource
from kvwatch.routing.tenants import lora_rows
from kvwatch.sidecar.collector import KvwatchCollector
from kvwatch.signals import worth

FAMILY = "kvwatch_tenant_lost_prefill_seconds"


def as_adapter(batches: list[list], name: str | None) -> list[list]:
    """The batches with every BlockStored naming the LoRA adapter `name` (None: the base model)."""
    return [[msgspec.structs.replace(event, lora_name=name) if hasattr(event, "lora_name") else event
             for event in events] for events in batches]


def two_adapters(cpu_returns: int = 0):
    """A stream's report of chat-lora's 12 prefixes of 15 blocks through 100 blocks (540 stored again)
    and the base model's 6 of 4 through 16 (its own returns), and `cpu_returns` CPU blocks stored,
    removed and stored again (a lower tier's returns: no GPU recomputation)."""
    batches = as_adapter(rotation(prefixes=12, blocks=15, cache=100, rounds=4), "chat-lora")
    batches += as_adapter(rotation(prefixes=6, blocks=4, cache=16, rounds=3, start=500_000), None)
    cpu = list(range(900_000, 900_000 + cpu_returns))
    if cpu:
        batches += [[wire.stored(cpu, 16, medium="CPU", lora_name="chat-lora")], [wire.removed(cpu, medium="CPU")],
                    [wire.stored(cpu, 16, medium="CPU", lora_name="chat-lora")]]
    source = KVEventSource("tcp://127.0.0.1:1")
    end = feed_all(source, batches)
    return source.report(now=end, bytes_per_block=2 * 1024 * 1024)


@pytest.fixture
def engine(fixtures_dir):
    """A vLLM 0.32 engine polled idle then under load: its view prices a computed token."""
    texts = [(fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text() for name in ("idle", "load")]
    return polled(texts, engine="vllm")


def exported(report) -> dict[str, dict[str, float]]:
    families = {f.name: f for f in KvwatchCollector(None)._adapters(report)}
    return {name: {s.labels["tenant"]: s.value for s in family.samples} for name, family in families.items()}


def test_each_adapters_lost_seconds_are_its_recomputed_tokens_at_the_windows_rate(engine):
    [row] = engine.state.per_engine
    per_token = worth.prefill_seconds_per_token(row.view)
    out = worth.with_worth(two_adapters(), row.view)
    assert out["window"]["prefill_seconds_per_token"] == per_token
    rows = lora_rows(out)
    lost = worth.lost_by_tenant(rows, worth.priced_rate(out))
    tokens = {r["tenant"]: r["recomputed_tokens"] for r in rows}
    assert tokens["chat-lora"] == 540 * 16 and tokens["(base)"] > 0
    assert {item["tenant"]: item["seconds"] for item in lost} == pytest.approx(
        {tenant: n * per_token for tenant, n in tokens.items()})
    assert {item["kind"] for item in lost} == {"lora"}
    # Every block stored again is the GPU's: the adapters split the window's lost, no more, no less.
    assert sum(item["seconds"] for item in lost) == pytest.approx(out["window"]["lost_prefill_seconds"])
    # The gauges read the same: the seconds beside the tokens, adapter by adapter.
    series = exported(out)
    assert series[FAMILY] == pytest.approx({t: series["kvwatch_tenant_recomputed_tokens"][t] * per_token
                                            for t in tokens})


def test_events_without_a_block_size_count_an_adapters_tokens_in_the_pages(engine):
    """vLLM's BlockStored may omit the block size: the window's lost then counts in the page's
    (the view's), and each adapter's recomputed tokens in the same, so they still split it."""
    [row] = engine.state.per_engine
    raw = two_adapters()
    raw["block_size"] = None
    out = worth.with_worth(raw, row.view)
    assert out["window"]["tokens_per_block"] == row.view.block_size and row.view.block_size
    tokens = {r["tenant"]: r["recomputed_tokens"] for r in lora_rows(out)}
    assert tokens["chat-lora"] == 540 * row.view.block_size
    lost = worth.lost_by_tenant(lora_rows(out), worth.priced_rate(out))
    assert sum(item["seconds"] for item in lost) == pytest.approx(out["window"]["lost_prefill_seconds"])
    assert {r["recomputed_tokens"] for r in lora_rows(raw)} == {0}  # unpriced, no size: none counted


def test_a_lower_tiers_returns_count_in_the_windows_lost_but_in_no_adapters(engine):
    """The window's stored again counts every medium's blocks stored again; an
    adapter's recomputed tokens only the GPU's. So the adapters sum to the
    window's lost less its lower tiers' returns."""
    [row] = engine.state.per_engine
    out = worth.with_worth(two_adapters(cpu_returns=20), row.view)
    window = out["window"]
    cpu_again = sum(r["stored_again"] for r in window["by_label"] if r["medium"] == "CPU")
    assert cpu_again == 20
    lost = worth.lost_by_tenant(lora_rows(out), worth.priced_rate(out))
    per_token = window["prefill_seconds_per_token"]
    assert sum(item["seconds"] for item in lost) == pytest.approx(
        window["lost_prefill_seconds"] - cpu_again * 16 * per_token)


def test_without_a_rate_no_adapter_is_priced_and_the_family_is_absent():
    raw = two_adapters()
    unpriced = worth.with_worth(raw, None)
    assert worth.priced_rate(unpriced) is None and worth.priced_rate(raw) is None
    assert worth.lost_by_tenant(lora_rows(unpriced), None) is None
    for report in (raw, unpriced):
        series = exported(report)
        assert FAMILY not in series and series["kvwatch_tenant_recomputed_tokens"]["chat-lora"] == 540 * 16


def test_the_worths_sentence_names_the_adapters_that_lost_most(engine):
    [row] = engine.state.per_engine
    stream = worth.with_worth(two_adapters(), row.view)
    stream["up"] = True
    item = worth.summary(row.model, row.engine, row.values, row.view, stream, None, lora_rows(stream))
    per_token = worth.prefill_seconds_per_token(row.view)
    chat = 540 * 16 * per_token
    assert item["lost_basis"] == "stream"
    assert {r["tenant"]: r["seconds"] for r in item["lost_by_tenant"]}["chat-lora"] == pytest.approx(chat)
    [line] = [line for line in item["lines"] if line.startswith("Lost by adapter:")]
    assert line.startswith(f"Lost by adapter: chat-lora {chat:.3g} s, (base) ")
    # Another engine's stream is not this one's: no adapter is named.
    stream["page_engine"] = {"model_name": "another", "engine": "0"}
    other = worth.summary(row.model, row.engine, row.values, row.view, stream, None, lora_rows(stream))
    assert other["lost_by_tenant"] is None and not any("by adapter" in line for line in other["lines"])


def test_the_base_model_alone_is_the_whole_of_lost_and_needs_no_sentence():
    assert worth.lines({"window_seconds": 60.0, "saved_seconds": None, "lost_seconds": 2.0, "lost_basis": "stream",
                        "lost_money": None, "bought": [],
                        "lost_by_tenant": [{"kind": "lora", "tenant": "(base)", "seconds": 2.0}]}) == [
        "Lost to recomputation: 2 s over 60 s, counted from the event stream's blocks stored again after their "
        "eviction.", f"Seconds are {worth.CAVEAT}."]
    many = [{"kind": "lora", "tenant": f"a{i}", "seconds": float(i)} for i in range(5)]
    assert worth.tenants_line(many) == "Lost by adapter: a4 4 s, a3 3 s, a2 2 s and 2 more."


def test_the_status_page_diagnose_the_api_and_capacity_show_the_adapters_lost(fixtures_dir, capsys):
    """The monitor's own path: the page polled, the adapters' events fed to its stream, polled again."""
    from test_kv_events import stream_fed

    from pageserver import Answer, PageServer

    from kvwatch.cli import main
    from kvwatch.commands.diagnose import _json_report, print_worth
    from kvwatch.present import TerminalText
    from kvwatch.sidecar.report import signals_json
    from kvwatch.sidecar.statuspage import render_status_page

    texts = [(fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text() for name in ("idle", "load")]
    batches = as_adapter(rotation(prefixes=12, blocks=15, cache=100, rounds=4), "chat-lora")
    batches += as_adapter(rotation(prefixes=6, blocks=4, cache=16, rounds=3, start=500_000), None)
    with stream_fed(texts, batches) as (monitor, settings, client):
        api = client.get("/api/v1/signals").json()["worth"][0]
        diagnosis = client.get("/api/v1/diagnosis").text
        metrics = client.get("/metrics").text
    [row] = monitor.state.per_engine
    chat = f"chat-lora {540 * 16 * worth.prefill_seconds_per_token(row.view):.3g} s"
    assert any(line.startswith(f"Lost by adapter: {chat}, (base) ") for line in api["lines"])
    assert [r["tenant"] for r in api["lost_by_tenant"]] == ["chat-lora", "(base)"]
    assert f'{FAMILY}{{kind="lora",tenant="chat-lora"}}' in metrics
    html = render_status_page(monitor.state, settings)
    assert f"Lost by adapter: {chat}" in html
    signals = signals_json(monitor.state, settings)
    text = io.StringIO()
    print_worth(TerminalText(text), signals["worth"])
    print(text.getvalue())
    assert f"Lost by adapter: {chat}" in text.getvalue()
    served = _json_report(signals, {"findings": [], "events": [], "upstream": None, "lmcache": None}, 2,
                          monitor.state, None, monitor.state, 0)["worth"]
    assert served[0]["lost_by_tenant"] == api["lost_by_tenant"]
    # `kvwatch capacity --kvwatch` reading that kvwatch's diagnosis prints the same split.
    with PageServer([Answer(diagnosis, headers={"Content-Type": "application/json"})]) as other:
        assert main(["capacity", "--kvwatch", other.base_url]) == 0
    assert f"Lost by adapter: {chat}" in capsys.readouterr().out
