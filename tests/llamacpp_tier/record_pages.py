"""Records /metrics pages of the tier's real llama-server into a fixtures folder.

    .venv/bin/python -m tests.llamacpp_tier.record_pages --out DIR

(`make capture-llamacpp`). Starts the tier's server (4 slots, 4096-token
context, prompt caching on), then writes, each with the moment it shows:

- metrics-idle.txt: fresh server, no request yet;
- metrics-prefix-a.txt, metrics-prefix-b.txt: before and after a shared-prefix
  load (requests sharing a 256-token prefix, each with its own 32-token suffix,
  16 generated tokens), idle both times, so the counters' increase between them
  is that load's alone;
- metrics-full.txt: during a burst of 8 distinct requests on the 4 slots, the
  first page with all slots busy and requests deferred;
- record.json: the server's command, its /props, what each load sent and got,
  and when each page was read.

It loads the CPU: run it alone, not beside the tiers or other servers.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path

from vllm_tier.harness import burst_load, shared_prefix_load
from vllm_tier.kvwatch_support import parse_page

from .harness import _open, llama_server, server_props, wait_until_idle

SLOTS = 4


def _page(url: str) -> str:
    with _open(url, timeout=10) as response:
        return response.read().decode()


def _stamp() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"pages": {}}
    with llama_server(slots=SLOTS, log_path=out / "server.log.tmp") as server:
        home = str(Path.home())
        record["command"] = [Path(server.command[0]).name,
                             *(arg.replace(home, "~") for arg in server.command[1:])]
        props = server_props(server.base_url)
        record["props"] = {k: props.get(k) for k in ("build_info", "total_slots", "model_alias")}
        record["props"]["n_ctx_per_slot"] = props.get("default_generation_settings", {}).get("n_ctx")

        def keep(name: str, text: str, moment: str) -> None:
            (out / name).write_text(text)
            record["pages"][name] = {"read_at": _stamp(), "moment": moment}

        keep("metrics-idle.txt", _page(server.metrics_url), "fresh server, no request yet")
        wait_until_idle(server.metrics_url)
        keep("metrics-prefix-a.txt", _page(server.metrics_url), "idle, before the shared-prefix load")
        with shared_prefix_load(server.base_url, duration=10.0, concurrency=SLOTS, prefix_tokens=256,
                                suffix_tokens=32, output_tokens=16, seed=11) as run:
            stats = run.wait()
        record["prefix_load"] = vars(stats)
        wait_until_idle(server.metrics_url)
        time.sleep(1.0)
        keep("metrics-prefix-b.txt", _page(server.metrics_url), "idle, after the shared-prefix load")
        with burst_load(server.base_url, concurrency=2 * SLOTS, prompt_tokens=200, output_tokens=256,
                        duration=10.0, seed=12) as run:
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:
                text = _page(server.metrics_url)
                metrics = parse_page(text)
                if (metrics.value("llamacpp:requests_processing") == SLOTS
                        and metrics.value("llamacpp:requests_deferred") > 0):
                    keep("metrics-full.txt", text,
                         "burst of 8 distinct requests on 4 slots: all busy, requests deferred")
                    break
                time.sleep(0.2)
            stats = run.wait()
        record["burst_load"] = vars(stats)
    (out / "server.log.tmp").unlink(missing_ok=True)
    (out / "record.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    main()
