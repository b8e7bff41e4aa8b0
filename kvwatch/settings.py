"""Configuration: defaults, then a YAML file, then `KVWATCH_*` environment
variables, then command-line flags; the later wins. Every problem is collected
and reported at once, so a bad config is fixed in one round trip.

Each setting is declared once, as a field of Settings whose metadata
(`setting(...)`) holds its parser and its help: the YAML key is the field's
name, the environment variable KVWATCH_ + its name, the flag --its-name;
`kvwatch serve`'s flags and their --help, and docs/configuration.md
(kvwatch/mixin/settings_doc.py), are made from these declarations."""

from __future__ import annotations

import math
import os
import ssl
from dataclasses import dataclass, field, fields
from pathlib import Path
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from kvwatch.diagnose import validate_thresholds
from kvwatch.engines import AUTO, ENGINES
from kvwatch.kvevents.endpoint import ipc_path_problem
from kvwatch.present import normalize_target
from kvwatch.units import (
    did_you_mean,
    parse_duration,
    parse_port,
    parse_size,
    parse_whole_number,
    read_small_file,
    yaml_problem,
)


class SettingsError(Exception):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


# The default fetch deadline (or 80 % of a longer interval): above the 12 s a
# busy vLLM took to answer, like Prometheus's own default scrape_timeout (10 s).
DEFAULT_FETCH_DEADLINE_S = 15.0


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean (true/false)")


def _duration_or_zero(value: Any) -> float:
    """A duration, or 0 (0, 0s, 0m ...) for none."""
    text = str(value).strip()
    if not isinstance(value, bool) and (value == 0 or (text[:1] == "0" and text.rstrip("hms").strip("0.") == "")):
        return 0.0
    return parse_duration(value)


_whole_number = parse_whole_number  # one definition: kvwatch/units.py
_parse_port = parse_port


def _demo_url(value: Any) -> str:
    """A simulator's base URL or its /sim/phase: a bare http://host:port gets /sim/phase."""
    text = str(value).strip()
    parts = urlsplit(text)
    if parts.scheme in ("http", "https") and parts.path in ("", "/"):
        text = urlunsplit((parts.scheme, parts.netloc, "/sim/phase", parts.query, ""))
    return normalize_target(text)


def zmq_endpoint(value: Any) -> str:
    """A ZMQ endpoint kvwatch can bind or connect: tcp://host:port or
    ipc://path."""
    text = str(value).strip()
    if text.startswith("ipc://") and len(text) > len("ipc://"):
        problem = ipc_path_problem(text)
        if problem:
            raise ValueError(problem)
        return text
    if text.startswith("tcp://"):
        host, _, port = text[len("tcp://"):].rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return text
        raise ValueError(f"{text!r} has no host and port (tcp://127.0.0.1:5557)")
    raise ValueError(f"{text!r} is not a ZMQ endpoint (tcp://host:port or ipc://path)")


def _optional_str(value: Any) -> str | None:
    return None if value in (None, "") else str(value)


# A CA bundle, certificate or key is read whole by the TLS library (a CA
# bundle at every new connection to the engine): a regular file (a FIFO
# blocked, a device never ended) of at most this many bytes (the system's
# whole CA bundle is about 220 KB).
MAX_PEM_BYTES = 16 * 1024 * 1024


def _existing_file(value: Any) -> str | None:
    if value in (None, ""):
        return None
    path = Path(str(value))
    if not path.is_file():
        raise ValueError(f"file {value!r} does not exist" if not path.exists() else
                         f"{value!r} is not a regular file")
    if path.stat().st_size > MAX_PEM_BYTES:
        raise ValueError(f"file {value!r} is larger than the {MAX_PEM_BYTES:,} bytes kvwatch reads of it")
    return str(value)


# What kvwatch reads of its own configuration files (bounded like every
# other input: a config or token path naming a FIFO or a device blocked or
# never ended).
MAX_CONFIG_BYTES = 1024 * 1024
MAX_TOKEN_BYTES = 64 * 1024


