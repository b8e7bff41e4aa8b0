"""What arrives at the simulated engine: Poisson arrivals, prompt and output
length distributions, shared prefixes (how many distinct ones, which version,
how popular) and the time a RAG application spends before calling the engine.
Parsing collects every problem it finds instead of stopping at the first."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

DIST_KINDS = {
    "constant": ("value",),
    "uniform": ("min", "max"),
    "normal": ("mean", "stddev"),
    "lognormal": ("mean", "sigma"),
    "exponential": ("mean",),
    "choice": ("values",),
}
DIST_OPTIONAL = {"choice": ("weights",)}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class Distribution:
    """A sampled quantity. `min`/`max` clamp every kind but `uniform`, where they
    are the range itself."""

    kind: str
    params: dict[str, Any]
    low: float | None = None
    high: float | None = None
    _cum_weights: list[float] | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, raw: Any, where: str, problems: list[str], minimum: float = 0.0) -> Distribution | None:
        if _is_number(raw):
            if raw < minimum:
                problems.append(f"{where}: must be >= {minimum:g}, got {raw!r}")
                return None
            return cls("constant", {"value": float(raw)})
        if not isinstance(raw, dict):
            problems.append(f"{where}: expected a number or a mapping with 'dist', got {raw!r}")
            return None
        kind = raw.get("dist")
        if kind not in DIST_KINDS:
            problems.append(f"{where}.dist: expected one of {', '.join(DIST_KINDS)}, got {kind!r}")
            return None
        required = DIST_KINDS[kind]
        clamps = () if kind == "uniform" else ("min", "max")
        allowed = {"dist", *required, *clamps, *DIST_OPTIONAL.get(kind, ())}
        start = len(problems)
        for key in raw:
            if key not in allowed:
                problems.append(f"{where}.{key}: unknown key for dist {kind} (expected {', '.join(sorted(allowed))})")
        for key in required:
            if key not in raw:
                problems.append(f"{where}: dist {kind} needs '{key}'")
        params = {key: raw[key] for key in required if key in raw}
        if kind == "choice":
            values = raw.get("values")
            if not isinstance(values, list) or not values or not all(_is_number(v) for v in values):
                problems.append(f"{where}.values: expected a non-empty list of numbers, got {values!r}")
            elif any(v < minimum for v in values):
                problems.append(f"{where}.values: every value must be >= {minimum:g}")
            weights = raw.get("weights")
            if weights is not None and (
                not isinstance(weights, list)
                or not isinstance(values, list)
                or len(weights) != len(values)
                or not all(_is_number(w) and w >= 0 for w in weights)
                or not sum(weights) > 0
            ):
                problems.append(f"{where}.weights: expected one non-negative number per value, not all zero")
            params["weights"] = weights
        else:
            for key in required:
                if key in raw and not _is_number(raw[key]):
                    problems.append(f"{where}.{key}: expected a number, got {raw[key]!r}")
        for key in clamps:
            if key in raw and not _is_number(raw[key]):
                problems.append(f"{where}.{key}: expected a number, got {raw[key]!r}")
        if len(problems) > start:
            return None
        if kind == "uniform" and not params["min"] <= params["max"]:
            problems.append(f"{where}: uniform needs min <= max, got {params['min']!r} > {params['max']!r}")
        if kind == "uniform" and params["min"] < minimum:
            problems.append(f"{where}.min: must be >= {minimum:g}, got {params['min']!r}")
        if kind in ("normal", "lognormal", "exponential") and params["mean"] < 0:
            problems.append(f"{where}.mean: must be >= 0, got {params['mean']!r}")
        if kind == "lognormal" and params["mean"] <= 0:
            problems.append(f"{where}.mean: a lognormal needs mean > 0, got {params['mean']!r}")
        for key in ("stddev", "sigma"):
            if key in params and params[key] < 0:
                problems.append(f"{where}.{key}: must be >= 0, got {params[key]!r}")
        low, high = raw.get("min") if clamps else None, raw.get("max") if clamps else None
        if low is not None and high is not None and low > high:
            problems.append(f"{where}: min {low!r} > max {high!r}")
        if len(problems) > start:
            return None
        dist = cls(kind, params, low, high)
        if kind == "choice" and params.get("weights"):
            total = 0.0
            dist._cum_weights = []
            for weight in params["weights"]:
                total += weight
                dist._cum_weights.append(total)
        return dist

    def sample(self, rng: random.Random) -> float:
        kind = self.kind
        p = self.params
        if kind == "constant":
            value = p["value"]
        elif kind == "uniform":
            return rng.uniform(p["min"], p["max"])
        elif kind == "normal":
            value = rng.gauss(p["mean"], p["stddev"])
        elif kind == "lognormal":
            sigma = p["sigma"]
            value = rng.lognormvariate(math.log(p["mean"]) - sigma * sigma / 2, sigma)
        elif kind == "exponential":
            value = rng.expovariate(1.0 / p["mean"]) if p["mean"] > 0 else 0.0
        else:
            value = rng.choices(p["values"], cum_weights=self._cum_weights)[0]
        if self.low is not None and value < self.low:
            value = self.low
        if self.high is not None and value > self.high:
            value = self.high
        return value

    def describe(self) -> str:
        if self.kind == "constant":
            return f"{self.params['value']:g}"
        inner = ", ".join(f"{k}={v:g}" if _is_number(v) else f"{k}={v}" for k, v in self.params.items() if v is not None)
        return f"{self.kind}({inner})"


@dataclass
class PrefixSpec:
    share: float = 0.0
    tokens: int = 0
    count: int = 1
    version: int = 1
    popularity: str = "uniform"
    zipf_s: float = 1.0
    # Tokens after which every request's prefix differs (a timestamp or request
    # id templated into the system prompt); None: identical across requests.
    varies_after: int | None = None
    _cum_weights: list[float] | None = field(default=None, repr=False)

    def pick(self, rng: random.Random) -> int:
        if self.count == 1:
            return 0
        if self.popularity == "uniform":
            return rng.randrange(self.count)
        if self._cum_weights is None:
            total = 0.0
            self._cum_weights = []
            for rank in range(1, self.count + 1):
                total += 1.0 / rank**self.zipf_s
                self._cum_weights.append(total)
        return rng.choices(range(self.count), cum_weights=self._cum_weights)[0]


@dataclass
class WorkloadSpec:
    rate: float
    prompt_tokens: Distribution
    output_tokens: Distribution
    max_tokens: int | None
    prefix: PrefixSpec
    retrieval_seconds: Distribution | None
    # Two tenants, by whether a request drew a shared prefix: (the tenant of
    # those that did, the tenant of the rest). The simulated engine publishes
    # a request's blocks under its tenant as their LoRA adapter (the one
    # request identity vLLM's KV-cache events carry).
    tenants: tuple[str, str] | None = None


WORKLOAD_KEYS = ("rate", "prompt_tokens", "output_tokens", "max_tokens", "prefix", "retrieval_seconds", "tenants")
TENANT_KEYS = ("shared", "own")
PREFIX_KEYS = ("share", "tokens", "count", "version", "popularity", "zipf_s", "varies_after")


def parse_workload(raw: Any, where: str, problems: list[str]) -> WorkloadSpec | None:
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a mapping, got {raw!r}")
        return None
    start = len(problems)
    for key in raw:
        if key not in WORKLOAD_KEYS:
            problems.append(f"{where}.{key}: unknown key (expected one of {', '.join(WORKLOAD_KEYS)})")
    for key in ("rate", "prompt_tokens", "output_tokens"):
        if key not in raw:
            problems.append(f"{where}: missing '{key}'")
    rate = raw.get("rate", 0.0)
    if not _is_number(rate) or rate < 0:
        problems.append(f"{where}.rate: must be a number of requests per second >= 0, got {rate!r}")
    prompt = Distribution.parse(raw["prompt_tokens"], f"{where}.prompt_tokens", problems, minimum=0) if "prompt_tokens" in raw else None
    output = Distribution.parse(raw["output_tokens"], f"{where}.output_tokens", problems, minimum=1) if "output_tokens" in raw else None
    max_tokens = raw.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        problems.append(f"{where}.max_tokens: must be a positive integer or null, got {max_tokens!r}")
    retrieval = None
    if raw.get("retrieval_seconds") is not None:
        retrieval = Distribution.parse(raw["retrieval_seconds"], f"{where}.retrieval_seconds", problems, minimum=0)
    prefix = PrefixSpec()
    raw_prefix = raw.get("prefix") or {}
    if not isinstance(raw_prefix, dict):
        problems.append(f"{where}.prefix: expected a mapping, got {raw_prefix!r}")
    else:
        for key in raw_prefix:
            if key not in PREFIX_KEYS:
                problems.append(f"{where}.prefix.{key}: unknown key (expected one of {', '.join(PREFIX_KEYS)})")
        share = raw_prefix.get("share", 0.0)
        if not _is_number(share) or not 0 <= share <= 1:
            problems.append(f"{where}.prefix.share: must be between 0 and 1, got {share!r}")
        for key, low in (("tokens", 0), ("count", 1), ("version", 0)):
            value = raw_prefix.get(key, getattr(prefix, key))
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                problems.append(f"{where}.prefix.{key}: must be an integer >= {low}, got {value!r}")
        popularity = raw_prefix.get("popularity", "uniform")
        if popularity not in ("uniform", "zipf"):
            problems.append(f"{where}.prefix.popularity: expected uniform or zipf, got {popularity!r}")
        zipf_s = raw_prefix.get("zipf_s", 1.0)
        if not _is_number(zipf_s) or zipf_s <= 0:
            problems.append(f"{where}.prefix.zipf_s: must be a number > 0, got {zipf_s!r}")
        varies_after = raw_prefix.get("varies_after")
        if varies_after is not None and (not isinstance(varies_after, int) or isinstance(varies_after, bool) or varies_after < 0):
            problems.append(f"{where}.prefix.varies_after: must be an integer >= 0 or null, got {varies_after!r}")
        if _is_number(share) and share > 0 and raw_prefix.get("tokens", 0) == 0:
            problems.append(f"{where}.prefix: share > 0 needs tokens > 0")
        if len(problems) == start:
            prefix = PrefixSpec(
                share=float(share),
                tokens=raw_prefix.get("tokens", 0),
                count=raw_prefix.get("count", 1),
                version=raw_prefix.get("version", 1),
                popularity=popularity,
                zipf_s=float(zipf_s),
                varies_after=varies_after,
            )
    tenants = _tenants(raw.get("tenants"), f"{where}.tenants", problems)
    if len(problems) > start or prompt is None or output is None:
        return None
    return WorkloadSpec(float(rate), prompt, output, max_tokens, prefix, retrieval, tenants)


def _tenants(raw: Any, where: str, problems: list[str]) -> tuple[str, str] | None:
    """`tenants: {shared: NAME, own: NAME}`: who sends the requests with a shared prefix, and the rest."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != set(TENANT_KEYS):
        problems.append(f"{where}: expected a mapping of exactly {' and '.join(TENANT_KEYS)}, got {raw!r}")
        return None
    names = [raw[key] for key in TENANT_KEYS]
    if not all(isinstance(name, str) and 0 < len(name) <= 64 for name in names) or names[0] == names[1]:
        problems.append(f"{where}: the two tenants need distinct names of 1 to 64 characters, got {raw!r}")
        return None
    return names[0], names[1]


