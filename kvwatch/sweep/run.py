"""`kvwatch sweep`: measure a running OpenAI-compatible server (vLLM) across a
grid of prompt lengths x output lengths x concurrency levels.

Each cell keeps `concurrency` streaming `/v1/completions` requests in flight
for a fixed number of requests or a fixed duration, measures time to first
token at the client, and polls the server's /metrics in a background thread
for what the engine saw: its own TTFT histogram, peak KV usage, running and
waiting requests, preemptions and token counters. Beside each cell stands the
capacity bound of `kvwatch capacity` for that length.

This module owns the command line, the order of a run (checks, prompt
calibration, warm-up, cells) and stopping on Ctrl-C. The HTTP client is in
kvwatch/sweep/client.py, prompts in kvwatch/sweep/prompts.py, /metrics
polling in kvwatch/sweep/metrics.py and the files in kvwatch/sweep/output.py.
"""


from __future__ import annotations

import random
import signal
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any, TextIO

from kvwatch import __version__
from kvwatch.snapshot import bounded_text
from kvwatch.sweep.compare import compare, kv_bytes_per_token, write_comparison
from kvwatch.sweep.config import SweepConfig, SweepInputError, SweepRunError
from kvwatch.sweep.summary import capacity_bounds, cell_notes, foreign_note, summarize_cell
from kvwatch.sweep.client import Client, RequestResult, ServerError, Worker
from kvwatch.sweep.metrics import MetricsPoller, select_engines
from kvwatch.sweep.output import COLUMNS, KV_PLOT, TTFT_PLOT, append_requests, write_plots, write_results
from kvwatch.sweep.probe import not_run, run_probe
from kvwatch.sweep.prompts import PromptError, PromptMaker, calibrate_with_probes, calibrate_with_tokenize, tokenize_counter

EXIT_INTERRUPTED = 130  # the shell's code for a run ended by SIGINT
# After Ctrl-C, requests in flight get this long to finish before their
# connections are cut; then the workers get JOIN_AFTER_CUT_S to notice.
ABANDON_GRACE_S = 3.0
JOIN_AFTER_CUT_S = 2.0


# ---------------------------------------------------------------------------
# The run.