def read_auth_token(path: str) -> str:
    """The bearer token kvwatch's own endpoints require, from its file: one
    token in UTF-8, surrounding whitespace (a trailing newline) removed.
    An empty file would turn authentication off without a word, so it is an
    error, as is a token with whitespace or control characters inside, which
    no Authorization header could carry."""
    try:
        text = read_small_file(path, MAX_TOKEN_BYTES).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"file {path!r} is not UTF-8 (byte {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"file {path!r}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"file {path!r}: {exc}") from None
    token = text.strip()
    if not token:
        raise ValueError(f"file {path!r} holds no token (it is empty or only whitespace)")
    if any(char.isspace() or not char.isprintable() for char in token):
        raise ValueError(f"file {path!r} must hold one token on one line, without whitespace or control characters")
    return token


def _auth_token_file(value: Any) -> str | None:
    path = _existing_file(value)
    if path is not None:
        read_auth_token(path)
    return path


def _log_level(value: Any) -> str:
    text = str(value).lower()
    if text not in ("debug", "info", "warning", "error", "critical"):
        raise ValueError(f"{value!r} is not a log level (debug, info, warning, error, critical)")
    return text


def _mapping(value: Any) -> dict:
    if not isinstance(value, dict):
        raise ValueError("must be a mapping")
    return dict(value)


def _engine(value: Any) -> str:
    text = str(value).strip().lower()
    if text != AUTO and text not in ENGINES:
        raise ValueError(f"{value!r} is not an engine ({', '.join((AUTO, *ENGINES))})")
    return text


def _positive_int(value: Any) -> int:
    number = _whole_number(value)
    if number <= 0:
        raise ValueError(f"{value!r} must be a positive integer")
    return number


def _price(value: Any) -> float:
    try:
        number = float(str(value).strip())
    except ValueError:
        raise ValueError(f"{value!r} is not a number (a price per GPU-hour, e.g. 2.5)") from None
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{value!r} must be a positive price per GPU-hour")
    return number


def _optional(parse):
    """`parse`, with None and "" read as unset."""
    return lambda value: None if value in (None, "") else parse(value)


def setting(parse, help: str, *, flag: bool = True, env: bool = True, default_rule: str | None = None,
            doc: str = "") -> dict:
    """A setting's declaration, the metadata of its field in Settings: the
    one place its parser and its words are written. `parse` reads a value
    from the YAML file, the environment and the flag alike (ValueError says
    what is wrong); `help` is its line in `kvwatch serve --help` and in
    docs/configuration.md (which adds `doc`); `flag` and `env` say whether
    it is also `--key-name` and `KVWATCH_KEY` (every setting is a YAML key);
    `default_rule` states a default that is a rule rather than a value."""
    return {"parse": parse, "help": help, "flag": flag, "env": env, "default_rule": default_rule, "doc": doc}


