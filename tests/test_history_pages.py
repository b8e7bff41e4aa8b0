"""Query results written back as pages for the engine adapter: the sidecars'
kvwatch_engine_* series read as the vLLM series they re-export, vLLM's own
series under any version's spelling, and the chunk planner's bounds."""

from kvwatch.engines import make_adapter
from kvwatch.history.pages import Pages
from kvwatch.history.query import MAX_POINTS, PrometheusClient, choose_step, merge_selector

TARGET = {"job": "kvwatch", "instance": "10.0.0.1:9400", "model_name": "m", "engine": "0"}


def matrix(name, value, **labels):
    return {"metric": {"__name__": name, **TARGET, **labels}, "values": [[100.0, str(value)], [130.0, str(value * 2)]]}


def test_kvwatch_engine_series_read_back_as_the_vllm_series_they_carry():
    pages = Pages(100.0, 30.0, 2, "kvwatch")
    pages.add([matrix("kvwatch_engine_kv_cache_usage_ratio", 0.25),
               matrix("kvwatch_engine_prefix_cache_queries_total", 1000),
               matrix("kvwatch_engine_prefix_cache_hits_total", 400),
               matrix("kvwatch_engine_requests_waiting_by_reason", 2, reason="capacity"),
               matrix("kvwatch_engine_info", 1, block_size="16", num_gpu_blocks="100"),
               matrix("kvwatch_engine_time_to_first_token_seconds_bucket", 3, le="0.5"),
               matrix("kvwatch_engine_time_to_first_token_seconds_bucket", 5, le="+Inf"),
               matrix("kvwatch_engine_time_to_first_token_seconds_sum", 1.5),
               matrix("kvwatch_engine_time_to_first_token_seconds_count", 5)])
    (replica,) = pages.replicas.values()
    assert replica.labels == {"job": "kvwatch", "instance": "10.0.0.1:9400"}
    snapshot = make_adapter().adapt(replica.page(1), at=130.0)
    engine = snapshot.engines[("m", "0")]
    assert engine.gauges["kv_usage"] == 0.5
    assert engine.gauges["waiting_by_reason/capacity"] == 4
    assert engine.counters["prefix_queries"] == 2000 and engine.counters["prefix_hits"] == 800
    assert engine.histograms["ttft"].bounds == (0.5, float("inf"))
    assert engine.histograms["ttft"].cumulative == (6.0, 10.0)
    assert snapshot.capacity_tokens("0") == 1600


def test_old_vllm_spelling_and_missing_steps():
    pages = Pages(100.0, 30.0, 3, "vllm")
    pages.add([matrix("vllm:gpu_cache_usage_perc", 0.5), matrix("vllm:gpu_prefix_cache_queries_total", 10)])
    (replica,) = pages.replicas.values()
    assert replica.page(2) is None  # no sample at the third step: no poll there
    snapshot = make_adapter().adapt(replica.page(0), at=100.0)
    assert snapshot.engines[("m", "0")].gauges["kv_usage"] == 0.5
    assert snapshot.sources["prefix_queries"] == "gpu_prefix_cache_queries"


def test_reads_are_planned_within_the_store_limits():
    client = PrometheusClient("http://127.0.0.1:9", max_samples=1_000)
    chunks = client.plan(0.0, 2879 * 30.0, 30.0, series=10)
    assert all(round((b - a) / 30.0) + 1 <= 100 for a, b in chunks)  # 10 series x 100 points = 1,000 samples
    assert chunks[0][0] == 0.0 and chunks[-1][1] == 2879 * 30.0 and len(chunks) == 29
    assert all(round((b - a) / 30.0) + 1 <= MAX_POINTS
               for a, b in PrometheusClient("http://x", max_samples=10**9).plan(0.0, 86400 * 7, 15.0, 1))
    assert choose_step(0.0, 6 * 3600.0) == 15.0 and choose_step(0.0, 86400.0) == 30.0
    assert merge_selector('{namespace="llm"}', '__name__="x"') == '{__name__="x",namespace="llm"}'


