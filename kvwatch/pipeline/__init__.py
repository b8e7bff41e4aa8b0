"""What every mode drives (the sidecar, `serve --replay`, `diagnose --replay`,
the history diagnosis and central mode): monitor.py, the poll loop and the
State it publishes; the second sources it reads beside the engine's page
(upstream.py, lmcache.py, demo.py; the KV-cache events live in kvwatch.kvevents)."""
