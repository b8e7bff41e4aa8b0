"""What `kvwatch capacity` says when it cannot read what it was pointed at,
and how it writes the stream's sizing: one sentence each, the one kvwatch
diagnose says for the same failure, never an exception's text; the flag at
fault named alone; the table's numbers as the sentences below it write them."""

from __future__ import annotations

import json
import socket

from kvwatch.cli import main
from pageserver import Answer, PageServer

JSON = {"Content-Type": "application/json"}


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def error_of(argv: list[str], capsys) -> str:
    assert main(["capacity", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.strip()


def test_a_refused_connection_is_the_sentence_diagnose_says(capsys):
    # It printed "ConnectionRefusedError: [Errno 111] Connection refused (host='127.0.0.1', port=1, url: ...)".
    port = closed_port()
    err = error_of(["--target", f"http://127.0.0.1:{port}/metrics", "--input-tokens", "1", "--output-tokens", "1"],
                   capsys)
    assert err == (f"kvwatch capacity: error: cannot fetch http://127.0.0.1:{port}/metrics: connection refused by "
                   f"127.0.0.1:{port}: nothing listens there (engine down or starting?)")
    err = error_of(["--kvwatch", f"http://127.0.0.1:{port}"], capsys)
    assert err == (f"kvwatch capacity: error: cannot fetch http://127.0.0.1:{port}/api/v1/diagnosis: connection "
                   f"refused by 127.0.0.1:{port}: nothing listens there (is kvwatch running, and on that port?)")


def test_an_http_refusal_is_the_sentence_diagnose_says(capsys):
    with PageServer([Answer("not here", status=404)]) as server:
        err = error_of(["--target", server.url, "--input-tokens", "1", "--output-tokens", "1"], capsys)
        host = server.base_url.split("://", 1)[1]
        assert err == (f"kvwatch capacity: error: cannot fetch {server.url}: {host} refused the request (wrong path, "
                       "or a token is missing or wrong)")
        err = error_of(["--kvwatch", server.base_url], capsys)
        assert err.endswith(f"/api/v1/diagnosis: {host} refused the request (wrong path, or a token is missing or "
                            "wrong)")


def test_a_store_s_error_answer_without_a_reason_still_ends_in_a_sentence(capsys):
    # It ended "/api/v1/series: HTTP 404:", nothing after the colon.
    with PageServer([Answer("{}", status=404, headers=JSON)]) as store:
        err = error_of(["--prometheus", store.base_url, "--ttft-p95", "1s"], capsys)
    assert err == (f"kvwatch capacity: error: cannot read {store.base_url}: /api/v1/series: HTTP 404, an error "
                   "answer that gives no reason (is this a Prometheus query API?)")
    answer = {"status": "error", "errorType": "bad_data", "error": "parse error"}
    with PageServer([Answer(json.dumps(answer), status=400, headers=JSON)]) as store:
        err = error_of(["--prometheus", store.base_url, "--ttft-p95", "1s"], capsys)
    assert err.endswith("/api/v1/series: HTTP 400: bad_data parse error")


def test_a_bad_value_names_its_flag_alone(capsys):
    # It said "--ttft-p95, --from/--to/--since, --step or --rate-window: '-2s' must be positive".
    store = f"http://127.0.0.1:{closed_port()}"
    for flags, said in ((["--ttft-p95", "-2s"], "--ttft-p95: '-2s' must be positive"),
                        (["--ttft-p95", "1s", "--since", "-3h"], "--since: '-3h' must be positive"),
                        (["--ttft-p95", "1s", "--step", "x"], "--step: 'x' is not a duration"),
                        (["--ttft-p95", "1s", "--rate-window", "0s"], "--rate-window: '0s' must be positive"),
                        (["--ttft-p95", "1s", "--from", "soon"], "--from: "),
                        (["--ttft-p95", "1s", "--to", "later"], "--to: ")):
        err = error_of(["--prometheus", store, *flags], capsys)
        assert err.startswith(f"kvwatch capacity: error: {said}"), (flags, err)


def stream_diagnosis(per_hour: float) -> dict:
    """A kvwatch's /api/v1/diagnosis as `capacity --kvwatch` reads it, the
    sizing note as kvwatch/kvevents/source.py writes it (a clause)."""
    return {"kv_events": {
        "up": True, "block_size": 16, "table": {"sampling_rate": 1}, "page_engine": {"engine": "0"},
        "window": {"seconds": 300, "stored": 720, "stored_again": 540, "stored_again_ratio": 0.75,
                   "lost_prefill_seconds": 12.5},
        "sizing": {"hit_ratio_now": 0.5, "cache_blocks": 1023, "note": "an estimate: first order",
                   "points": [{"extra_cache": 1, "extra_blocks": 1023, "extra_bytes": 2**20, "blocks_kept": 100,
                               "recomputation_avoided_ratio": 0.5, "hit_ratio": 0.6, "extra_gib": 0.001,
                               "saved_prefill_seconds_per_hour": per_hour}]}}}


def test_the_sizing_table_writes_seconds_per_hour_as_the_sentence_does(capsys):
    # The table printed 1.19e+03 beside "1,194 s/h" in the sentence below it,
    # and "Cache now: 1,023 blocks. an estimate: ..." opened a sentence in lowercase.
    with PageServer([Answer(json.dumps(stream_diagnosis(1194.4)), headers=JSON)]) as served:
        assert main(["capacity", "--kvwatch", served.base_url]) == 0
    out = capsys.readouterr().out
    assert "e+0" not in out, out
    [row] = [line for line in out.splitlines() if line.lstrip().startswith("x1 ")]
    assert row.rstrip().endswith(" 1,194"), row
    assert "1,194 s/h" in out, out
    assert "Cache now: 1,023 blocks. An estimate: first order." in out.splitlines(), out
    with PageServer([Answer(json.dumps(stream_diagnosis(12.345)), headers=JSON)]) as served:
        assert main(["capacity", "--kvwatch", served.base_url]) == 0
    out = capsys.readouterr().out
    [row] = [line for line in out.splitlines() if line.lstrip().startswith("x1 ")]
    assert row.rstrip().endswith(" 12.3") and "12.3 s/h" in out, out
