"""`kvwatch sweep` against the in-process simulator (the `idle` scenario: no
background traffic, 128 blocks of 32 tokens, 8 sequences), its output files,
its input errors, and its parts: prompt lengths, the stream reader, the cell
summary."""

from __future__ import annotations

import csv
import json
import random
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import kvwatch
from kvwatch.cli import main
from kvwatch.sim.server import start_background
from kvwatch.snapshot import Histogram
from kvwatch.sweep.summary import cell_notes, percentile, summarize_cell
from kvwatch.sweep.client import Client, RequestResult, Worker, split_base_url
from kvwatch.sweep.metrics import CellMetrics
from kvwatch.sweep.output import COLUMNS, REQUEST_COLUMNS, _quantile_text
from kvwatch.sweep.prompts import (
    PromptError,
    calibrate_with_probes,
    calibrate_with_tokenize,
)

# The tiny Llama of the real tier: 2 layers x 2 KV heads x head_dim 32 x K,V x 4 B
# = 1024 B per token, which is also what the simulator reports per token.
TINY_LLAMA = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32"}


@pytest.fixture
def sim():
    # speed 10: a 192-token answer takes about 2.5 simulated seconds, 0.25 s of wall time
    with start_background("idle", speed=10) as handle:
        yield handle


def _read_outputs(out: Path) -> tuple[dict, list[dict]]:
    report = json.loads((out / "sweep.json").read_text())
    with open(out / "sweep.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    return report, rows


def test_sweep_against_the_simulator_peak_kv_rises_with_concurrency(sim, tmp_path, capsys):
    out = tmp_path / "sweep"
    code = main(["sweep", "--base-url", sim.url, "--model", "tiny-llama",
                 "--input-tokens", "256", "--output-tokens", "192", "--concurrency", "1,4,8",
                 "--duration", "1s", "--poll-interval", "0.05s", "--timeout", "30s",
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    report, rows = _read_outputs(out)
    cells = report["cells"]
    assert [c["concurrency"] for c in cells] == [1, 4, 8]
    peaks = [c["peak_kv_usage"] for c in cells]
    assert peaks[0] < peaks[1] < peaks[2], peaks
    # One request holds ceil(448 / 32) = 14 of the 127 usable blocks at its end, 13
    # for its last 64 tokens (longer than a poll interval); eight hold at most 112.
    assert 13 / 127 - 1e-9 <= peaks[0] <= 14 / 127 + 1e-9
    assert peaks[2] <= 112 / 127 + 1e-9
    for cell in cells:
        assert cell["failed"] == 0 and cell["completed"] >= 1
        assert cell["peak_running"] <= cell["concurrency"]
        # The simulator counts one token per word, so calibrated prompts are exact.
        assert cell["prompt_tokens_mean"] == 256
        assert cell["prompt_tokens_client_mean"] == 256
        assert cell["engine_finished"] == cell["completed"]
        assert cell["foreign_requests"] == 0  # the idle scenario sends nothing of its own
        assert cell["engine_ttft_count"] == cell["completed"]
        assert cell["client_ttft_p50_s"] <= cell["client_ttft_p95_s"]
        assert cell["engine_ttft_p50_s"] <= cell["engine_ttft_p95_s"]
        # 127 usable blocks // 14 blocks per request
        assert cell["capacity_bound"] == 9 and cell["capacity_source"] == "cache_config_info"
        assert cell["preemptions"] == 0
        assert cell["generation_tokens_per_s"] > 0
    assert cells[2]["peak_running"] > cells[0]["peak_running"]
    assert report["interrupted"] is False and report["planned_cells"] == 3
    assert report["server"]["prompt_method"].startswith("calibrated words")

    # The files agree with each other.
    assert [int(r["cell"]) for r in rows] == [1, 2, 3]
    assert list(rows[0]) == list(COLUMNS)
    assert float(rows[2]["peak_kv_usage"]) == pytest.approx(peaks[2], rel=1e-5)
    with open(out / "requests.csv", newline="") as handle:
        requests_rows = list(csv.DictReader(handle))
    assert list(requests_rows[0]) == list(REQUEST_COLUMNS)
    assert len(requests_rows) == sum(c["requests_sent"] for c in cells)
    assert all(r["ok"] == "1" and r["completion_tokens"] == "192" for r in requests_rows)
    summary = (out / "summary.md").read_text()
    assert "| 256 | 192 | 8 |" in summary and "3 of 3 cells measured" in summary
    for name in ("ttft_p95.png", "kv_usage_peak.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000

    # One progress line per cell, on stderr.
    assert [line.split(" ")[0] for line in err.splitlines() if line.startswith("[")] == \
        ["[1/3]", "[2/3]", "[3/3]"]


def test_sweep_by_request_count_with_the_bound_from_a_model_config(sim, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    out = tmp_path / "by-count"
    code = main(["sweep", "--base-url", sim.url + "/v1", "--model", "tiny-llama",
                 "--input-tokens", "100,300", "--output-tokens", "20", "--concurrency", "3",
                 "--requests", "5", "--poll-interval", "0.05s", "--model-config", str(config),
                 "--out", str(out), "--no-plots", "--warmup", "0"])
    assert code == 0, capsys.readouterr().err
    report, rows = _read_outputs(out)
    assert [(c["input_tokens"], c["requests_sent"], c["completed"]) for c in report["cells"]] == \
        [(100, 5, 5), (300, 5, 5)]
    # budget 4096 tokens x 1024 B = 4 MiB (kv_cache_memory_bytes); a block is 32 x 1024 B.
    # 120 tokens -> 4 blocks: (4194304 - 32768) // (4 x 32768) = 31
    # 320 tokens -> 10 blocks: 4161536 // 327680 = 12
    assert [c["capacity_bound"] for c in report["cells"]] == [31, 12]
    assert {c["capacity_source"] for c in report["cells"]} == {"model config"}
    assert [c["prompt_tokens_mean"] for c in report["cells"]] == [100, 300]
    assert not (out / "ttft_p95.png").exists()
    assert "1024 B per token" in report["server"]["capacity_note"]


# ---------------------------------------------------------------------------
# Bad inputs: one clear line, exit status 2 (1 when the server cannot be measured).


@pytest.mark.parametrize("extra, message", [
    (["--concurrency", "0"], "--concurrency: 0 is below the minimum of 1"),
    (["--concurrency", "1,four"], "--concurrency: 'four' is not a whole number"),
    (["--input-tokens", ","], "--input-tokens: give at least one value"),
    (["--requests", "0"], "--requests must be at least 1"),
    (["--poll-interval", "soon"], "--poll-interval: 'soon' is not a duration"),
    (["--timeout", "0s"], "--timeout: '0s' must be positive"),
    (["--base-url", "ftp://127.0.0.1:1"], "--base-url: 'ftp://127.0.0.1:1' is not an http(s) URL"),
    (["--kv-budget", "3GiB"], "give --model-config too"),
    (["--model-config", "/nonexistent/config.json"], "--model-config: model config not found: /nonexistent/config.json"),
    (["--kv-dtype", "int4", "--model-config", "x"], "--kv-dtype 'int4' is not one of"),
    (["--warmup", "-1"], "--warmup cannot be negative"),
])
def test_bad_flags_give_one_clear_error(extra, message, tmp_path, capsys):
    args = {"--base-url": "http://127.0.0.1:9", "--model": "m", "--input-tokens": "8",
            "--output-tokens": "8", "--concurrency": "1", "--requests": "1",
            "--out": str(tmp_path / "o")}
    for flag, value in zip(extra[::2], extra[1::2]):
        args[flag] = value
    argv = ["sweep"] + [item for pair in args.items() for item in pair]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwatch sweep: error: ") and message in err, err
    assert not (tmp_path / "o").exists()  # nothing is created before the inputs are good


def test_requests_and_duration_are_exclusive_and_one_is_needed(capsys):
    base = ["sweep", "--base-url", "http://127.0.0.1:9", "--model", "m", "--input-tokens", "8",
            "--output-tokens", "8", "--concurrency", "1"]
    with pytest.raises(SystemExit) as both:
        main(base + ["--requests", "2", "--duration", "5s"])
    assert both.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit) as neither:
        main(base)
    assert neither.value.code == 2
    assert "one of the arguments --requests --duration is required" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("extra, code, message", [
    (["--model", "llama-70b"], 2, "--model 'llama-70b' is not served by"),
    (["--input-tokens", "1000", "--output-tokens", "8,100"], 2,
     "exceed the server's max_model_len 1024: 1000+100"),
    (["--metrics-url", "{url}/v1/models"], 1, "cannot read {url}/v1/models: "),
])
def test_server_side_errors_are_reported_before_any_cell(sim, tmp_path, capsys, extra, code,
                                                         message):
    args = {"--base-url": sim.url, "--model": "tiny-llama", "--input-tokens": "8",
            "--output-tokens": "8", "--concurrency": "1", "--requests": "1",
            "--out": str(tmp_path / "o")}
    for flag, value in zip(extra[::2], extra[1::2]):
        args[flag] = value.format(url=sim.url)
    assert main(["sweep"] + [item for pair in args.items() for item in pair]) == code
    err = capsys.readouterr().err
    assert message.format(url=sim.url) in err, err
    if "--model" in extra:
        assert "(it serves: tiny-llama)" in err
    assert not (tmp_path / "o" / "sweep.json").exists()


def test_an_unreachable_server_is_a_clear_error(tmp_path, capsys):
    url = f"http://127.0.0.1:{_free_port()}"
    code = main(["sweep", "--base-url", url, "--model", "m", "--input-tokens", "8",
                 "--output-tokens", "8", "--concurrency", "1", "--requests", "1",
                 "--out", str(tmp_path / "o")])
    assert code == 1
    err = capsys.readouterr().err
    assert f"cannot reach the server: GET {url}/v1/models: connection refused" in err


# ---------------------------------------------------------------------------
# Prompt lengths.


class FakeTokenizer:
    """Counts like a BPE with a BOS token: each known short word is one token,
    any other word one token per two letters; optionally merges 'to be'."""

    def __init__(self, one_token: set[str], merge_to_be: bool = False):
        self.one_token = one_token
        self.merge_to_be = merge_to_be
        self.calls = 0

    def __call__(self, text: str) -> int:
        self.calls += 1
        words = text.split()
        count = 1  # BOS
        for word in words:
            count += 1 if word in self.one_token else (len(word) + 1) // 2 + 1
        if self.merge_to_be:
            count -= sum(1 for a, b in zip(words, words[1:]) if (a, b) == ("to", "be"))
        return count


def test_tokenize_calibration_keeps_one_token_words_and_hits_lengths_exactly():
    tokenizer = FakeTokenizer({"to", "be", "go", "do", "so", "no", "me"})
    maker = calibrate_with_tokenize(tokenizer)
    assert maker is not None and set(maker.words) == {"to", "be", "go", "do", "so", "no", "me"}
    assert set(maker.first_cost.values()) == {2}  # BOS + the word
    for length in (2, 3, 17, 256, 1000):
        maker.check_length(length, "seed")
        assert not maker.fitted_lengths
        for index in range(5):
            prompt = maker.make(length, random.Random(index))
            assert tokenizer(prompt.text) == length == prompt.expected_tokens
    assert maker.min_tokens() == 2
    # Different generators give different first words: no shared first block.
    firsts = {" ".join(maker.make(64, random.Random(i)).text.split()[:16]) for i in range(20)}
    assert len(firsts) == 20


def test_tokenize_lengths_that_do_not_add_up_are_fitted_per_prompt():
    tokenizer = FakeTokenizer({"to", "be", "go", "do"}, merge_to_be=True)
    maker = calibrate_with_tokenize(tokenizer)
    maker.check_length(300, "seed")
    assert maker.fitted_lengths == {300}
    for index in range(5):
        prompt = maker.make(300, random.Random(index))
        assert tokenizer(prompt.text) == 300 == prompt.expected_tokens


def test_too_few_one_token_words_means_no_tokenize_calibration():
    assert calibrate_with_tokenize(FakeTokenizer({"to", "be"})) is None


def test_probe_calibration_fits_slope_and_overhead():
    # A server that counts 3 template tokens plus 1.5 tokens per word.
    maker = calibrate_with_probes(lambda text: 3 + round(1.5 * len(text.split())), 4096, "s")
    assert maker.slope == pytest.approx(1.5) and maker.overhead == pytest.approx(3)
    prompt = maker.make(303, random.Random(0))
    assert len(prompt.text.split()) == 200 and prompt.expected_tokens == 303
    with pytest.raises(PromptError, match="cannot calibrate"):
        calibrate_with_probes(lambda text: 7, 4096, "s")


# ---------------------------------------------------------------------------
# The stream reader against a scripted server.


class ScriptedSSE:
    """Answers every POST with the scripted raw bytes after the status line."""

    def __init__(self, status: int, body: bytes, chunked: bool = True):
        script = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(script.status)
                if chunked:
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self.wfile.write(f"{len(script.body):x}\r\n".encode() + script.body + b"\r\n")
                    if script.finish:
                        self.wfile.write(b"0\r\n\r\n")
                    self.close_connection = True
                else:
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(script.body)))
                    self.end_headers()
                    self.wfile.write(script.body)

        self.status, self.body, self.finish = status, body, True
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _stream_once(server: ScriptedSSE) -> RequestResult:
    client = Client(server.url, timeout=5.0)
    worker = Worker(client)
    try:
        return client.stream_completion(worker, {"model": "m", "prompt": "x", "stream": True})
    finally:
        worker.close()
        server.close()


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_stream_reader_counts_tokens_with_empty_text_and_reads_usage():
    body = (_event({"choices": [{"text": "", "finish_reason": None}]})
            + _event({"choices": [{"text": " hi", "finish_reason": None}]})
            + _event({"choices": [{"text": "!", "finish_reason": "length"}]})
            + _event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
            + b"data: [DONE]\n\n")
    result = _stream_once(ScriptedSSE(200, body))
    assert result.ok and result.error is None
    assert result.chunks == 3 and result.finish_reason == "length"
    assert (result.prompt_tokens, result.completion_tokens, result.generated_tokens) == (7, 3, 3)
    assert 0 <= result.ttft <= result.latency


@pytest.mark.parametrize("status, body, finish, error", [
    (400, b'{"object": "error", "message": "This model\'s maximum context length is 1024"}',
     True, "HTTP 400: This model's maximum context length is 1024"),
    (200, _event({"choices": [{"text": "a", "finish_reason": None}]}), False,
     "the stream ended before a finish_reason or [DONE]"),
    (200, _event({"error": {"message": "engine dead"}}), True, "error in the stream: engine dead"),
    (200, b"data: {not json\n\n", True, "a stream event is not JSON"),
])
def test_stream_reader_failures_are_results_not_exceptions(status, body, finish, error):
    server = ScriptedSSE(status, body, chunked=status == 200)
    server.finish = finish
    result = _stream_once(server)
    assert not result.ok
    assert result.error.startswith(error), result.error


def test_base_url_forms():
    assert split_base_url("http://127.0.0.1:8000") == ("http", "127.0.0.1", 8000, "")
    assert split_base_url("http://h:1/v1/") == ("http", "h", 1, "")
    assert split_base_url("https://gw.example/llm/v1") == ("https", "gw.example", 443, "/llm")
    with pytest.raises(ValueError):
        split_base_url("127.0.0.1:8000")


# ---------------------------------------------------------------------------
# Statistics and the cell row.


def test_percentile_interpolates_between_ranks():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile(list(map(float, range(1, 101))), 0.95) == pytest.approx(95.05)


def test_cell_summary_puts_client_and_engine_side_by_side():
    results = [RequestResult(ok=True, started=10.0 + i, ttft=0.1 * (i + 1), latency=2.0,
                             chunks=4, prompt_tokens=100, completion_tokens=50) for i in range(4)]
    results.append(RequestResult(ok=False, started=11.0, latency=0.5, error="HTTP 503"))
    ttft = Histogram((0.1, 0.5, float("inf")), (2.0, 4.0, 4.0), 1.0, 4.0)
    metrics = CellMetrics(polls=9, peak_kv_usage=0.5, peak_running=4.0, peak_waiting=0.0,
                          counters={"prompt_tokens": 400.0, "generation_tokens": 200.0,
                                    "preemptions": 1.0, "finished/length": 4.0},
                          histograms={"ttft": ttft})
    cell = summarize_cell(1, 100, 50, 4, results, metrics, {"bound": 7, "source": "x"})
    assert set(COLUMNS) <= set(cell)
    assert (cell["completed"], cell["failed"], cell["requests_sent"]) == (4, 1, 5)
    assert cell["seconds"] == pytest.approx(5.0)  # first sent at 10, last ended at 13 + 2
    assert cell["client_ttft_p50_s"] == pytest.approx(0.25)
    assert cell["engine_ttft_p50_s"] == pytest.approx(0.1) and cell["engine_ttft_mean_s"] == 0.25
    assert cell["prompt_tokens_mean"] == 100 and cell["prompt_tokens_per_s"] == pytest.approx(80)
    assert cell["generation_tokens_per_s"] == pytest.approx(40)
    assert cell["client_generation_tokens_per_s"] == pytest.approx(40)
    assert cell["capacity_bound"] == 7 and cell["preemptions"] == 1
    assert cell["first_error"] == "HTTP 503"


@pytest.mark.parametrize("cumulative, quantiles, bounds, text", [
    # All in the first bucket: the sidecar's p50 is that bucket's bound, at most (not 0.05 interpolated from 0).
    ((4.0, 4.0, 4.0), (0.1, 0.1), ("<", "<"), "< 0.1"),
    # All past the last finite bound: at least that bound.
    ((0.0, 0.0, 4.0), (0.5, 0.5), (">", ">"), "> 0.5"),
    ((0.0, 4.0, 4.0), (0.3, 0.48), (None, None), "0.48"),
])
def test_engine_quantiles_are_the_sidecars_and_say_their_bounds_as_it_does(cumulative, quantiles, bounds, text):
    ttft = Histogram((0.1, 0.5, float("inf")), cumulative, 1.0, 4.0)
    metrics = CellMetrics(polls=9, peak_kv_usage=0.5, peak_running=4.0, peak_waiting=0.0, counters={},
                          histograms={"ttft": ttft})
    cell = summarize_cell(1, 100, 50, 4, [], metrics, None)
    assert (cell["engine_ttft_p50_s"], cell["engine_ttft_p95_s"]) == pytest.approx(quantiles)
    assert (cell["engine_ttft_p50_s_pinned"], cell["engine_ttft_p95_s_pinned"]) == bounds
    assert [ttft.reported_quantile(q).bound for q in (0.5, 0.95)] == list(bounds)
    # Written as the status page and `kvwatch diagnose` write a bound.
    assert _quantile_text(cell, "engine_ttft_p95_s") == text


def test_a_cell_whose_requests_no_poll_saw_running_says_its_peaks_were_not_measured():
    results = [RequestResult(ok=True, started=10.0, ttft=0.1, latency=0.3, chunks=2) for _ in range(3)]
    unseen = CellMetrics(polls=6, peak_kv_usage=0.0, peak_running=0.0, peak_waiting=0.0)
    notes = cell_notes(summarize_cell(4, 100, 8, 3, results, unseen, None), unseen, 0.1)
    assert notes == ["cell 4: none of its 6 /metrics polls saw one of its 3 requests running; its peak KV "
                     "usage, running and waiting were not measured (lower --poll-interval or lengthen the cell)"]
    seen = CellMetrics(polls=6, peak_kv_usage=0.2, peak_running=2.0, peak_waiting=0.0)
    assert cell_notes(summarize_cell(4, 100, 8, 3, results, seen, None), seen, 0.1) == []
    # With too few polls the note about those says it already; nothing completed, nothing to see.
    few = CellMetrics(polls=1, peak_running=0.0)
    assert [n.split(";")[0] for n in cell_notes(summarize_cell(4, 100, 8, 3, results, few, None), few, 0.1)] == [
        "cell 4: only 1 /metrics poll(s)"]
    failed = [RequestResult(ok=False, started=10.0, latency=0.1, error="HTTP 500")]
    assert cell_notes(summarize_cell(4, 100, 8, 1, failed, unseen, None), unseen, 0.1) == []


def test_a_cell_polled_far_less_often_than_asked_says_its_peaks_may_be_missed():
    # Requests from 10 s to 14.4 s: 4.4 s at --poll-interval 0.1 s asks for 44 polls.
    results = [RequestResult(ok=True, started=10.0 + i, ttft=0.1, latency=1.4, chunks=2) for i in range(4)]
    slow = CellMetrics(polls=6, peak_kv_usage=0.07, peak_running=1.0, peak_waiting=0.0)
    cell = summarize_cell(3, 256, 192, 8, results, slow, None)
    assert cell_notes(cell, slow, 0.1) == [
        "cell 3: 6 /metrics polls in 4.4 s, not the 44 asked for: the server's /metrics answered slowly "
        "under the load; its peaks may be missed"]
    # A quarter of the asked rate or more is a poller keeping up with a loaded server.
    assert cell_notes(cell, CellMetrics(polls=11, peak_running=1.0), 0.1) == []
    # At 1 s polls the same 6 polls are more than asked for.
    assert cell_notes(cell, slow, 1.0) == []


def test_a_server_with_other_traffic_is_measured_after_a_bounded_wait_with_a_note(tmp_path, capsys):
    # The healthy workload at four times its rate (about 15 requests in flight)
    # sends its own requests all the time, and a simulated minute first puts it
    # in its steady state: the server is never idle when the sweep looks.
    scenario = (Path(kvwatch.__file__).parent / "scenarios" / "healthy.yaml").read_text()
    busy_yaml = tmp_path / "busy.yaml"
    busy_yaml.write_text(scenario.replace("rate: 2.5 ", "rate: 10.0"))
    assert "rate: 10.0" in busy_yaml.read_text()
    with start_background(str(busy_yaml), speed=10) as busy:
        busy.advance(60)
        out = tmp_path / "busy"
        code = main(["sweep", "--base-url", busy.url, "--model", "tiny-llama",
                     "--input-tokens", "32", "--output-tokens", "8", "--concurrency", "2",
                     "--requests", "2", "--timeout", "60s", "--idle-wait", "1s", "--poll-interval", "0.05s",
                     "--out", str(out), "--no-plots"])
    # The wait is bounded by --idle-wait alone: the requests and the calibration
    # keep a generous timeout, so a busy machine cannot fail them (a 1 s
    # --timeout bounded both and failed the calibration under load).
    err = capsys.readouterr().err
    assert code == 0, err
    report = json.loads((out / "sweep.json").read_text())
    cell = report["cells"][0]
    assert cell["completed"] == 2
    assert "cell 1: the server was still busy after 1 s; the cell may include other traffic" \
        in report["notes"]
    summary = (out / "summary.md").read_text()
    assert "the server was still busy" in summary
    # The server finished more requests than the sweep sent: said while the
    # sweep ran (before its closing line), in the summary, and in the CSV.
    assert cell["foreign_requests"] > 0 and cell["engine_finished"] == cell["foreign_requests"] + 2
    said = f"kvwatch sweep: cell 1: other traffic: the server finished {cell['engine_finished']:.0f} requests"
    assert said in err and err.index(said) < err.index("kvwatch sweep: done")
    assert "kvwatch sweep: other traffic on the server in 1 of 1 cell(s)" in err
    assert f"other traffic: the server finished {cell['engine_finished']:.0f} requests" in summary
    # --compare names it as the reason the cell is refused.
    assert main(["sweep", "--compare", str(out), str(out), "--out", str(tmp_path / "cmp"), "--no-plots"]) == 1
    refused = json.loads((tmp_path / "cmp" / "compare.json").read_text())["cells"]["refused"]
    assert refused and refused[0]["reasons"][0].startswith(
        f"other traffic: the server finished {cell['foreign_requests']} requests the before sweep did not send")


class _RawServer:
    """Answers one connection with `script(sock)`; counts what it sent."""

    def __init__(self, script):
        import socket

        self.sent = 0
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.done = threading.Event()

        def serve():
            try:
                conn, _ = self.listener.accept()
                with conn:
                    conn.recv(65536)
                    script(self, conn)
            except OSError:
                pass
            finally:
                self.done.set()

        threading.Thread(target=serve, daemon=True).start()

    def send(self, conn, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)


def test_a_json_answer_trickled_a_byte_at_a_time_is_cut_off_at_the_call_timeout():
    """A /version answer of 1,000 bytes, one every 20 ms: the call's timeout
    (0.3 s) holds for the whole answer, not for each byte (the client read
    all of it, 20 s, as long as each byte came within the timeout)."""
    import time as clock

    from kvwatch.sweep.client import Client, ServerError

    body = b'{"version": "' + b"x" * 980 + b'"}'

    def trickle(server, conn):
        server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                          + f"Content-Length: {len(body)}\r\n\r\n".encode())
        for byte in body:
            server.send(conn, bytes([byte]))
            clock.sleep(0.02)

    server = _RawServer(trickle)
    with pytest.raises(ServerError, match="no whole answer within 0.3 s"):
        Client(server.url, timeout=0.3).get_json("/version")
    server.listener.close()
    assert server.sent < len(body)


def test_a_stream_event_that_never_ends_is_cut_off_at_its_cap():
    """A 200 stream whose first line never ends (8 MiB of data without a
    newline): the reader stops at MAX_EVENT_BYTES with one sentence (it
    held every byte until the stream ended)."""
    from kvwatch.sweep.client import MAX_EVENT_BYTES, Client

    def endless(server, conn):
        server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\ndata: ")
        chunk = b"x" * 65536
        while server.sent < 8 * 2**20:
            server.send(conn, chunk)

    server = _RawServer(endless)
    client = Client(server.url, timeout=30.0)
    worker = Worker(client)
    try:
        result = client.stream_completion(worker, {"model": "m", "prompt": "x", "stream": True})
    finally:
        worker.close()
    assert not result.ok and result.error == f"an event of more than {MAX_EVENT_BYTES:,} bytes"
    server.done.wait(10)
    server.listener.close()
    assert server.sent < 8 * 2**20
