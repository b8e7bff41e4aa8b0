"""The range query's answer decoded with values kept as text (history/matrix.py):
whatever the body, the result is what json.loads gives, and Pages read the
same values from either."""

import json

import pytest

from kvwatch.history.matrix import RawPairs, decode, joined, pairs_of
from kvwatch.history.pages import Pages

# Prometheus 2.42's answer, as it wrote it (captured from the Debian package's
# server over two replicas and three steps): the layout the fast path reads.
PROMETHEUS_2_42 = (
    '{"status":"success","data":{"resultType":"matrix","result":[{"metric":{"__name__":"vllm:kv_cache_usage_perc",'
    '"engine":"0","instance":"10.1.0.0:8000","job":"vllm","model_name":"m"},"values":[[1796202000,"0.3"],'
    '[1796202030,"0.3"],[1796202060,"0.3"]]},{"metric":{"__name__":"vllm:kv_cache_usage_perc","engine":"0",'
    '"instance":"10.1.0.1:8000","job":"vllm","model_name":"m"},"values":[[1796202000,"0.3"],[1796202030,"0.3"],'
    '[1796202060,"0.3"]]},{"metric":{"__name__":"vllm:num_requests_running","engine":"0","instance":"10.1.0.0:8000",'
    '"job":"vllm","model_name":"m"},"values":[[1796202000,"4"],[1796202030,"4"],[1796202060,"4"]]},{"metric":'
    '{"__name__":"vllm:num_requests_running","engine":"0","instance":"10.1.0.1:8000","job":"vllm","model_name":"m"},'
    '"values":[[1796202000,"4"],[1796202030,"4"],[1796202060,"4"]]}]}}'
)


def plain(decoded):
    """A decoded answer with every RawPairs turned into what JSON gives."""
    if isinstance(decoded, dict):
        return {k: (pairs_of(v) if k == "values" else plain(v)) for k, v in decoded.items()}
    if isinstance(decoded, list):
        return [plain(v) for v in decoded]
    return decoded


def body(result, **extra):
    return json.dumps({"status": "success", "data": {"resultType": "matrix", "result": result}, **extra},
                      separators=(",", ":"))


def series(values, **labels):
    return {"metric": {"__name__": "x", **labels}, "values": values}


def fast(text):
    """Whether the values were kept as text (the fast path was taken)."""
    found = decode(text)["data"]["result"]
    return bool(found) and all(isinstance(s.get("values"), RawPairs) for s in found)


BODIES = {
    "prometheus 2.42": PROMETHEUS_2_42,
    "empty result": body([]),
    "special values": body([series([[1, "NaN"], [2, "+Inf"], [3, "-Inf"], [4, "1e+10"], [5.5, "0.000001"]])]),
    "labels that look like the layout": body([series([[1, "1"]], a='"values":[[1,"2"]]},{"metric":', b="]]}", c="\\\"",
                                                    d="é ☃ \n")]),
    "warnings after data": body([series([[1, "1"]])], warnings=["result truncated"]),
    "victoriametrics envelope": json.dumps({"status": "success", "isPartial": False, "data": {
        "resultType": "matrix", "result": [series([[1, "1"], [2, "2"]])]}, "stats": {"seriesFetched": "1"}},
        separators=(",", ":")),
    "pretty printed": json.dumps({"status": "success", "data": {"resultType": "matrix",
                                                                "result": [series([[1, "1"]])]}}, indent=2),
    "native histograms": body([{"metric": {"__name__": "h"}, "histograms": [[1, {"count": "2", "sum": "3"}]]}]),
    "values then histograms": body([{"metric": {}, "values": [[1, "1"]], "histograms": [[2, {"count": "1"}]]}]),
    "escaped value": body([series([[1, "a\\b"], [2, 'q"q']])]),
    "bracket in a value": body([series([[1, "a]b"], [2, "[c"]])]),
    "empty values": body([series([]), series([[1, "1"]])]),
    "key order changed": '{"status":"success","data":{"result":[{"values":[[1,"1"]],"metric":{}}],"resultType":"matrix"}}',
    "vector answer": '{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":[1,"1"]}]}}',
    "error answer": '{"status":"error","errorType":"bad_data","error":"parse error"}',
}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_decode_gives_what_json_gives(name):
    text = BODIES[name]
    assert plain(decode(text)) == json.loads(text)


def test_the_usual_layout_keeps_values_as_text():
    assert fast(PROMETHEUS_2_42)
    assert fast(BODIES["special values"]) and fast(BODIES["labels that look like the layout"])
    assert fast(BODIES["victoriametrics envelope"]) and fast(BODIES["warnings after data"])
    for name in ("pretty printed", "native histograms", "escaped value", "key order changed", "values then histograms"):
        assert not fast(BODIES[name]), name


@pytest.mark.parametrize("cut", [10, 60, 200, len(PROMETHEUS_2_42) - 2, len(PROMETHEUS_2_42) - 1])
def test_a_cut_off_answer_is_refused_as_json_refuses_it(cut):
    with pytest.raises(ValueError):
        json.loads(PROMETHEUS_2_42[:cut])
    with pytest.raises(ValueError):
        decode(PROMETHEUS_2_42[:cut])