@dataclass
class Settings:
    # The engine's /metrics. A bare http://host:port gets /metrics appended.
    target: str = field(default="http://127.0.0.1:8000/metrics", metadata=setting(
        normalize_target, "the engine's /metrics URL (a bare http://host:port gets /metrics)"))
    # Loopback by default: exposing the sidecar is a decision, not an accident.
    # The container image sets 0.0.0.0 explicitly.
    host: str = field(default="127.0.0.1", metadata=setting(
        str, "address to listen on", doc="the container image sets `0.0.0.0`"))
    port: int = field(default=9400, metadata=setting(_parse_port, "port to listen on"))
    # One poll per interval whatever scrapes kvwatch; 5 s matches vLLM's own
    # example scrape interval and costs well under 1 % of a core.
    poll_interval: float = field(default=5.0, metadata=setting(
        parse_duration, "time between polls, e.g. 5s or 1m", doc="one poll per interval, whatever scrapes kvwatch"))
    # Fetch deadline. Polls never overlap whatever it is (the loop waits for
    # a poll to finish; a late page delays the next poll and skips the slots
    # it missed), so it is not tied to the interval: a real vLLM 0.32 under
    # load answered /metrics 1.5-3.8 s late at times and once 12 s late, and
    # a deadline of 80 % of a 1 s interval dropped exactly the pages of the
    # load. A late page is still a page: it is read, stamped at the time it
    # was answered and its lateness exported (kvwatch_page_late_seconds).
    timeout: float | None = field(default=None, metadata=setting(
        parse_duration, "fetch deadline, e.g. 4s",
        default_rule="15s, or 80% of a longer poll interval (a late page is kept)",
        doc="polls never overlap: a late page delays the next poll and is kept, stamped when answered "
            "(`kvwatch_page_late_seconds`); at most half the window"))
    # A native sidecar starts before vLLM, which answers nothing while it loads its weights (minutes from
    # network storage): until the engine first answers, or this long, it is starting, not down.
    load_grace: float = field(default=1800.0, metadata=setting(
        _duration_or_zero, "how long after kvwatch starts an engine that has not answered yet is loading, not down, "
        "e.g. 30m (0: no grace)", doc="`kvwatch_starting` is 1 meanwhile and KvwatchEngineUnreachable waits; an engine "
        "that answered once is down as soon as it stops"))
    # Signals are computed over this span; 5 m matches rate(...[5m]) in the rules.
    window: float = field(default=300.0, metadata=setting(
        parse_duration, "span of the windowed signals, e.g. 5m", doc="at least two poll intervals"))
    # A real vLLM page is 50-300 KB (64 engines write 2.2 MB); 8 MiB is far
    # above any sane page and bounds memory against a runaway or hostile
    # target. The pod's memory limit is derived from the peak the worst page
    # under this cap costs (kvwatch/mixin/config.py, measured by `make bench`):
    # change one, measure and change the other.
    max_body_bytes: int = field(default=8 * 1024 * 1024, metadata=setting(
        parse_size, "cap on the engine's page size, e.g. 8MiB"))
    # Most (model, engine) pairs kept per poll; the rest are dropped and counted.
    max_series: int = field(default=1000, metadata=setting(_positive_int, "most (model, engine) pairs kept per poll"))
    bearer_token_file: str | None = field(default=None, metadata=setting(
        _existing_file, "file holding a bearer token for the engine", doc="re-read each poll"))
    ca_bundle: str | None = field(default=None, metadata=setting(
        _existing_file, "CA bundle to verify the engine's TLS certificate"))
    tls_verify: bool = field(default=True, metadata=setting(
        _parse_bool, "verify the engine's TLS certificate: true or false"))
    log_level: str = field(default="info", metadata=setting(_log_level, "debug, info, warning or error"))
    # Optional second source for the slow-first-token diagnosis: a gateway's or
    # application's /metrics and the histogram there that measures time spent
    # before the engine (e.g. retrieval).
    upstream_target: str | None = field(default=None, metadata=setting(
        _optional(normalize_target), "a gateway's or application's /metrics (second source for TTFT diagnosis)",
        doc="given together with upstream_histogram"))
    upstream_histogram: str | None = field(default=None, metadata=setting(
        _optional_str, "the histogram there that measures time before the engine, e.g. app_retrieval_seconds"))
    # Optional LMCache page (kvwatch/pipeline/lmcache.py): the engine's own
    # /metrics when LMCache shares vLLM's registry, or LMCache's API server.
    lmcache_target: str | None = field(default=None, metadata=setting(
        _optional(normalize_target),
        "LMCache's /metrics (the engine's own when LMCache shares its registry): a KV tier read beside the engine",
        doc="[engines.md](engines.md#lmcache-tier)"))
    # Optional router page (kvwatch/pipeline/router.py): llm-d's endpoint
    # picker, Dynamo's KV router or SGLang's gateway, read beside the engines.
    router_target: str | None = field(default=None, metadata=setting(
        _optional(normalize_target),
        "a router's /metrics (llm-d's endpoint picker, Dynamo's KV router, SGLang's gateway): its predicted "
        "prefix reuse is judged against what the engines delivered", doc="[diagnosis.md](diagnosis.md#routing-the-routers-prediction-against-the-engines-delivery)"))
    router_model: str | None = field(default=None, metadata=setting(
        _optional_str, "the model the router's predictions are for; unset, every model the engines serve"))
    router_refresh_interval: float | None = field(default=None, metadata=setting(
        _optional(parse_duration), "how often the router polls its replicas' metrics, as configured in the router",
        doc="with router_staleness_bound: a poll slower than the bound is stale_router_metrics"))
    router_staleness_bound: float | None = field(default=None, metadata=setting(
        _optional(parse_duration), "the router's staleness bound on its replicas' metrics, as configured there"))
    tenant_top_k: int = field(default=10, metadata=setting(
        _whole_number, "tenants exported by name per kind (fairness_id, cache_salt, LoRA); the rest summed as other"))
    # A `kvwatch sim`'s /sim/phase (make run sets it): the status page then
    # names the simulated phase now and the next. Nothing else reads it.
    demo_target: str | None = field(default=None, metadata=setting(
        _optional(_demo_url),
        "a kvwatch sim's /sim/phase (make run sets it): the status page names the simulated phase now and the next"))
    # Optional KV-cache event stream (kvwatch/kvevents): the ZMQ endpoint
    # kvwatch binds (the engine, pointed at it with --kv-events-config,
    # connects), or connects to with kv_events_connect (a publisher that binds
    # a wildcard, tcp://*:N). The topic filters by prefix ("" takes every topic).
    kv_events: str | None = field(default=None, metadata=setting(
        _optional(zmq_endpoint),
        "the engine's KV-cache events: a ZMQ endpoint kvwatch binds for vLLM's --kv-events-config "
        "publisher to connect to, e.g. tcp://127.0.0.1:5557",
        doc="blocks evicted before reuse, never reused or whose prefix changed are told apart block by block, "
            "and the extra cache that would have kept them is estimated ([kv-events.md](kv-events.md))"))
    kv_events_connect: bool = field(default=False, metadata=setting(
        _parse_bool, "connect to kv_events instead of binding it (a publisher that binds tcp://*:N): true or false"))
    kv_events_topic: str = field(default="", metadata=setting(
        lambda v: "" if v is None else str(v), "the events' topic prefix kvwatch subscribes to (empty: every topic)"))
    # The engine's replay socket (vLLM's replay_endpoint, which it binds):
    # kvwatch connects and asks for what a sequence gap lost.
    kv_events_replay: str | None = field(default=None, metadata=setting(
        _optional(zmq_endpoint),
        "the engine's replay endpoint (vLLM's replay_endpoint, e.g. tcp://127.0.0.1:5558): kvwatch "
        "asks it for the messages a sequence gap lost"))
    # The block ledger's memory (about 110 bytes a tracked block): past it
    # the ledger samples the hash space (kvwatch/kvevents/ledger.py).
    kv_events_table_bytes: int = field(default=32 * 1024 * 1024, metadata=setting(
        parse_size, "memory for tracked blocks (about 110 B each); past it the hash space is sampled"))
    # What the cache is worth is in the engine's own prefill seconds first; a
    # price turns those GPU-seconds into money (kvwatch/signals/worth.py).
    gpu_hour_price: float | None = field(default=None, metadata=setting(
        _optional(_price), "a price per GPU-hour, to show what the cache saves, loses and would buy in money beside "
        "its GPU-seconds, e.g. 2.5", doc="in your currency; the figures are the engine's prefill request-seconds, "
        "not a bill"))
    # Protect kvwatch's own endpoints (/healthz and /readyz stay open for probes).
    auth_token_file: str | None = field(default=None, metadata=setting(
        _auth_token_file, "require this bearer token on kvwatch's endpoints (not /healthz, /readyz)",
        doc="one token on one line"))
    tls_cert_file: str | None = field(default=None, metadata=setting(
        _existing_file, "serve kvwatch over TLS with this certificate", doc="given together with tls_key_file"))
    tls_key_file: str | None = field(default=None, metadata=setting(_existing_file, "and this key"))
    # Diagnosis thresholds (see kvwatch/diagnose/thresholds.py for every key and default).
    diagnosis: dict[str, Any] = field(default_factory=dict, metadata=setting(
        _mapping, "diagnosis thresholds, a mapping of threshold: value", flag=False, env=False,
        default_rule="each threshold's own",
        doc="`kvwatch/diagnose/thresholds.py` lists each key, its default and why"))
    # The engine whose page the target serves (kvwatch/engines): `auto` picks
    # it from the first page with engine metrics; a name pins it.
    engine: str = field(default="auto", metadata=setting(
        _engine, "the engine serving the target: auto (from its first page), vllm, sglang, llamacpp or trtllm",
        doc="[engines.md](engines.md)"))

    @property
    def fetch_timeout(self) -> float:
        if self.timeout is not None:
            return self.timeout
        return min(max(DEFAULT_FETCH_DEADLINE_S, 0.8 * self.poll_interval), self.window / 2)


