"""Coverage-guided fuzzing of everything a page goes through (see
pipeline.py), for atheris/libFuzzer. Run by tests/test_fuzz_atheris.py with a
time budget; by hand:

    .venv/bin/python tests/fuzz/atheris_pipeline.py -max_total_time=600 CORPUS_DIR

An input is up to three pages separated by the byte 0x1E, polled in order by
one kvwatch, so restarts, renames and resets between polls are reachable
too. Bytes that are not UTF-8 are replaced, as only UTF-8 pages get past the
fetch. Any exception is a crash; libFuzzer's -timeout and -rss_limit_mb
bound each input's time and memory.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from unittest import mock

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for fuzz.pipeline

with atheris.instrument_imports(include=["kvwatch"]):
    import kvwatch.sidecar.collector  # noqa: F401
    import kvwatch.diagnose  # noqa: F401
    import kvwatch.engines.vllm
    import kvwatch.exposition  # noqa: F401
    import kvwatch.pipeline.monitor
    import kvwatch.sidecar.report  # noqa: F401
    import kvwatch.signals  # noqa: F401
    import kvwatch.sidecar.statuspage  # noqa: F401
    import kvwatch.window  # noqa: F401

from fuzz.pipeline import Pipeline  # noqa: E402

logging.disable(logging.CRITICAL)  # a failed poll logs; at thousands a second that is all libFuzzer would do
MAX_SERIES = 20
# The adapter compiles its parser's scanner when built (tens of ms); one
# adapter serves every input, as one serves every poll in kvwatch.
ADAPTER = kvwatch.engines.vllm.VllmAdapter(max_series=MAX_SERIES)


def fresh_pipeline() -> Pipeline:
    with mock.patch.object(kvwatch.pipeline.monitor, "make_adapter", lambda engine, max_series: ADAPTER):
        return Pipeline(max_series=MAX_SERIES)


def one_input(data: bytes) -> None:
    pipeline = fresh_pipeline()
    for page in data.decode("utf-8", "replace").split("\x1e")[:3]:
        pipeline.poll(page)
    # Parsing the exposition back costs ten times the rest: only when the
    # input got as far as engines to export.
    pipeline.views(parse_back=pipeline.monitor.state.up)


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
