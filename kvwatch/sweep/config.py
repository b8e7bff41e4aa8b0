"""The sweep's inputs: the grid, the server, the model, read and checked
before anything is sent (every problem is a SweepInputError, exit status 2)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kvwatch.capacity import arithmetic as cap
from kvwatch.capacity.model_config import load_model_config
from kvwatch.units import parse_duration
from kvwatch.sweep.client import split_base_url
from kvwatch.sweep.compare import CompareInputError, load_sweep

DEFAULT_BLOCK_SIZE = 16  # vLLM's GPU default, when the server does not say
MAX_GRID_CELLS = 10_000


class SweepInputError(ValueError):
    """An input the sweep cannot use; exit status 2."""


class SweepRunError(RuntimeError):
    """The server could not be measured; exit status 1."""




def _int_list(flag: str, text: str, minimum: int) -> list[int]:
    values: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise SweepInputError(f"{flag}: {part!r} is not a whole number "
                                  f"(give a comma-separated list such as 1,4,16)") from None
        if value < minimum:
            raise SweepInputError(f"{flag}: {value} is below the minimum of {minimum}")
        if value not in values:
            values.append(value)
    if not values:
        raise SweepInputError(f"{flag}: give at least one value")
    return values


def _duration(flag: str, text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as error:
        raise SweepInputError(f"{flag}: {error}") from None


@dataclass
class SweepConfig:
    base_url: str
    metrics_url: str
    model: str
    input_tokens: list[int]
    output_tokens: list[int]
    concurrency: list[int]
    requests: int | None
    duration: float | None
    out_dir: Path
    poll_interval: float
    timeout: float
    warmup: int
    seed: str
    model_config: dict[str, Any] | None
    model_config_path: str | None
    kv_dtype: str
    kv_budget: int | None
    api_key: str | None
    plots: bool
    # How long a cell waits for the server to go idle before it starts anyway
    # (with a note); apart from the per-request timeout.
    idle_wait: float = 60.0
    # --baseline: the earlier sweep this one is compared with, whose prompts it repeats.
    baseline_dir: Path | None = None
    baseline: dict[str, Any] | None = None
    force: bool = False

    @property
    def cells(self) -> list[tuple[int, int, int]]:
        return [(inp, out, conc) for inp in self.input_tokens for out in self.output_tokens
                for conc in self.concurrency]

    def to_dict(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url, "metrics_url": self.metrics_url, "model": self.model,
            "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
            "concurrency": self.concurrency, "requests": self.requests,
            "duration_s": self.duration, "poll_interval_s": self.poll_interval,
            "timeout_s": self.timeout, "warmup": self.warmup, "seed": self.seed,
            "model_config": self.model_config_path, "kv_dtype": self.kv_dtype,
            "kv_budget_bytes": self.kv_budget, "out_dir": str(self.out_dir),
            "baseline": str(self.baseline_dir) if self.baseline_dir else None,
        }

    @property
    def prompt_recipe(self) -> dict[str, Any] | None:
        """The baseline's prompt recipe, when this sweep repeats its prompts."""
        if self.baseline is None or self.seed != self.baseline["config"].get("seed"):
            return None
        recipe = self.baseline["server"].get("prompt_recipe")
        return recipe if isinstance(recipe, dict) else None


def _load_model_config(path_text: str) -> dict[str, Any]:
    try:
        return load_model_config(path_text)
    except cap.CapacityInputError as error:
        raise SweepInputError(f"--model-config: {error}") from None


def build_config(args: argparse.Namespace) -> SweepConfig:
    """Check every flag before any network traffic."""
    try:
        scheme, host, port, prefix = split_base_url(args.base_url)
    except ValueError as error:
        raise SweepInputError(f"--base-url: {error}") from None
    netloc = f"[{host}]" if ":" in host else host
    base_url = f"{scheme}://{netloc}:{port}{prefix}"
    metrics_url = args.metrics_url or f"{base_url}/metrics"
    try:
        split_base_url(metrics_url)
    except ValueError as error:
        raise SweepInputError(f"--metrics-url: {error}") from None
    if not args.model.strip():
        raise SweepInputError("--model: give the served model name")
    inputs = _int_list("--input-tokens", args.input_tokens, 1)
    outputs = _int_list("--output-tokens", args.output_tokens, 1)
    levels = sorted(_int_list("--concurrency", args.concurrency, 1))
    if args.requests is not None and args.requests < 1:
        raise SweepInputError(f"--requests must be at least 1, got {args.requests}")
    duration = _duration("--duration", args.duration) if args.duration is not None else None
    poll_interval = _duration("--poll-interval", args.poll_interval)
    timeout = _duration("--timeout", args.timeout)
    idle_wait = _duration("--idle-wait", getattr(args, "idle_wait", None) or "60s")
    if args.warmup < 0:
        raise SweepInputError(f"--warmup cannot be negative, got {args.warmup}")
    if len(inputs) * len(outputs) * len(levels) > MAX_GRID_CELLS:
        raise SweepInputError(f"the grid has more than {MAX_GRID_CELLS} cells; make it smaller")
    kv_dtype = args.kv_dtype.lower()
    if kv_dtype not in cap.KV_DTYPE_CHOICES:
        raise SweepInputError(f"--kv-dtype {args.kv_dtype!r} is not one of "
                              + ", ".join(cap.KV_DTYPE_CHOICES))
    model_config = _load_model_config(args.model_config) if args.model_config else None
    if model_config is None and (args.kv_budget or kv_dtype != "auto"):
        raise SweepInputError("--kv-budget and --kv-dtype size the bound computed from "
                              "--model-config; give --model-config too")
    kv_budget = None
    if args.kv_budget:
        try:
            kv_budget = cap.parse_size(args.kv_budget)
        except cap.CapacityInputError as error:
            raise SweepInputError(f"--kv-budget: {error}") from None
    api_key = None
    if args.api_key_file:
        try:
            api_key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except OSError as error:
            raise SweepInputError(f"--api-key-file: {error}") from None
    baseline_dir = baseline = None
    if getattr(args, "baseline", None):
        baseline_dir = Path(args.baseline)
        try:
            baseline = load_sweep(baseline_dir)
        except CompareInputError as error:
            raise SweepInputError(f"--baseline: {error}") from None
    seed = args.seed or (str(baseline["config"].get("seed") or "") if baseline else "") \
        or os.urandom(6).hex()
    out_dir = Path(args.out) if args.out else Path(
        f"kvwatch-sweep-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    if out_dir.exists() and not out_dir.is_dir():
        raise SweepInputError(f"--out: {out_dir} exists and is not a folder")
    return SweepConfig(
        base_url=base_url, metrics_url=metrics_url, model=args.model.strip(),
        input_tokens=inputs, output_tokens=outputs, concurrency=levels, requests=args.requests,
        duration=duration, out_dir=out_dir, poll_interval=poll_interval, timeout=timeout,
        warmup=args.warmup, seed=seed, model_config=model_config,
        model_config_path=args.model_config, kv_dtype=kv_dtype, kv_budget=kv_budget,
        api_key=api_key, plots=not args.no_plots, baseline_dir=baseline_dir, baseline=baseline,
        force=bool(getattr(args, "force", False)), idle_wait=idle_wait)
