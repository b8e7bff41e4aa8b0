"""A coverage-guided fuzz run (atheris, libFuzzer) of everything a page goes
through, with a time budget, in a subprocess: libFuzzer owns its process and
exits on the first crash.

Seeds are the real captures (cut into pieces at line boundaries) and
synthetic pages in old and new spellings, with a restart between two polls;
a dictionary gives libFuzzer the tokens of the format. The run passes when
libFuzzer reports no crash (an exception escaping kvwatch), no input slower
than -timeout and no memory over -rss_limit_mb.

KVWATCH_ATHERIS_SECONDS sets the budget (default 20).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz.pages import Engine, page
from kvwatch.engines.vllm import PREFIXES, all_families

atheris = pytest.importorskip("atheris", reason="atheris is in the test extra on x86_64 only")

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests" / "fuzz" / "atheris_pipeline.py"
SECONDS = int(os.environ.get("KVWATCH_ATHERIS_SECONDS", "20"))
MAX_LEN = 16 * 1024
SEPARATOR = b"\x1e"  # between the pages of one input (see the harness)


def write_seeds(directory: Path, fixtures_dir: Path) -> int:
    directory.mkdir()
    count = 0

    def seed(data: bytes) -> None:
        nonlocal count
        (directory / f"seed-{count:03d}").write_bytes(data[:MAX_LEN])
        count += 1

    for capture in sorted(fixtures_dir.rglob("*.txt")):
        text = capture.read_bytes()
        # Only the vLLM lines (plus their comments): the rest is dead weight
        # to a fuzzer with a length limit.
        lines = [line for line in text.splitlines(keepends=True) if b"vllm" in line]
        chunk = b""
        for line in lines:
            if len(chunk) + len(line) > MAX_LEN // 4:  # room to grow
                seed(chunk)
                chunk = b""
            chunk += line
        if chunk:
            seed(chunk)
    before = page(Engine(prompt_tokens=1000, prefix_queries=100, prefix_hits=40, created=1.0,
                         ttft_cumulative=(1, 2, 3, 4, 5), ttft_sum=3.0), names="old")
    after = page(Engine(prompt_tokens=50, prefix_queries=30, prefix_hits=10, created=2.0,
                        ttft_cumulative=(0, 1, 1, 2, 2), ttft_sum=1.0), Engine(model='a"b\\c\nd', engine="1"))
    seed(before.encode() + SEPARATOR + after.encode())
    seed(after.encode() + SEPARATOR + after.encode() + SEPARATOR + before.encode())
    return count


def write_dictionary(path: Path) -> None:
    tokens = set(PREFIXES) | set(all_families())
    tokens |= {"_total", "_bucket", "_sum", "_count", "_created", "{", "}", '="', '",', '\\"', "\\\\", "\\n", " # ",
               "NaN", "+Inf", "-Inf", "1e308", "# TYPE ", "# HELP ", "# EOF", " counter", " gauge", " histogram",
               'le="', 'model_name="', 'engine="', 'pid="', 'finished_reason="', "\n", "\x1e"}
    entries = []
    for token in sorted(tokens):
        escaped = "".join(c if c.isprintable() and c not in '"\\' else f"\\x{ord(c):02x}" for c in token)
        entries.append(f'"{escaped}"')
    path.write_text("\n".join(entries) + "\n")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="atheris wheels are x86_64 only")
@pytest.mark.timeout(SECONDS + 180)
def test_coverage_guided_fuzz_run_finds_no_crash(tmp_path, fixtures_dir):
    seeds = tmp_path / "seeds"
    assert write_seeds(seeds, fixtures_dir) > 10
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    dictionary = tmp_path / "exposition.dict"
    write_dictionary(dictionary)
    command = [
        sys.executable, str(HARNESS),
        f"-max_total_time={SECONDS}",
        "-timeout=10",  # seconds for one input: a hang is a finding
        "-rss_limit_mb=2048",
        f"-max_len={MAX_LEN}",
        f"-dict={dictionary}",
        f"-artifact_prefix={tmp_path}/",
        "-print_final_stats=1",
        str(corpus), str(seeds),
    ]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    finished = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True,
                              timeout=SECONDS + 150)
    output = finished.stdout + finished.stderr
    crashes = [p for p in tmp_path.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-", "leak-"))]
    assert finished.returncode == 0 and not crashes, (
        f"libFuzzer found {[p.name for p in crashes]} (rc {finished.returncode}); reproduce with "
        f"`.venv/bin/python {HARNESS.relative_to(REPO)} <artifact>`:\n{output[-6000:]}")
    done = re.search(r"Done (\d+) runs", output)
    assert done and int(done.group(1)) > 0, output[-3000:]
    # It explored: the seeds alone already cover the parser's main paths.
    coverage = [int(c) for c in re.findall(r"cov: (\d+)", output)]
    assert coverage and max(coverage) > 200, output[-3000:]
