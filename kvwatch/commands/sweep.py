"""`kvwatch sweep`: measure a running OpenAI-compatible server across a grid
of prompt lengths x output lengths x concurrency levels (kvwatch/sweep/), or
compare two sweeps' results (`--compare BEFORE AFTER`)."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

from kvwatch.capacity import arithmetic as cap
from kvwatch.present import printable
from kvwatch.sweep.config import SweepInputError, build_config

# Needed to measure, not to compare: checked in run() so --compare can go without them.
REQUIRED = ("--base-url", "--model", "--input-tokens", "--output-tokens", "--concurrency")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", metavar="URL",
                        help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    parser.add_argument("--metrics-url", metavar="URL",
                        help="its Prometheus metrics (default: BASE-URL/metrics)")
    parser.add_argument("--model", metavar="NAME",
                        help="the served model name sent with every request")
    parser.add_argument("--input-tokens", metavar="N,N,...",
                        help="prompt lengths in tokens, e.g. 128,512")
    parser.add_argument("--output-tokens", metavar="N,N,...",
                        help="generated tokens per request (max_tokens, sent with ignore_eos), "
                        "e.g. 64,256")
    parser.add_argument("--concurrency", metavar="N,N,...",
                        help="requests kept in flight, e.g. 1,4,16")
    amount = parser.add_mutually_exclusive_group()
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
    parser.add_argument("--idle-wait", default="60s", metavar="TIME",
                        help="how long a cell waits for other traffic to leave the server before it starts "
                             "anyway, with a note (default 60s)")
    parser.add_argument("--warmup", type=int, default=1, metavar="N",
                        help="unmeasured requests sent before the first cell (default 1)")
    parser.add_argument("--seed", metavar="TEXT",
                        help="seed of the prompt words (default: random, so a rerun never hits "
                        "the prefix cache left by the previous one)")
    parser.add_argument("--api-key-file", metavar="PATH",
                        help="file holding a bearer token for the server's /v1 endpoints")
    parser.add_argument("--no-plots", action="store_true", help="do not draw the PNG plots")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="compare two sweep result folders instead of measuring: what changed "
                        "between them, the quality probe, then cell by cell")
    parser.add_argument("--baseline", metavar="DIR",
                        help="an earlier sweep to compare this one with when it ends (its prompts "
                        "are repeated: same seed and recipe, unless --seed)")
    parser.add_argument("--force", action="store_true",
                        help="compare cells whose conditions differ (another model, load per cell, "
                        "prompt length, other traffic) instead of refusing them")
    parser.set_defaults(sweep_parser=parser)


def run(args: argparse.Namespace) -> int:
    parser = getattr(args, "sweep_parser", None)
    if args.compare:
        if args.baseline:
            return _usage(parser, "--compare and --baseline cannot go together: --compare reads "
                          "two finished sweeps, --baseline runs a new one")
        return _compare(args)
    missing = [flag for flag in REQUIRED if getattr(args, flag[2:].replace("-", "_")) is None]
    if missing:
        return _usage(parser, "the following arguments are required: " + ", ".join(missing))
    if args.requests is None and args.duration is None:
        return _usage(parser, "one of the arguments --requests --duration is required")
    from kvwatch.sweep.run import Sweep

    try:
        config = build_config(args)
    except SweepInputError as error:
        print(f"kvwatch sweep: error: {error}", file=sys.stderr)
        return 2
    return Sweep(config).run()


def _usage(parser: argparse.ArgumentParser | None, message: str) -> int:
    if parser is not None:
        parser.error(message)  # exits with status 2, as argparse does
    print(f"kvwatch sweep: error: {message}", file=sys.stderr)
    return 2


def _compare(args: argparse.Namespace) -> int:
    from kvwatch.sweep.compare import (CompareInputError, compare, load_sweep, render_markdown,
                                       write_comparison)

    before_dir, after_dir = args.compare
    try:
        before, after = load_sweep(before_dir), load_sweep(after_dir)
    except CompareInputError as error:
        print(f"kvwatch sweep: error: --compare: {error}", file=sys.stderr)
        return 2
    out_dir = Path(args.out) if args.out else Path(
        f"kvwatch-compare-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    try:
        result = compare(before, after, force=args.force, names=(str(before_dir), str(after_dir)))
        markdown = render_markdown(result)
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RecursionError) as error:
        # A sweep.json of the shape load_sweep checks, with a value of another
        # type deeper in (a crafted or hand-edited folder): one sentence.
        print(f"kvwatch sweep: error: --compare: {before_dir} or {after_dir} holds a value kvwatch sweep "
              f"does not write ({type(error).__name__}: {str(error)[:120]})", file=sys.stderr)
        return 2
    try:
        written = write_comparison(out_dir, result, plots=not args.no_plots)
    except OSError as error:
        print(f"kvwatch sweep: error: --out: {error}", file=sys.stderr)
        return 2
    except (TypeError, ValueError, OverflowError) as error:  # a plot of values no axis holds
        print(f"kvwatch sweep: error: --compare: the plots could not be drawn ({str(error)[:120]})",
              file=sys.stderr)
        return 2
    print(printable(markdown, keep_lines=True), end="")  # the compared folders' text: escapes written out
    print(f"kvwatch sweep: wrote {', '.join(written)} in {out_dir}", file=sys.stderr)
    refused = len(result["cells"]["refused"])
    if refused:
        print(f"kvwatch sweep: {refused} cell(s) refused: their conditions differ (--force "
              "compares them anyway)", file=sys.stderr)
        return 1
    return 0
