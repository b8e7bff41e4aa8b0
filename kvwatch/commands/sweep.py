"""`kvwatch sweep`: measure a running OpenAI-compatible server across a grid
of prompt lengths x output lengths x concurrency levels (kvwatch/sweep/)."""

from __future__ import annotations

import argparse
import sys

from kvwatch.capacity import arithmetic as cap
from kvwatch.sweep.config import SweepInputError, build_config
from kvwatch.sweep.run import Sweep


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, metavar="URL",
                        help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    parser.add_argument("--metrics-url", metavar="URL",
                        help="its Prometheus metrics (default: BASE-URL/metrics)")
    parser.add_argument("--model", required=True, metavar="NAME",
                        help="the served model name sent with every request")
    parser.add_argument("--input-tokens", required=True, metavar="N,N,...",
                        help="prompt lengths in tokens, e.g. 128,512")
    parser.add_argument("--output-tokens", required=True, metavar="N,N,...",
                        help="generated tokens per request (max_tokens, sent with ignore_eos), "
                        "e.g. 64,256")
    parser.add_argument("--concurrency", required=True, metavar="N,N,...",
                        help="requests kept in flight, e.g. 1,4,16")
    amount = parser.add_mutually_exclusive_group(required=True)
    amount.add_argument("--requests", type=int, metavar="N", help="requests per cell")
    amount.add_argument("--duration", metavar="TIME",
                        help="time per cell (30s, 2m): new requests start until it has passed, "
                        "then those in flight finish")
    parser.add_argument("--out", metavar="DIR",
                        help="folder for the results (default: ./kvwatch-sweep-<date>-<time>)")
    parser.add_argument("--model-config", metavar="PATH",
                        help="the model's config.json (file or folder): compute the capacity "
                        "bound from the attention structure instead of the server's reported pool")
    parser.add_argument("--kv-dtype", default="auto", metavar="DTYPE",
                        help="KV cache dtype for --model-config: " + "|".join(cap.KV_DTYPE_CHOICES)
                        + " (auto: the server's cache_dtype, else the config's torch_dtype)")
    parser.add_argument("--kv-budget", metavar="SIZE",
                        help="KV bytes for --model-config (e.g. 3GiB); default: the server's "
                        "kv_cache_memory_bytes")
    parser.add_argument("--poll-interval", default="0.5s", metavar="TIME",
                        help="how often /metrics is polled during a cell (default 0.5s)")
    parser.add_argument("--timeout", default="300s", metavar="TIME",
                        help="limit for one request (default 300s)")
    parser.add_argument("--warmup", type=int, default=1, metavar="N",
                        help="unmeasured requests sent before the first cell (default 1)")
    parser.add_argument("--seed", metavar="TEXT",
                        help="seed of the prompt words (default: random, so a rerun never hits "
                        "the prefix cache left by the previous one)")
    parser.add_argument("--api-key-file", metavar="PATH",
                        help="file holding a bearer token for the server's /v1 endpoints")
    parser.add_argument("--no-plots", action="store_true", help="do not draw the PNG plots")


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except SweepInputError as error:
        print(f"kvwatch sweep: error: {error}", file=sys.stderr)
        return 2
    return Sweep(config).run()