def _as_query_results(pages: list[tuple[float, str]], labels: dict[str, str]) -> list[dict]:
    """Pages as the range query's matrix: each series' values at the steps
    whose page carried it, labelled with the scrape target."""
    from prometheus_client.parser import text_string_to_metric_families

    series: dict[tuple, dict] = {}
    for at, text in pages:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                metric = {"__name__": sample.name, **sample.labels, **labels}
                found = series.setdefault(tuple(sorted(metric.items())), {"metric": metric, "values": []})
                found["values"].append([at, repr(sample.value)])
    return list(series.values())


def test_families_from_query_results_give_the_snapshots_of_the_pages_text():
    """The fast path (query results -> the parser's families -> the adapter)
    and the text path (query results -> page text -> parse -> the adapter)
    give equal Snapshots, step by step, on real vLLM 0.32 pages: histograms,
    labelled counters, cache_config_info, the process start time, and a
    series missing at some steps."""
    from pathlib import Path

    folder = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu"
    names = ("metrics-idle.txt", "metrics-load.txt", "metrics-prefix-load.txt", "metrics-long-load.txt",
             "metrics-after.txt", "metrics-idle.txt")
    pages_in = [(1000.0 + 15.0 * i, (folder / name).read_text()) for i, name in enumerate(names)]
    results = _as_query_results(pages_in, {"job": "vllm", "instance": "10.0.0.2:8000"})
    # Samples the store lacks at one step: a gauge, and one bucket of a histogram.
    for series in results:
        metric = series["metric"]
        if metric["__name__"] == "vllm:num_requests_waiting" or (
                metric["__name__"] == "vllm:time_to_first_token_seconds_bucket" and metric["le"] == "1.0"):
            series["values"] = [v for v in series["values"] if v[0] != 1030.0]
    pages = Pages(1000.0, 15.0, len(pages_in), "vllm")
    pages.add(results)
    (replica,) = pages.replicas.values()
    by_text, by_families = make_adapter(), make_adapter()
    engines = 0
    seen = []
    for index, (at, _text) in enumerate(pages_in):
        expected = by_text.adapt(replica.page(index), at=at)
        families, process_start = replica.families(index)
        got = by_families.adapt_families(families, [], process_start, at=at)
        assert got == expected, index
        seen.append(got)
        engines += len(got.engines)
    assert engines == len(pages_in)
    assert [sorted(snapshot.engines[("tiny-llama", "0")].gauges).count("waiting") for snapshot in seen] == \
        [1, 1, 0, 1, 1, 1]
    assert expected.engines and expected.process_start and expected.cache_config
    assert any(engine.histograms for engine in expected.engines.values())


def test_chunks_take_over_the_plan_before_and_give_the_same_snapshots():
    """Each chunk (a Replica of its own) taking over the replica's plan of
    the chunk before (Replica.earlier, as the diagnosis hands it on) gives
    the text path's Snapshots; the adapter sees the same layout objects as
    before where the family's series are the same, and a new one where a
    series is missing."""
    from pathlib import Path

    folder = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu"
    names = ("metrics-idle.txt", "metrics-load.txt", "metrics-prefix-load.txt", "metrics-long-load.txt",
             "metrics-after.txt", "metrics-idle.txt")
    pages_in = [(1000.0 + 15.0 * i, (folder / name).read_text()) for i, name in enumerate(names)]
    results = _as_query_results(pages_in, {"job": "vllm", "instance": "10.0.0.2:8000"})
    for series in results:  # one bucket missing in the last chunk
        metric = series["metric"]
        if metric["__name__"] == "vllm:time_to_first_token_seconds_bucket" and metric["le"] == "1.0":
            series["values"] = [v for v in series["values"] if v[0] < 1060.0]
    by_text, by_families = make_adapter(), make_adapter()
    earlier, layouts = None, []
    for first in (0, 2, 4):  # three chunks of two steps
        chunk = [{"metric": r["metric"], "values": [v for v in r["values"] if 1000.0 + 15.0 * first <= v[0]
                                                    < 1000.0 + 15.0 * (first + 2)]} for r in results]
        pages = Pages(1000.0 + 15.0 * first, 15.0, 2, "vllm")
        pages.add([r for r in chunk if r["values"]])
        (replica,) = pages.replicas.values()
        replica.earlier = earlier
        for index in range(2):
            at = 1000.0 + 15.0 * (first + index)
            expected = by_text.adapt(replica.page(index), at=at)
            families, process_start = replica.families(index)
            assert by_families.adapt_families(families, [], process_start, at=at) == expected, (first, index)
        layouts.append({name: family.layout for name, family in families.items()})
        earlier = replica.carried()
    planned = [name for name, layout in layouts[0].items() if layout is not None]
    assert planned and all(layouts[1][name] is layouts[0][name] for name in planned)
    assert layouts[2]["time_to_first_token_seconds"] is not layouts[1]["time_to_first_token_seconds"]
    assert layouts[2]["num_requests_running"] is layouts[1]["num_requests_running"]