def _now_text() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Sweep:
    def __init__(self, config: SweepConfig, stderr: TextIO | None = None):
        self.config = config
        self.stderr = stderr or sys.stderr
        self.client = Client(config.base_url, config.timeout, config.api_key)
        self.poller = MetricsPoller(config.metrics_url, config.model, config.poll_interval,
                                    timeout=min(10.0, config.timeout))
        self.stop = threading.Event()
        self.cells: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.server: dict[str, Any] = {"base_url": config.base_url,
                                       "metrics_url": config.metrics_url}
        self.bounds: dict[tuple[int, int], dict] = {}
        self.started_at = _now_text()
        self.finished_at: str | None = None
        self.interrupted = False
        self.prompts: PromptMaker | None = None
        self.probe: dict[str, Any] | None = None
        self._previous_handlers: dict[int, Any] = {}

    def say(self, message: str) -> None:
        print(message, file=self.stderr, flush=True)

    # -- entry -------------------------------------------------------------------

    def run(self) -> int:
        self._install_signal_handlers()
        try:
            try:
                self._prepare()
            except SweepInputError as error:
                self.say(f"kvwatch sweep: error: {error}")
                return 2
            except (SweepRunError, PromptError, ServerError) as error:
                self.say(f"kvwatch sweep: error: {error}")
                return 1
            self._measure()
            return self._finish()
        except KeyboardInterrupt:
            # A second Ctrl-C: quit now. Every measured cell is already on disk.
            self.client.abandon_all()
            self.interrupted = True
            try:
                self._write()  # only to mark the files interrupted; they were complete already
            except (KeyboardInterrupt, OSError):
                pass
            self.say(f"kvwatch sweep: stopped at once; {len(self.cells)} cell(s) kept in "
                     f"{self.config.out_dir}")
            return EXIT_INTERRUPTED
        finally:
            self.poller.stop()
            self._restore_signal_handlers()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach only the main thread; a caller elsewhere stops via .stop
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.stop.is_set():
            raise KeyboardInterrupt
        self.stop.set()
        # Only sets a flag: the loop sees it, lets requests in flight finish for
        # a moment, cuts the rest and writes what was measured.
        self.say(f"kvwatch sweep: {signal.Signals(signum).name} received: stopping; the running "
                 f"cell is dropped, measured cells are kept (again to quit at once)")

    # -- before the cells --------------------------------------------------------

    def _prepare(self) -> None:
        config = self.config
        try:
            config.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SweepInputError(f"--out: cannot create {config.out_dir}: {error}") from None
        max_model_len = self._check_model()
        self.server["max_model_len"] = max_model_len
        self.server["vllm_version"] = self._server_version()
        if max_model_len:
            too_long = [(i, o) for i in config.input_tokens for o in config.output_tokens
                        if i + o > max_model_len]
            if too_long:
                listed = ", ".join(f"{i}+{o}" for i, o in too_long)
                raise SweepInputError(
                    f"input + output tokens exceed the server's max_model_len {max_model_len}: "
                    f"{listed}")
        snapshot, problem = self.poller.poll()
        if snapshot is None:
            raise SweepRunError(f"cannot read {config.metrics_url}: {problem}")
        if not snapshot.engines:
            raise SweepRunError(f"{config.metrics_url} has no vLLM metrics (vllm:* families); "
                                "point --metrics-url at the engine's /metrics")
        engines = select_engines(snapshot, config.model)
        self.server["engines"] = [{"model_name": m, "engine": e} for m, e in engines]
        # Every label: a comparison of two sweeps names whichever setting changed.
        self.server["cache_config"] = {engine: dict(info)
                                       for engine, info in snapshot.cache_config.items()}
        self.server["kv_bytes_per_token"] = {
            engine: kv_bytes_per_token(info) for engine, info in snapshot.cache_config.items()}
        if not any(m == config.model for m, _ in engines):
            self.notes.append(f"no engine series is labelled model_name={config.model!r}; "
                              "all engines on the page are counted")
        pairs = [(i, o) for i in config.input_tokens for o in config.output_tokens]
        self.bounds, capacity_note = capacity_bounds(snapshot, config, pairs)
        self.server["capacity_note"] = capacity_note
        self.prompts = self._calibrate(max_model_len)
        self.server["prompt_method"] = self.prompts.describe()
        self.server["prompt_recipe"] = self.prompts.recipe()
        self.server["prompt_checks"] = {str(k): v for k, v in self.prompts.checks.items()}
        too_short = [i for i in config.input_tokens if i < self.prompts.min_tokens()]
        if too_short:
            raise SweepInputError(
                f"--input-tokens {', '.join(map(str, too_short))}: the shortest prompt this "
                f"server's tokenizer makes is {self.prompts.min_tokens()} tokens")
        self._warm_up()

    def _server_version(self) -> str | None:
        """vLLM's /version, None when the server has no such endpoint."""
        try:
            status, body = self.client.get_json("/version", timeout=min(10.0, self.config.timeout))
        except ServerError:
            return None
        if status == 200 and isinstance(body, dict) and isinstance(body.get("version"), str):
            return body["version"]
        return None

    def _run_probe(self) -> None:
        """Greedy answers to the fixed probe prompts, one at a time on the idle
        server, after the cells so that it cannot touch their figures
        (kvwatch/sweep/probe.py)."""
        if self.stop.is_set():
            self.probe = not_run("the sweep was stopped before the quality probe")
            return
        busy = self._wait_idle("the quality probe")
        self.probe = run_probe(self.client, self.config.model, self.config.timeout)
        if busy:
            self.probe["note"] = ((self.probe["note"] + "; ") if self.probe["note"] else "") + \
                "the server had other traffic, whose batches can change what greedy decoding picks"
        answered = sum(1 for entry in self.probe["results"] if entry["error"] is None)
        self.say(f"kvwatch sweep: quality probe: {self.probe['status']}, {answered} of "
                 f"{len(self.probe['results'])} prompts answered"
                 + (f" ({self.probe['note']})" if self.probe["note"] else ""))
        if self.probe["note"]:
            self.notes.append(f"quality probe: {self.probe['note']}")

    def _check_model(self) -> int | None:
        """The served models must include --model; returns its max_model_len if listed."""
        url = f"{self.config.base_url}/v1/models"
        try:
            status, body = self.client.get_json("/v1/models", timeout=min(10.0, self.config.timeout))
        except ServerError as error:
            raise SweepRunError(f"cannot reach the server: {error}") from None
        if status in (401, 403):
            raise SweepRunError(f"{url} answered HTTP {status}: the server wants an API key "
                                "(--api-key-file)")
        if status != 200 or not isinstance(body, dict) or not isinstance(body.get("data"), list):
            self.notes.append(f"{url} answered HTTP {status} without a model list; the model "
                              "name and lengths were not checked")
            return None
        served = {m.get("id"): m for m in body["data"] if isinstance(m, dict)}
        if self.config.model not in served:
            names = ", ".join(sorted(str(name) for name in served)) or "none"
            raise SweepInputError(f"--model {self.config.model!r} is not served by "
                                  f"{self.config.base_url} (it serves: {names})")
        root = served[self.config.model].get("root")
        self.server["model_root"] = root if isinstance(root, str) else None
        length = served[self.config.model].get("max_model_len")
        return int(length) if isinstance(length, int) and length > 0 else None

    def _calibrate(self, max_model_len: int | None) -> PromptMaker:
        count = tokenize_counter(self.client, self.config.model)
        recipe = self.config.prompt_recipe
        if recipe is not None:
            # The baseline's words with its seed: the same prompt texts, letter for letter.
            maker = PromptMaker.from_recipe(recipe, count)
            for length in self.config.input_tokens:
                maker.check_length(length, self.config.seed)
            self.notes.append(f"prompts repeat those of the baseline {self.config.baseline_dir} "
                              f"(seed {self.config.seed}, its prompt recipe)")
            return maker
        calibrated = calibrate_with_tokenize(count) if count is not None else None
        if calibrated is not None:
            maker = calibrated
            for length in self.config.input_tokens:
                maker.check_length(length, self.config.seed)
            if maker.fitted_lengths:
                self.notes.append("prompt lengths "
                                  + ", ".join(map(str, sorted(maker.fitted_lengths)))
                                  + " did not come out exact from word costs; each such prompt "
                                  "is fitted with /tokenize")
            return maker
        if count is not None:
            self.notes.append("/tokenize found fewer than 4 one-token words; prompt lengths are "
                              "calibrated from the server's counts instead")
        return calibrate_with_probes(self._probe_prompt_tokens, max_model_len, self.config.seed)

    def _probe_prompt_tokens(self, text: str) -> int:
        """Prompt tokens the server counts for this text: a one-token completion's
        usage, else the increase of its prompt_tokens counter."""
        before = self._prompt_counter()
        body = {"model": self.config.model, "prompt": text, "max_tokens": 1, "ignore_eos": True}
        try:
            status, answer = self.client.post_json("/v1/completions", body)
        except ServerError as error:
            raise SweepRunError(f"calibration request failed: {error}") from None
        if status != 200:
            detail = answer.get("message") if isinstance(answer, dict) else None
            raise SweepRunError(f"calibration request to /v1/completions answered HTTP {status}"
                                + (f": {detail}" if detail else ""))
        usage = answer.get("usage") if isinstance(answer, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            return usage["prompt_tokens"]
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            after = self._prompt_counter()
            if before is not None and after is not None and after > before:
                return int(after - before)
            time.sleep(0.1)
        raise SweepRunError("cannot calibrate prompt lengths: the server has no /tokenize, its "
                            "completions carry no usage and its prompt_tokens counter did not move")

    def _prompt_counter(self) -> float | None:
        snapshot, _ = self.poller.poll()
        if snapshot is None:
            return None
        found = [snapshot.engines[k].counters.get("prompt_tokens")
                 for k in select_engines(snapshot, self.config.model)]
        values = [v for v in found if v is not None]
        return sum(values) if values else None

    def _request_body(self, prompt: str, output_tokens: int) -> dict[str, Any]:
        return {"model": self.config.model, "prompt": prompt, "max_tokens": output_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    def _warm_up(self) -> None:
        if not self.config.warmup:
            return
        worker = Worker(self.client)
        length = self.config.input_tokens[0]
        try:
            for index in range(self.config.warmup):
                if self.stop.is_set():
                    return
                prompt = self._prompts().make(length, random.Random(f"{self.config.seed}-warmup-{index}"))
                result = self.client.stream_completion(
                    worker, self._request_body(prompt.text, min(16, self.config.output_tokens[0])))
                if not result.ok:
                    raise SweepRunError(f"the warm-up request failed: {result.error}")
        finally:
            worker.close()

    # -- the cells ---------------------------------------------------------------

    def _measure(self) -> None:
        config = self.config
        grid = config.cells
        per_cell = (f"{config.requests} requests" if config.requests is not None
                    else f"{config.duration:g} s")
        self.say(f"kvwatch sweep: {len(grid)} cells ({len(config.input_tokens)} input x "
                 f"{len(config.output_tokens)} output lengths x {len(config.concurrency)} "
                 f"concurrency levels), {per_cell} each, model {config.model!r} at "
                 f"{config.base_url}")
        self.say(f"kvwatch sweep: prompts: {self._prompts().describe()}; results in {config.out_dir}")
        self._write()
        self.poller.start()
        for number, (inp, out, conc) in enumerate(grid, start=1):
            if self.stop.is_set():
                break
            cell = self._run_cell(number, inp, out, conc)
            if cell is None:
                break
            self.cells.append(cell)
            self._write()
            self.say(self._progress_line(number, len(grid), cell))

    def _prompts(self) -> PromptMaker:
        if self.prompts is None:  # _prepare calibrates them before any cell
            raise SweepRunError("the prompts were not calibrated")
        return self.prompts

    def _wait_idle(self, what: str) -> bool:
        """Let the previous cell's requests leave the engine, so cells do not overlap.
        A server with other traffic never goes idle: after --idle-wait the cell
        starts anyway, with a note. Apart from the request timeout, so a short
        wait does not also cut the requests short on a busy machine."""
        limit = self.config.idle_wait
        deadline = time.monotonic() + limit
        while not self.stop.is_set():
            snapshot, _ = self.poller.poll()
            if snapshot is not None:
                engines = [snapshot.engines[k] for k in select_engines(snapshot, self.config.model)]
                busy = sum(e.gauges.get("running", 0.0) + e.gauges.get("waiting", 0.0)
                           for e in engines)
                if busy == 0:
                    return False
            if time.monotonic() > deadline:
                self.notes.append(f"{what}: the server was still busy after {limit:g} s; "
                                  + ("the cell may include other traffic" if what.startswith("cell")
                                     else "it ran anyway"))
                return True
            self.stop.wait(min(0.1, self.config.poll_interval))
        return False  # stopped: the caller checks stop itself

    def _run_cell(self, number: int, inp: int, out: int, conc: int) -> dict[str, Any] | None:
        config = self.config
        busy = self._wait_idle(f"cell {number}")
        if self.stop.is_set():
            return None
        workers = [Worker(self.client) for _ in range(conc)]
        for worker in workers:
            worker.open()
        self.poller.begin_cell()
        results: list[tuple[int, RequestResult]] = []
        lock = threading.Lock()
        sent = 0
        cell_deadline = (time.monotonic() + config.duration) if config.duration is not None else None

        def claim() -> int | None:
            nonlocal sent
            with lock:
                if self.stop.is_set():
                    return None
                if config.requests is not None and sent >= config.requests:
                    return None
                if cell_deadline is not None and time.monotonic() >= cell_deadline:
                    return None
                sent += 1
                return sent - 1

        def work(worker: Worker) -> None:
            try:
                while (index := claim()) is not None:
                    # Keyed by the cell's coordinates, not its position: a sweep with the
                    # same seed sends the same prompts to the same cell whatever its grid.
                    prompt = self._prompts().make(
                        inp, random.Random(f"{config.seed}-{inp}-{out}-{conc}-{index}"))
                    result = self.client.stream_completion(worker, self._request_body(prompt.text, out))
                    with lock:
                        results.append((index, result))
            except Exception as error:  # a bug must not hang the cell; report it as a failure
                with lock:
                    results.append((-1, RequestResult(ok=False, started=time.monotonic(),
                                                      latency=0.0, error=repr(error))))
            finally:
                worker.close()

        threads = [threading.Thread(target=work, args=(worker,), name=f"kvwatch-sweep-{number}-{i}",
                                    daemon=True) for i, worker in enumerate(workers)]
        for thread in threads:
            thread.start()
        while alive := [thread for thread in threads if thread.is_alive()]:
            if self.stop.is_set():
                self._abandon(threads)
                self.poller.end_cell()
                return None
            alive[0].join(timeout=0.1)
        self._settle(sum(1 for _, r in results if r.ok))
        metrics = self.poller.end_cell()
        ordered = [result for _, result in sorted(results, key=lambda item: item[0])]
        cell = summarize_cell(number, inp, out, conc, ordered, metrics, self.bounds.get((inp, out)))
        cell["other_traffic"] = busy
        if cell["foreign_requests"]:
            # Said while the sweep runs, not only in the files at the end.
            self.say(f"kvwatch sweep: {foreign_note(cell)}")
        self.notes.extend(cell_notes(cell, metrics, config.poll_interval))
        append_requests(config.out_dir, self._request_rows(cell, sorted(results, key=lambda x: x[0])),
                        first=not self.cells)
        return cell

    def _abandon(self, threads: list[threading.Thread]) -> None:
        """Give requests in flight a moment, then cut their connections."""
        grace = time.monotonic() + min(ABANDON_GRACE_S, self.config.timeout)
        for thread in threads:
            thread.join(timeout=max(0.0, grace - time.monotonic()))
        cut = self.client.abandon_all()
        if cut:
            self.say(f"kvwatch sweep: abandoned {cut} request(s) in flight")
        limit = time.monotonic() + JOIN_AFTER_CUT_S
        for thread in threads:
            thread.join(timeout=max(0.0, limit - time.monotonic()))

    def _settle(self, completed: int) -> None:
        """Wait (briefly) until the engine's counters show the cell's requests
        finished, so the closing poll holds all of them."""
        deadline = time.monotonic() + max(2.0, 4 * self.config.poll_interval)
        while time.monotonic() < deadline and not self.stop.is_set():
            snapshot, _ = self.poller.poll()
            metrics = self.poller.current()
            finished = metrics.finished()
            if snapshot is not None:
                engines = [snapshot.engines[k] for k in select_engines(snapshot, self.config.model)]
                idle = all(e.gauges.get("running", 0.0) == 0 for e in engines)
                if idle and (finished is None or finished >= completed):
                    return
            time.sleep(min(0.1, self.config.poll_interval))

    @staticmethod
    def _request_rows(cell: dict[str, Any], results: list[tuple[int, RequestResult]]):
        first = min((r.started for _, r in results), default=0.0)
        for index, result in results:
            yield {"cell": cell["cell"], "input_tokens": cell["input_tokens"],
                   "output_tokens": cell["output_tokens"], "concurrency": cell["concurrency"],
                   "index": index, "start_s": result.started - first, "ok": int(result.ok),
                   "ttft_s": result.ttft, "latency_s": result.latency,
                   "prompt_tokens": result.prompt_tokens,
                   "completion_tokens": result.completion_tokens, "chunks": result.chunks,
                   "finish_reason": result.finish_reason, "error": result.error}

    @staticmethod
    def _progress_line(number: int, total: int, cell: dict[str, Any]) -> str:
        def f(value: Any, digits: int = 3) -> str:
            return "-" if value is None else f"{value:.{digits}g}"

        bound = cell["capacity_bound"]
        return (f"[{number}/{total}] in {cell['input_tokens']} out {cell['output_tokens']} "
                f"c {cell['concurrency']}: {cell['completed']} ok, {cell['failed']} failed in "
                f"{cell['seconds']:.1f} s | TTFT p50 {f(cell['client_ttft_p50_s'])} "
                f"p95 {f(cell['client_ttft_p95_s'])} s (engine p95 "
                f"{bounded_text(f(cell['engine_ttft_p95_s']), cell.get('engine_ttft_p95_s_pinned'))}) | peak KV {f(cell['peak_kv_usage'])}, "
                f"running {f(cell['peak_running'])}"
                + (f" (bound {bound})" if bound is not None else "")
                + f" | preempted {f(cell['preemptions'])} | "
                f"{f(cell['generation_tokens_per_s'], 4)} gen tok/s"
                + (f" | first error: {cell['first_error']}" if cell["first_error"] else ""))

    # -- after -------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        return {
            "kvwatch_version": __version__,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "interrupted": self.interrupted,
            "planned_cells": len(self.config.cells),
            "config": self.config.to_dict(),
            "server": self.server,
            "capacity": [{"input_tokens": inp, "output_tokens": out, **bound}
                         for (inp, out), bound in self.bounds.items()],
            "columns": COLUMNS,
            "cells": self.cells,
            "quality_probe": self.probe,
            "notes": self.notes,
        }

    def _write(self) -> None:
        write_results(self.config.out_dir, self.report())

    def _compare_with_baseline(self) -> None:
        """--baseline: compare.json, compare.md and plots beside this sweep's files."""
        baseline = self.config.baseline
        if baseline is None or not self.cells:
            return
        result = compare(baseline, self.report(), force=self.config.force,
                         names=(str(self.config.baseline_dir), str(self.config.out_dir)))
        written = write_comparison(self.config.out_dir, result, plots=self.config.plots)
        for line in result["headline"]:
            self.say(f"kvwatch sweep: {line}")
        changed = [item["what"] for item in result["changes"]["conditions"]
                   + result["changes"]["settings"]]
        self.say(f"kvwatch sweep: compared with {self.config.baseline_dir}: "
                 + (f"changed: {', '.join(changed)}" if changed else "nothing recorded changed")
                 + f"; {len(result['cells']['compared'])} cell(s) compared, "
                 f"{len(result['cells']['refused'])} refused; wrote {', '.join(written)}")

    def _finish(self) -> int:
        self._run_probe()
        self.interrupted = self.stop.is_set()
        self.finished_at = _now_text()
        self._write()
        out_dir = self.config.out_dir
        if self.config.plots and self.cells:
            try:
                write_plots(out_dir, self.cells)
                plots = f", {TTFT_PLOT}, {KV_PLOT}"
            except ImportError:
                plots = ""
                self.say("kvwatch sweep: plots skipped: matplotlib is not installed "
                         "(pip install 'kvwatch[sweep]')")
        else:
            plots = ""
        written = "sweep.csv, sweep.json, " + ("requests.csv, " if self.cells else "") \
            + f"summary.md{plots}"
        self._compare_with_baseline()
        if self.interrupted:
            self.say(f"kvwatch sweep: interrupted; {len(self.cells)} of {len(self.config.cells)} "
                     f"cell(s) kept in {out_dir} ({written})")
            return EXIT_INTERRUPTED
        foreign = [cell for cell in self.cells if cell.get("foreign_requests") or cell.get("other_traffic")]
        if foreign:
            self.say(f"kvwatch sweep: other traffic on the server in {len(foreign)} of {len(self.cells)} cell(s) "
                     f"({sum(c.get('foreign_requests') or 0 for c in foreign)} requests it did not send); their "
                     "engine figures include it, and --compare refuses them")
        self.say(f"kvwatch sweep: done; wrote {written} in {out_dir}")
        if any(cell["completed"] == 0 for cell in self.cells):
            self.say("kvwatch sweep: some cells completed no request; see first_error in sweep.csv")
            return 1
        return 0

