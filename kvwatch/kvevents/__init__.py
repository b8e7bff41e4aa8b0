"""The engine's own block stream: vLLM's KV-cache events (ZMQ, msgpack),
read beside its /metrics page (docs/kv-events.md).

wire.py reads and writes the wire format, ledger.py accounts blocks in
bounded memory (stored, evicted, stored again after eviction, the distance
of each return: the sizing curve), source.py is the ZMQ source the poll loop
reads once per poll."""