def test_raw_pairs_read_as_json_reads_them():
    (first, *_rest) = decode(PROMETHEUS_2_42)["data"]["result"]
    raw = first["values"]
    assert len(raw) == 3 and raw.first_time() == 1796202000 and raw.last_time() == 1796202060
    assert raw.strings() == ["0.3", "0.3", "0.3"]
    assert raw.pairs() == [[1796202000, "0.3"], [1796202030, "0.3"], [1796202060, "0.3"]]


def test_chunks_join_in_time_order_however_read():
    a = decode(body([series([[1, "1"], [2, "2"]])]))["data"]["result"][0]["values"]
    b = decode(body([series([[3, "3"]])]))["data"]["result"][0]["values"]
    expected = [[1, "1"], [2, "2"], [3, "3"]]
    assert isinstance(joined(a, b), RawPairs) and joined(a, b).pairs() == expected and len(joined(a, b)) == 3
    assert joined(a, [[3, "3"]]) == expected and joined([[1, "1"], [2, "2"]], b) == expected
    empty = decode(body([series([[9, "9"]])]))["data"]["result"][0]["values"]
    assert joined(a, RawPairs("[]", 0)) is a and joined(RawPairs("[]", 0), empty) is empty


def test_pages_read_the_same_steps_from_text_values_as_from_json():
    """A gap, a step off the grid and a full series: each replica's page at
    each step is the same whichever way the answer was decoded."""
    start, step, points = 100.0, 30.0, 4
    text = body([
        series([[100, "1"], [130, "2"], [160, "3"], [190, "4"]], instance="a", job="j"),
        series([[100, "1"], [160, "3"], [190, "4"]], instance="b", job="j"),  # a gap
        series([[100, "5"], [131, "6"], [160, "7"], [190, "8"]], instance="c", job="j"),  # off the grid
        series([[70, "0"], [100, "5"], [130, "6"], [160, "7"]], instance="d", job="j"),  # shifted
    ]).replace('"__name__":"x"', '"__name__":"vllm:num_requests_running"')
    pages_fast, pages_json = Pages(start, step, points, "vllm"), Pages(start, step, points, "vllm")
    pages_fast.add(decode(text)["data"]["result"])
    pages_json.add(json.loads(text)["data"]["result"])
    assert sorted(pages_fast.replicas) == sorted(pages_json.replicas)
    for key, replica in pages_fast.replicas.items():
        for index in range(points):
            assert replica.page(index) == pages_json.replicas[key].page(index), (key, index)
    b = pages_fast.replicas[("j", "b", "", "")]
    assert b.page(1) is None and "3" in b.page(2)


@pytest.mark.parametrize("name", sorted(BODIES))
def test_decode_with_keep_gives_what_json_gives_less_the_series_refused(name):
    """`keep` leaves a series out as it is read, on the scanned layout and
    on any other (decoded whole), and counts what it left out."""
    text = BODIES[name]
    whole = json.loads(text)

    def keep(metric):
        return metric.get("__name__") != "x"

    refused = [0, 0]
    found = plain(decode(text, keep, refused))
    data = whole.get("data")
    if isinstance(data, dict) and isinstance(data.get("result"), list):
        left = [s for s in data["result"] if "values" in s and not keep(s["metric"])]
        data["result"] = [s for s in data["result"] if s not in left]
        assert refused == [len(left), sum(len(s["values"]) or 1 for s in left)]
    assert found == whole


def test_a_refused_series_keeps_nothing_of_its_values():
    text = body([series([[1, "1"], [2, "2"]], pod=f"p{n}") for n in range(100)])
    refused = [0, 0]
    (kept,) = decode(text, lambda metric: metric["pod"] == "p7", refused)["data"]["result"]
    assert kept["metric"]["pod"] == "p7" and isinstance(kept["values"], RawPairs) and refused == [99, 198]


def test_a_listing_cut_to_the_labels_read_shares_equal_label_sets():
    """decode_listing is json.loads with each label set cut to the labels
    asked for, equal cut sets one object: what a listing of many label sets
    holds is a reference each, not a dict each."""
    from kvwatch.history.matrix import decode_listing

    text = json.dumps({"status": "success", "data": [
        {}, {}, {"__name__": "vllm:a", "pod": "p1", "job": "x"}, {"__name__": "vllm:a", "pod": "p1", "job": "y"},
        {"__name__": "vllm:b", "pod": "p2"}, {"job": "z"}]})
    found = decode_listing(text, ("__name__", "pod"))
    assert found["status"] == "success"
    data = found["data"]
    assert data == [{}, {}, {"__name__": "vllm:a", "pod": "p1"}, {"__name__": "vllm:a", "pod": "p1"},
                    {"__name__": "vllm:b", "pod": "p2"}, {}]
    assert data[0] is data[1] is data[5] and data[2] is data[3] and data[4] is not data[2]
    # Exactly json.loads where every label is kept.
    assert decode_listing(text, ("__name__", "pod", "job")) == json.loads(text)


def test_a_listing_leaves_whole_what_is_not_a_label_set_and_keeps_an_error_envelope():
    from kvwatch.history.matrix import decode_listing

    odd = '{"status":"success","data":[{"__name__":"vllm:a","pod":1,"extra":"x"},{"pod":["p"]}]}'
    assert decode_listing(odd, ("__name__",)) == json.loads(odd)  # the answer's check refuses it
    error = '{"status":"error","errorType":"bad_data","error":"parse error"}'
    assert decode_listing(error, ("__name__",)) == json.loads(error)
