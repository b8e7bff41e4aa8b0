#!/usr/bin/env bash
# `make run`: a simulated vLLM cycling through the KV-cache symptoms, and
# kvwatch polling it. Ctrl-C stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
KVWATCH=.venv/bin/kvwatch
SIM_PORT=${SIM_PORT:-8000}
KVWATCH_PORT=${KVWATCH_PORT:-9400}
# The simulated engine's KV-cache events (vLLM's wire format): kvwatch binds, the simulator connects.
KV_EVENTS=${KV_EVENTS:-tcp://127.0.0.1:5557}
SCENARIO=${SCENARIO:-demo}
SPEED=${SPEED:-1}
# A simulated router in front of the engines (round_robin, prefix, prefix_stale), read by kvwatch beside them:
# SCENARIO=routing ROUTER=prefix_stale make run shows a routing miss.
ROUTER=${ROUTER:-}
sim_router=()
serve_router=()
if [ -n "$ROUTER" ]; then
  sim_router=(--router "$ROUTER")
  serve_router=(--router-target "http://127.0.0.1:$SIM_PORT/router/metrics")
fi

pids=()
stop() {
  trap - INT TERM EXIT
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  echo "stopped."
}
trap stop INT TERM EXIT

"$KVWATCH" sim --scenario "$SCENARIO" --speed "$SPEED" --port "$SIM_PORT" --host 127.0.0.1 --kv-events "$KV_EVENTS" ${sim_router[@]+"${sim_router[@]}"} &
pids+=($!)
# Poll interval, window and thresholds: scripts/demo-kvwatch.yaml.
"$KVWATCH" serve --config scripts/demo-kvwatch.yaml --target "http://127.0.0.1:$SIM_PORT/metrics" --port "$KVWATCH_PORT" \
  --upstream-target "http://127.0.0.1:$SIM_PORT/app/metrics" --demo-target "http://127.0.0.1:$SIM_PORT/sim/phase" \
  --kv-events "$KV_EVENTS" ${serve_router[@]+"${serve_router[@]}"} &
pids+=($!)

for _ in $(seq 1 50); do
  curl -fs "http://127.0.0.1:$KVWATCH_PORT/healthz" >/dev/null 2>&1 && break
  sleep 0.2
done
cat <<MSG

  kvwatch is running against a simulated vLLM (scenario: $SCENARIO, speed: $SPEED).

    status page      http://127.0.0.1:$KVWATCH_PORT/
    kvwatch metrics  http://127.0.0.1:$KVWATCH_PORT/metrics
    signals (JSON)   http://127.0.0.1:$KVWATCH_PORT/api/v1/signals
    diagnosis (JSON) http://127.0.0.1:$KVWATCH_PORT/api/v1/diagnosis
    simulated vLLM   http://127.0.0.1:$SIM_PORT/metrics
    KV-cache events  $KV_EVENTS (the simulator publishes as vLLM does; kvwatch_kv_events_* on /metrics)

  What you will see: signals after two polls (4 s); the scenario "demo" starts
  healthy for 30 s, then 60 tenants' prompts evict each other's prefixes, and
  the first findings (prefixes evicted before reuse, a queue for compute) show
  within the first minute. Then exhaustion, long requests, queueing, slow prefill, retrieval delay
  upstream and a prefix change, about 3 minutes each; the loop takes 27 minutes
  at speed 1 (SPEED=4 make run plays it 4 times faster). The page's strip and the
  "kvwatch sim: now: ..., next: ... in m:ss" lines below say which phase runs.
  Ctrl-C stops both.

MSG
wait -n "${pids[@]}"