# Each setting's declaration (setting() above), in Settings' order.
DECLARED = {f.name: f.metadata for f in fields(Settings)}
# key -> parser, for the file, the environment and the flags alike.
PARSERS = {key: meta["parse"] for key, meta in DECLARED.items()}
# Defaults that are not a value but a rule, as `--help` states them.
DEFAULT_RULES = {key: meta["default_rule"] for key, meta in DECLARED.items() if meta["default_rule"]}
# The settings that are also a flag of `kvwatch serve` and a KVWATCH_* variable.
FLAGS = [key for key, meta in DECLARED.items() if meta["flag"]]
ENV_KEYS = [key for key, meta in DECLARED.items() if meta["env"]]


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def flag_help(key: str, note: str = "") -> str:
    """A setting's flag help, one way for every command that takes it: its
    declared help (and a command's `note`), its default and its variable,
    escaped for argparse (which formats help with %)."""
    text = DECLARED[key]["help"] + (f", {note}" if note else "")
    return f"{text} (default: {default_text(key)}; env {env_name(key)})".replace("%", "%%")


def default_text(key: str) -> str:
    """A setting's default as a person writes it back (each parser reads its
    own output): durations as 5s or 5m, sizes in binary units, booleans as
    true/false, an unset one as `none`."""
    if key in DEFAULT_RULES:
        return DEFAULT_RULES[key]
    value: Any = next(f for f in fields(Settings) if f.name == key).default
    parser = PARSERS[key]
    if value is None:
        return "none"
    if parser is parse_duration:
        return f"{value / 60:g}m" if value >= 60 and value % 60 == 0 else f"{value:g}s"
    if parser is parse_size:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value >= size and value % size == 0:
                return f"{value // size}{unit}"
        return f"{value}B"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)

