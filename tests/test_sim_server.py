"""The simulator's HTTP server on loopback: /metrics, /health, /v1/models, the
OpenAI-compatible completions (streaming and not), /app/metrics, the manual
clock, client disconnects, and the `kvwatch sim` command's start and stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.cli import main as kvwatch_main
from kvwatch.sim.scenario import load_scenario
from kvwatch.sim.server import start_background
from sim_support import parse_samples, total

QUIET = load_scenario("idle")
TIMEOUT = httpx.Timeout(20.0)


@pytest.fixture
def quiet_server():
    with start_background(QUIET, speed=50) as server:
        yield server


def metrics(server) -> dict:
    response = httpx.get(server.metrics_url, timeout=TIMEOUT)
    assert response.status_code == 200
    return parse_samples(response.text)


def stream_completion(url: str, body: dict) -> list:
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_metrics_health_and_models(quiet_server):
    assert quiet_server.host == "127.0.0.1"
    response = httpx.get(quiet_server.metrics_url, timeout=TIMEOUT)
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = {family.name: family for family in text_string_to_metric_families(response.text)}
    assert families["vllm:kv_cache_usage_perc"].type == "gauge"
    assert "process_resident_memory_bytes" in families and "python_info" in families
    assert httpx.get(quiet_server.url + "/health", timeout=TIMEOUT).status_code == 200
    models = httpx.get(quiet_server.url + "/v1/models", timeout=TIMEOUT).json()
    assert models["data"][0]["id"] == "tiny-llama"
    assert models["data"][0]["max_model_len"] == 1024


def test_streaming_completion_becomes_an_engine_request(quiet_server):
    prompt = " ".join(f"w{i}" for i in range(40))
    events = stream_completion(quiet_server.url, {"model": "tiny-llama", "prompt": prompt, "max_tokens": 8,
                                                  "ignore_eos": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 8
    assert all(chunk["object"] == "text_completion" and chunk["model"] == "tiny-llama" for chunk in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 7 + ["length"]
    assert len("".join(c["choices"][0]["text"] for c in chunks).split()) == 8
    samples = metrics(quiet_server)
    assert total(samples, "vllm:request_success_total", finished_reason="length") == 1
    assert total(samples, "vllm:request_success_total") == 1
    assert total(samples, "vllm:generation_tokens_total") == 8
    assert total(samples, "vllm:prompt_tokens_total") == 40
    assert total(samples, "vllm:time_to_first_token_seconds_count") == 1
    assert total(samples, "http_requests_total", handler="/v1/completions", status="2xx") == 1


def test_non_streaming_chat_and_usage(quiet_server):
    body = {"model": "tiny-llama", "prompt": "one two three", "max_tokens": 5, "ignore_eos": True}
    response = httpx.post(quiet_server.url + "/v1/completions", json=body, timeout=TIMEOUT).json()
    assert response["choices"][0]["finish_reason"] == "length"
    assert len(response["choices"][0]["text"].split()) == 5
    assert response["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}

    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    events = []
    with httpx.stream("POST", quiet_server.url + "/v1/chat/completions", json=chat, timeout=TIMEOUT) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert parsed[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum(1 for p in parsed if p["choices"] and p["choices"][0]["delta"].get("content")) == 4
    assert parsed[-1]["usage"]["completion_tokens"] == 4 and parsed[-1]["choices"] == []


def test_without_ignore_eos_the_model_may_stop_early(quiet_server):
    body = {"model": "tiny-llama", "prompt": "a b c d e", "max_tokens": 50}
    first = httpx.post(quiet_server.url + "/v1/completions", json=body, timeout=TIMEOUT).json()
    again = httpx.post(quiet_server.url + "/v1/completions", json=body, timeout=TIMEOUT).json()
    produced = first["usage"]["completion_tokens"]
    assert 1 <= produced <= 50
    assert again["usage"]["completion_tokens"] == produced  # deterministic per prompt
    expected = "length" if produced == 50 else "stop"
    assert first["choices"][0]["finish_reason"] == expected


def test_repeated_prompts_hit_the_prefix_cache(quiet_server):
    prompt = " ".join(f"shared{i}" for i in range(200))
    for _ in range(2):
        httpx.post(quiet_server.url + "/v1/completions", timeout=TIMEOUT,
                   json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 2, "ignore_eos": True})
    samples = metrics(quiet_server)
    assert total(samples, "vllm:prefix_cache_queries_total") == 400
    assert total(samples, "vllm:prefix_cache_hits_total") == 192  # 6 full blocks of 32 of the 199 reusable tokens
    explicit = {"model": "tiny-llama", "prompt": "x", "kvwatch_prompt_tokens": 300, "max_tokens": 2, "ignore_eos": True}
    response = httpx.post(quiet_server.url + "/v1/completions", json=explicit, timeout=TIMEOUT).json()
    assert response["usage"]["prompt_tokens"] == 300


def test_errors_are_openai_shaped(quiet_server):
    url = quiet_server.url
    too_long = httpx.post(url + "/v1/completions", timeout=TIMEOUT,
                          json={"model": "tiny-llama", "prompt": "w " * 1000, "max_tokens": 100})
    assert too_long.status_code == 400
    assert too_long.json()["object"] == "error" and "maximum context length" in too_long.json()["message"]
    assert httpx.post(url + "/v1/completions", json={"model": "other", "prompt": "x"}, timeout=TIMEOUT).status_code == 404
    bad = httpx.post(url + "/v1/completions", content=b"{not json", timeout=TIMEOUT,
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400
    assert httpx.get(url + "/nope", timeout=TIMEOUT).status_code == 404
    samples = metrics(quiet_server)
    assert total(samples, "vllm:request_success_total") == 0
    assert total(samples, "http_requests_total", status="4xx") == 4


def test_frozen_clock_moves_only_when_advanced():
    with start_background(QUIET, speed=0) as server:
        result = {}

        def call():
            result["response"] = httpx.post(server.url + "/v1/completions", timeout=TIMEOUT,
                                             json={"model": "tiny-llama", "prompt": "a b", "max_tokens": 3,
                                                   "ignore_eos": True})

        thread = threading.Thread(target=call)
        thread.start()
        deadline = time.monotonic() + 10
        while server.sim.engines[0].num_waiting == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.sim.engines[0].num_waiting == 1  # arrived, and the frozen clock keeps it there
        assert "response" not in result
        server.advance(1.0)
        thread.join(timeout=10)
        assert not thread.is_alive()
        assert result["response"].json()["usage"]["completion_tokens"] == 3
        assert server.sim.now == pytest.approx(1.0)


def test_client_disconnect_aborts_the_request():
    with start_background(QUIET, speed=0) as server:
        body = json.dumps({"model": "tiny-llama", "prompt": "a b c", "max_tokens": 900, "stream": True,
                           "ignore_eos": True}).encode()
        with socket.create_connection((server.host, server.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            server.advance(0.5)
            assert b"200" in sock.recv(4096)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            server.advance(0.2)
            if total(metrics(server), "vllm:request_success_total", finished_reason="abort") == 1:
                break
            time.sleep(0.01)
        samples = metrics(server)
        assert total(samples, "vllm:request_success_total", finished_reason="abort") == 1
        assert total(samples, "vllm:num_requests_running") == 0
        assert total(samples, "vllm:kv_cache_usage_perc") == 0


def test_concurrent_streams_all_complete():
    with start_background(QUIET, speed=20) as server:
        results = [None] * 6

        def call(index):
            results[index] = stream_completion(server.url, {"model": "tiny-llama", "prompt": f"q{index} " * 30,
                                                            "max_tokens": 20, "ignore_eos": True})

        threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert all(r is not None and len(r) == 21 for r in results)
        samples = metrics(server)
        assert total(samples, "vllm:request_success_total", finished_reason="length") == 6
        assert total(samples, "vllm:iteration_tokens_total_count") > 0


def test_scenario_traffic_and_app_metrics_in_background():
    with start_background("upstream-delay", speed=60, engines=2) as server:
        deadline = time.monotonic() + 20
        while server.sim.now < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
        samples = metrics(server)
        assert total(samples, "vllm:request_success_total") > 0
        assert {dict(p)["engine"] for (n, p) in samples if n == "vllm:num_requests_running"} == {"0", "1"}
        app = httpx.get(server.app_metrics_url, timeout=TIMEOUT)
        families = {f.name: f for f in text_string_to_metric_families(app.text)}
        assert families["app_retrieval_seconds"].type == "histogram"
        assert total(parse_samples(app.text), "app_retrieval_seconds_count") > 0


def test_stop_releases_the_port():
    server = start_background(QUIET, speed=1)
    port = server.port
    server.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_stop_ends_every_connection_an_idle_keep_alive_one_too():
    # A client that keeps its connection open (a pooled session never closed)
    # held a handler thread waiting for its next request past the server's stop.
    before = set(threading.enumerate())
    server = start_background(QUIET, speed=1)
    client = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert client.recv(4096).startswith(b"HTTP/1.1 200")
        server.stop()
        left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
        assert left == []
        assert client.recv(4096) == b""  # the server's side is closed
    finally:
        client.close()
        server.stop()


def test_cli_lists_scenarios_and_rejects_a_bad_one(tmp_path, capsys):
    assert kvwatch_main(["sim", "--list-scenarios"]) == 0
    listed = capsys.readouterr().out
    for name in ("healthy", "exhaustion", "prefix-change", "eviction-pressure", "queueing", "slow-prefill",
                 "upstream-delay", "demo"):
        assert name in listed
    bad = tmp_path / "bad.yaml"
    bad.write_text("phases:\n  - duration: -3\n    workload: {rate: x}\n")
    assert kvwatch_main(["sim", "--scenario", str(bad), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "phases[0].duration" in err and "rate" in err and "prompt_tokens" in err and "output_tokens" in err


def test_cli_report_runs_offline(capsys):
    assert kvwatch_main(["sim", "--scenario", "exhaustion", "--report", "120", "--interval", "60"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[1] == "light" and lines[2].split()[1] == "overload"


def test_cli_times_read_the_duration_grammar_of_every_other_command(capsys):
    # `--report 2m --interval 1m` was refused: "invalid float value: '2m'".
    assert kvwatch_main(["sim", "--scenario", "exhaustion", "--report", "2m", "--interval", "1m"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:2] == ["60", "light"] and lines[2].split()[:2] == ["120", "overload"]
    assert kvwatch_main(["sim", "--duration", "10x", "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == "kvwatch sim: --duration: '10x' is not a duration (examples: 5, 5s, 500ms, 2m, 1h)"


def test_cli_serves_prints_its_url_and_stops_on_sigterm():
    process = subprocess.Popen(
        [sys.executable, "-m", "kvwatch", "sim", "--scenario", "healthy", "--port", "0", "--speed", "10"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
        reader.start()
        deadline = time.monotonic() + 30
        url = None
        while url is None and time.monotonic() < deadline and process.poll() is None:
            url = next((line.split("serving ", 1)[1].split()[0] for line in list(lines) if "serving http" in line), None)
            time.sleep(0.05)
        assert url and url.startswith("http://127.0.0.1:")
        assert httpx.get(url + "/metrics", timeout=TIMEOUT).status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
        reader.join(timeout=5)
        assert any("stopped" in line for line in lines)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=5)


@pytest.mark.parametrize("argv, error", [
    (["sim", "--port", "abc"], "kvwatch sim: --port: 'abc' is not a whole number"),
    (["sim", "--seed", "x"], "kvwatch sim: --seed: 'x' is not a whole number"),
    (["sim", "--speed", "fast"], "kvwatch sim: --speed: 'fast' is not a number"),
    (["sim", "--engines", "two"], "kvwatch sim: --engines: 'two' is not a whole number"),
    (["serve", "--replay", "capture.tar.gz", "--speed", "fast"],
     "kvwatch: --speed: 'fast' is not a number"),
    (["serve", "--replay", "capture.tar.gz", "--speed", "-1"],
     "kvwatch: --speed: '-1' must be at least 0"),
    (["diagnose", "--target", "http://127.0.0.1:9/metrics", "--duration", "-1s"], "--duration: '-1s' must be positive"),
])
def test_flags_say_what_is_wrong_in_one_sentence(argv, error, capsys):
    """argparse answered these with its usage and "invalid float value" or,
    for a value starting with '-', "expected one argument"."""
    assert kvwatch_main(argv) == 2
    err = capsys.readouterr().err
    assert error in err and "usage:" not in err and "expected one argument" not in err, err


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (reading whatever it sent), or None."""
    started = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - started < seconds:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - started
        except socket.timeout:
            continue
        except ConnectionResetError:
            return time.monotonic() - started
    return None