@dataclass
class DrawnRequest:
    """One sampled request: its lengths and which shared prefix it starts with."""

    prompt_len: int
    max_tokens: int
    output_len: int
    prefix_key: tuple | None
    prefix_len: int
    retrieval_seconds: float
    shared_len: int = 0  # leading prompt tokens identical to other requests of the same prefix
    tenant: str | None = None


def draw_request(spec: WorkloadSpec, rng: random.Random, max_model_len: int) -> DrawnRequest:
    prefix = spec.prefix
    prefix_key = None
    prefix_len = 0
    if prefix.share > 0 and rng.random() < prefix.share:
        prefix_len = prefix.tokens
        prefix_key = ("prefix", prefix.pick(rng), prefix.version)
    unique = max(0, int(round(spec.prompt_tokens.sample(rng))))
    output = max(1, int(round(spec.output_tokens.sample(rng))))
    max_tokens = spec.max_tokens if spec.max_tokens is not None else output
    output = min(output, max_tokens)
    # Fit the context window the way a client would: a completion budget that
    # alone overflows is cut, then the request's own text, then the prefix.
    max_tokens = min(max_tokens, max_model_len - 1)
    output = min(output, max_tokens)
    prompt_len = max(1, prefix_len + unique)
    room = max_model_len - max_tokens
    if prompt_len > room:
        prompt_len = room
        prefix_len = min(prefix_len, room)
    retrieval = spec.retrieval_seconds.sample(rng) if spec.retrieval_seconds is not None else 0.0
    shared_len = prefix_len if prefix.varies_after is None else min(prefix_len, prefix.varies_after)
    tenant = spec.tenants[0 if prefix_key is not None else 1] if spec.tenants else None
    return DrawnRequest(prompt_len, max_tokens, output, prefix_key, prefix_len, retrieval, shared_len, tenant)


def symbolic_block_hashes(uid: int, drawn: DrawnRequest, block_size: int) -> list:
    """Hashes of the prompt's full blocks: blocks wholly inside the shared prefix
    are named by (prefix, version, block index), so they match across requests;
    any block holding the request's own tokens is unique to it."""
    hashes: list = []
    shared_blocks = drawn.shared_len // block_size if drawn.prefix_key is not None else 0
    for index in range(drawn.prompt_len // block_size):
        hashes.append((drawn.prefix_key, index) if index < shared_blocks else (uid, index))
    return hashes


def token_block_hashes(tokens: list, block_size: int) -> list:
    """Chained hashes of the full blocks of a real token sequence: block i's hash
    covers tokens [0, (i+1)*block_size), so equal hashes mean equal prefixes."""
    hashes: list = []
    previous: int | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = hash((previous, tuple(tokens[start : start + block_size])))
        hashes.append(("tokens", previous))
    return hashes