ENV_PREFIX = "KVWATCH_"


def env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def load_settings(
    config_file: str | None = None,
    overrides: dict[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build Settings from file, environment and flag overrides (None values in
    overrides mean "not given"). Raises SettingsError listing every problem."""
    if environ is None:
        environ = os.environ
    problems: list[str] = []
    # Each setting's raw value and where it came from; a later source wins.
    raw: dict[str, tuple[Any, str]] = {}
    config_file = config_file or environ.get(env_name("config"))
    if config_file:
        raw.update(_from_config_file(config_file, problems))
    raw.update(_from_environment(environ))
    raw.update({key: (value, flag_name(key)) for key, value in (overrides or {}).items() if value is not None})
    values: dict[str, Any] = {}
    for key, (value, origin) in raw.items():
        try:
            values[key] = PARSERS[key](value)
        except (ValueError, TypeError) as exc:
            problems.append(f"{origin}: {exc}")
    settings = Settings(**values)
    problems.extend(_combination_problems(settings, values))
    if problems:
        raise SettingsError(problems)
    return settings


def _read_config_file(config_file: str, problems: list[str]) -> dict:
    """The file's mapping of settings ({} with a problem said when it cannot be read as one)."""
    try:
        loaded = yaml.safe_load(read_small_file(config_file, MAX_CONFIG_BYTES).decode("utf-8")) or {}
    except OSError as exc:
        problems.append(f"config file {config_file}: {exc.strerror or exc}")
        return {}
    except UnicodeDecodeError as exc:
        problems.append(f"config file {config_file}: not UTF-8 text (byte {exc.start})")
        return {}
    except ValueError as exc:
        problems.append(f"config file {config_file}: {exc}")
        return {}
    except yaml.YAMLError as exc:
        problems.append(f"config file {config_file}: not valid YAML: {yaml_problem(exc)}")
        return {}
    if not isinstance(loaded, dict):
        problems.append(f"config file {config_file}: must be a mapping of settings")
        return {}
    return loaded


def _from_config_file(config_file: str, problems: list[str]) -> dict[str, tuple[Any, str]]:
    raw = {}
    for key, value in _read_config_file(config_file, problems).items():
        normalized = str(key).replace("-", "_")
        if normalized not in PARSERS:
            problems.append(f"config file {config_file}: unknown setting {key!r}{did_you_mean(normalized, PARSERS)} "
                            f"(known: {', '.join(sorted(PARSERS))})")
            continue
        raw[normalized] = (value, f"{config_file}: {key}")
    return raw


def _from_environment(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    raw = {}
    for key in ENV_KEYS:
        name = env_name(key)
        if name not in environ:
            continue
        if key == "port" and environ[name].startswith("tcp://"):
            # Kubernetes injects KVWATCH_PORT=tcp://host:port into every pod of
            # a namespace that has a Service named "kvwatch" (service links).
            continue
        raw[key] = (environ[name], name)
    return raw


def _combination_problems(settings: Settings, values: dict[str, Any]) -> list[str]:
    """What the settings say wrong together (each one alone parsed)."""
    problems = []
    if settings.timeout is not None and settings.timeout > settings.window / 2:
        problems.append(
            f"timeout ({settings.timeout:g}s) must be at most half the window ({settings.window:g}s): a page later "
            "than that leaves the window without two polls"
        )
    if settings.window < 2 * settings.poll_interval:
        problems.append(f"window ({settings.window:g}s) must hold at least two polls ({settings.poll_interval:g}s each)")
    if bool(settings.tls_cert_file) != bool(settings.tls_key_file):
        problems.append("tls_cert_file and tls_key_file must be given together")
    elif settings.tls_cert_file and "tls_cert_file" in values and "tls_key_file" in values:
        problem = _tls_pair_problem(settings.tls_cert_file, settings.tls_key_file or "")
        if problem:
            problems.append(problem)
    if settings.bearer_token_file and urlsplit(settings.target).username is not None:
        # requests would send the URL's basic auth and silently drop the token.
        problems.append("give the engine's credentials either in the target URL or in bearer_token_file, not both")
    if bool(settings.upstream_target) != bool(settings.upstream_histogram):
        problems.append("upstream_target and upstream_histogram must be given together")
    if settings.diagnosis:
        problems.extend(f"diagnosis: {p}" for p in validate_thresholds(settings.diagnosis))
    return problems


def _tls_pair_problem(cert_file: str, key_file: str) -> str | None:
    """Load the pair as uvicorn will, so a key that is not a key (or does not
    match the certificate) is a configuration error now, not a traceback
    when the server starts."""
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        return f"tls_cert_file and tls_key_file: not a certificate and its private key ({exc.reason or exc})"
    except OSError as exc:
        return f"tls_cert_file and tls_key_file: {exc.strerror or exc}"
    return None