def test_a_slow_client_holds_a_handler_no_longer_than_the_request_deadline():
    """A client that trickles its headers a byte at a time (each byte well
    within the per-read socket timeout), one that sends half its declared
    body, and one that connects and says nothing: each connection is shut at
    the request deadline, and other clients are answered meanwhile."""
    with start_background(QUIET, speed=0, read_timeout=0.5) as server:
        idle = socket.create_connection((server.host, server.port), timeout=10)
        half = socket.create_connection((server.host, server.port), timeout=10)
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        trickle = socket.create_connection((server.host, server.port), timeout=10)
        stop = threading.Event()

        def trickled():
            request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 10_000
            for byte in request:
                if stop.wait(0.05):
                    return
                try:
                    trickle.sendall(bytes([byte]))
                except OSError:
                    return

        sender = threading.Thread(target=trickled, daemon=True)
        sender.start()
        try:
            assert httpx.get(server.metrics_url, timeout=TIMEOUT).status_code == 200
            for sock in (idle, half, trickle):
                assert _closed_within(sock, 15.0) is not None
            assert server.deadlines.shut >= 3
            # The deadline covers a request, not the connection: keep-alive requests each get their own.
            with httpx.Client(timeout=TIMEOUT) as client:
                for _ in range(3):
                    assert client.get(server.metrics_url).status_code == 200
                    time.sleep(0.3)
        finally:
            stop.set()
            sender.join(5)
            for sock in (idle, half, trickle):
                sock.close()


def test_a_request_answered_in_time_is_not_cut():
    """A streamed completion that takes longer than the read deadline is
    answered whole: once a request is read, its answer has request_timeout."""
    with start_background(QUIET, speed=20, read_timeout=0.3) as server:
        events = stream_completion(server.url, {"model": "tiny-llama", "prompt": "a b c " * 20, "max_tokens": 40,
                                                "ignore_eos": True})
        assert events[-1] == "[DONE]" and len(events) == 41
