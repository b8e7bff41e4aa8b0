"""`kvwatch serve`: poll the target in the background and serve kvwatch's
endpoints. Every option is also a `KVWATCH_*` environment variable and a key
of the YAML config file."""

from __future__ import annotations

import argparse
import logging
import sys

from kvwatch.sidecar.settings import SettingsError, env_name, load_settings

# flag -> settings key; the help names the environment variable too.
OPTIONS = {
    "target": "the engine's /metrics URL (a bare http://host:port gets /metrics)",
    "host": "address to listen on (default 127.0.0.1)",
    "port": "port to listen on (default 9400)",
    "poll_interval": "seconds between polls, e.g. 5 or 5s (default 5s)",
    "timeout": "fetch deadline (default 80%% of the poll interval)",
    "window": "span of the windowed signals, e.g. 5m (default 5m)",
    "max_body_bytes": "cap on the engine's page size (default 8MiB)",
    "max_series": "most (model, engine) pairs kept per poll",
    "bearer_token_file": "file holding a bearer token for the engine",
    "ca_bundle": "CA bundle to verify the engine's TLS certificate",
    "tls_verify": "verify the engine's TLS certificate: true/false (default true)",
    "log_level": "debug, info, warning, error",
    "upstream_target": "a gateway's or application's /metrics (second source for TTFT diagnosis)",
    "upstream_histogram": "the histogram there that measures time before the engine, e.g. app_retrieval_seconds",
    "auth_token_file": "require this bearer token on kvwatch's endpoints (not /healthz, /readyz)",
    "tls_cert_file": "serve kvwatch over TLS with this certificate",
    "tls_key_file": "and this key",
}


# Seconds a shutdown waits for open connections to kvwatch before closing them.
SHUTDOWN_GRACE_SECONDS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help=f"YAML config file (env {env_name('config')})")
    for key, help_text in OPTIONS.items():
        parser.add_argument("--" + key.replace("_", "-"), dest=key, default=None,
                            help=f"{help_text} (env {env_name(key)})")


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # urllib3's debug lines quote every request line, the target's query
    # string included (where an API key may be); kvwatch logs its polls itself.
    logging.getLogger("urllib3").setLevel(max(logging.INFO, logging.getLogger().level))


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config, {key: getattr(args, key) for key in OPTIONS})
    except SettingsError as exc:
        print(f"kvwatch: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)

    import uvicorn

    from kvwatch.sidecar.app import create_app
    from kvwatch.sidecar.monitor import Monitor, tune_garbage_collector
    from kvwatch.sidecar.report import public_url

    monitor = Monitor(settings)
    app = create_app(monitor, settings)
    tune_garbage_collector()
    monitor.start()
    scheme = "https" if settings.tls_cert_file else "http"
    logging.getLogger("kvwatch").info(
        "kvwatch polling %s every %gs; serving %s://%s:%d/", public_url(settings.target), settings.poll_interval,
        scheme, settings.host, settings.port)
    raise_file_limit()
    try:
        uvicorn.run(app, **server_options(settings))
    finally:
        monitor.stop()
    return 0


def server_options(settings) -> dict:
    """uvicorn's options for kvwatch (the tests serve with these too)."""
    from kvwatch.sidecar.app import BoundedHttpProtocol

    return dict(
        host=settings.host,
        port=settings.port,
        log_level="warning" if settings.log_level == "info" else settings.log_level,
        access_log=False,
        # uvloop when installed, and httptools (kvwatch depends on both:
        # /metrics' latency under concurrent scrapers, docs/performance.md),
        # behind kvwatch's bounds on header size, header time and connections.
        loop="auto",
        http=BoundedHttpProtocol,
        ssl_certfile=settings.tls_cert_file,
        ssl_keyfile=settings.tls_key_file,
        # A scraper's idle keep-alive connection (Prometheus keeps one)
        # would otherwise hold a TLS shutdown for asyncio's 30 s close
        # timeout: as long as Kubernetes' whole grace period.
        timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
    )


def raise_file_limit() -> None:
    """Open files up to the hard limit: the connection cap (MAX_CONNECTIONS)
    and the polls then never compete for descriptors under the usual soft
    limit of 1024."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = hard if hard != resource.RLIM_INFINITY else 65536
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ImportError, ValueError, OSError):
        pass
