"""kvwatch: KV-cache observability sidecar for vLLM."""

__version__ = "0.1.0"
