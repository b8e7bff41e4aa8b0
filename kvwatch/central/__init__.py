"""Central mode (`kvwatch serve --prometheus URL`), for clusters where no
sidecar polls the engines: refresh.py runs the history diagnosis
incrementally over a Prometheus-compatible store and publishes one
CentralState; app.py serves it with the sidecar's endpoints, per replica."""
