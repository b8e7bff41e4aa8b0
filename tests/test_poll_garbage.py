"""A poll leaves no reference cycles behind.

kvwatch serve runs the cyclic garbage collector rarely (kvwatch/pipeline/monitor.py:
tune_garbage_collector), because a poll's objects are freed by reference
counting. Anything a poll leaves in a cycle therefore lingers until a rare
collection, and resident memory creeps up meanwhile (a timer thread per fetch
once left about 27 objects per poll). The engine here is a separate process,
so the only cycles counted are the poll's own."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import pytest



@pytest.fixture
def engine_url(tmp_path, fixtures_dir):
    (tmp_path / "metrics.txt").write_text((fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text())
    process = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1", "0"],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = process.stdout.readline()
        port = re.search(r"port (\d+)", line)
        assert port, f"http.server did not say its port: {line!r}"
        yield f"http://127.0.0.1:{port.group(1)}/metrics.txt"
    finally:
        process.terminate()
        process.wait(10)


# Counted in a process of its own: the suite's earlier tests leave objects
# (a stopped simulator's server, say) that something of theirs releases only
# later, and a collection during these polls would count them as the poll's.
MEASURE = """
import gc, json, sys
from collections import Counter
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
settings = load_settings(overrides={"target": sys.argv[1], "poll_interval": "1s", "window": "1m"}, environ={})
monitor = Monitor(settings)
for _ in range(3):  # connections, caches and the deadline thread come with the first polls
    assert monitor.poll_once().up
gc.collect()
gc.disable()
for _ in range(30):
    assert monitor.poll_once().up
gc.set_debug(gc.DEBUG_SAVEALL)
found = gc.collect()
kinds = Counter(type(o).__qualname__ for o in gc.garbage)
print(json.dumps({"found": found, "kinds": kinds.most_common(8)}))
"""


def test_polls_leave_no_reference_cycles(engine_url):
    result = subprocess.run([sys.executable, "-c", MEASURE, engine_url], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    found, kinds = measured["found"], measured["kinds"]
    assert found == 0, f"30 polls left {found} objects in reference cycles: {kinds}"