def test_kvwatch_series_with_configuration_give_the_same_snapshots_both_ways():
    pages = Pages(100.0, 30.0, 2, "kvwatch")
    pages.add([matrix("kvwatch_engine_kv_cache_usage_ratio", 0.25),
               matrix("kvwatch_engine_prefix_cache_queries_total", 1000),
               matrix("kvwatch_engine_info", 1, block_size="16", num_gpu_blocks="100"),
               matrix("kvwatch_engine_kv_cache_memory_bytes", 1 << 30),
               matrix("kvwatch_engine_time_to_first_token_seconds_bucket", 3, le="0.5"),
               matrix("kvwatch_engine_time_to_first_token_seconds_bucket", 5, le="+Inf"),
               matrix("kvwatch_engine_time_to_first_token_seconds_sum", 1.5),
               matrix("kvwatch_engine_time_to_first_token_seconds_count", 5)])
    (replica,) = pages.replicas.values()
    by_text, by_families = make_adapter(), make_adapter()
    for index, at in enumerate((100.0, 130.0)):
        expected = by_text.adapt(replica.page(index), at=at)
        families, process_start = replica.families(index)
        got = by_families.adapt_families(families, [], process_start, at=at)
        assert got == expected
    assert got.cache_config["0"]["kv_cache_memory_bytes"] == str(2 << 30)


def _without_undiagnosed(text: str) -> str:
    """A vLLM page without the families no rule reads (every line of them,
    HELP and TYPE included)."""
    import re

    from kvwatch.diagnose import NOT_DIAGNOSED_KEYS
    from kvwatch.history.pages import _KEY_OF_FAMILY, vllm_sample_name

    kept = []
    for line in text.splitlines():
        match = re.match(r"(?:# (?:HELP|TYPE) )?([a-zA-Z_:][a-zA-Z0-9_:]*)", line)
        name = match.group(1) if match else ""
        read = vllm_sample_name(name) or vllm_sample_name(name + "_bucket") or vllm_sample_name(name + "_total")
        if read is None or _KEY_OF_FAMILY.get(read[1]) not in NOT_DIAGNOSED_KEYS:
            kept.append(line)
    return "\n".join(kept) + "\n"


def test_the_families_history_does_not_read_change_no_finding(fixtures_dir):
    """`kvwatch diagnose --prometheus` leaves out the families of
    diagnose.NOT_DIAGNOSED_KEYS (half of a vLLM 0.32 replica's series): every
    real recording, replayed with and without them, gives the same findings,
    evidence included, at every poll."""
    from kvwatch.capture.bundle import Capture
    from kvwatch.capture.replay import ReplaySource
    from kvwatch.pipeline.monitor import Monitor
    from kvwatch.settings import load_settings

    settings = load_settings(overrides={"poll_interval": "1s", "window": "60s"}, environ={})
    recordings = sorted((fixtures_dir / "vllm-0.32-cpu-scenarios").glob("*/capture.tar.gz"))
    assert len(recordings) >= 10
    stripped_series = 0
    for path in recordings:
        runs = []
        for strip in (False, True):
            pages = [(entry, _without_undiagnosed(text) if strip and text is not None else text)
                     for entry, text in Capture(path).pages()]
            if strip:
                stripped_series += sum(a.count("\n") - b.count("\n") for (_e, a), (_f, b)
                                       in zip(Capture(path).pages(), pages) if a is not None)
            source = ReplaySource(pages)
            monitor = Monitor(settings, fetcher=source, clock=source.now)
            polls = []
            while not source.exhausted:
                state = monitor.poll_once()
                polls.append((state.last_poll_time, state.findings))
            runs.append(polls)
        assert runs[0] == runs[1], path.parent.name
        assert any(findings for _at, findings in runs[0]) or path.parent.name in ("front-end",), path.parent.name
    assert stripped_series > 1000  # the families were there to leave out


def _chunks_through_a_worker(results: list[dict], start: float, step: float, points: int, size: int):
    """The replica's chunks of `size` steps as a worker process gets them:
    read with the series filed once (KnownSeries), the first chunk sent
    whole and each later one as its values alone (pickled both ways), each
    taking over the plan of the one before. Yields (index, at, replica,
    whether its values were sent alone)."""
    import pickle

    from kvwatch.history.pages import KnownSeries, Replica

    known, sent, skeleton, earlier = KnownSeries(10_000), None, None, None
    for first in range(0, points, size):
        count = min(size, points - first)
        chunk_start = start + first * step
        chunk = [{"metric": r["metric"], "values": [v for v in r["values"]
                                                    if chunk_start <= v[0] < chunk_start + count * step]}
                 for r in results]
        pages = Pages(chunk_start, step, count, "vllm", known=known)
        pages.add([r for r in chunk if r["values"]])
        if not pages.replicas:  # no page in the chunk's steps
            yield from ((index, chunk_start + index * step, None, False) for index in range(count))
            continue
        (replica,) = pages.replicas.values()
        # As _Workers.send: compared with what was sent whole (the filed
        # objects, so equal by identity), rebuilt from what the worker kept.
        alone = sent is not None and replica.skeleton() == sent
        if alone:
            replica = Replica.from_skeleton(skeleton, pickle.loads(pickle.dumps(replica.values_only())))
        else:
            sent = replica.skeleton()
            replica = pickle.loads(pickle.dumps(replica))
            skeleton = replica.skeleton()
        replica.earlier = earlier
        for index in range(count):
            yield index, chunk_start + index * step, replica, alone
        earlier = replica.carried()


def test_series_filed_once_and_values_sent_alone_give_every_recordings_snapshots(fixtures_dir):
    """Every real recording's pages as a store's answers, in chunks of 7
    steps read and sent as a worker process gets them (each series filed
    once, later chunks' values sent alone): each step's Snapshot equals the
    text path's, and later chunks reuse the first chunk's label dicts."""
    from kvwatch.capture.bundle import Capture

    recordings = sorted((fixtures_dir / "vllm-0.32-cpu-scenarios").glob("*/capture.tar.gz"))
    assert len(recordings) >= 10
    steps = reused = 0
    sent = {True: 0, False: 0}
    for path in recordings:
        pages_in = [(float(round(entry.time)), text) for entry, text in Capture(path).pages() if text is not None]
        # One page per whole second: the steps of a 1 s grid.
        pages_in = [page for i, page in enumerate(pages_in) if i == 0 or page[0] > pages_in[i - 1][0]]
        start, last = pages_in[0][0], pages_in[-1][0]
        points = int(last - start) + 1
        results = _as_query_results(pages_in, {"job": "vllm", "instance": "10.0.0.3:8000"})
        texts = dict(pages_in)
        by_text, by_families = make_adapter(), make_adapter()
        labels_seen: dict[tuple, int] = {}
        for index, at, replica, alone in _chunks_through_a_worker(results, start, 1.0, points, 7):
            sent[alone] += index == 0 and replica is not None
            read = replica.families(index) if replica is not None else None
            if at not in texts:
                assert read is None, (path.parent.name, at)
                continue
            expected = by_text.adapt(replica.page(index), at=at)
            assert by_families.adapt_families(read[0], [], read[1], at=at) == expected, (path.parent.name, at)
            steps += 1
            for row in replica.rows:
                if row[3] is not None:
                    held = labels_seen.setdefault((row[0],), id(row[3][2]))
                    reused += held == id(row[3][2])
    assert steps > 500 and reused > steps
    assert sent[True] > 2 * sent[False] > 0
