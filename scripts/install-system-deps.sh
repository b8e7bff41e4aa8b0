#!/usr/bin/env bash
# Installs the Debian packages the tests drive for real: Prometheus (and
# promtool), VictoriaMetrics (the second store central mode and the history
# are tested on), Alertmanager, Chromium, openssl for the TLS tests, and node
# to run the status page's formatter beside Python's. Skips what is already
# there.
set -euo pipefail
need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v promtool >/dev/null || need+=(prometheus)
command -v victoria-metrics >/dev/null || need+=(victoria-metrics)
command -v prometheus-alertmanager >/dev/null || command -v alertmanager >/dev/null || need+=(prometheus-alertmanager)
command -v chromium >/dev/null || need+=(chromium)
command -v openssl >/dev/null || need+=(openssl)
command -v node >/dev/null || need+=(nodejs)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing Debian packages: ${need[*]}"
$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# The Debian packages start services under systemd where it exists; the tests
# start their own instances on loopback ports, so stop those if running.
for svc in prometheus prometheus-alertmanager prometheus-node-exporter victoria-metrics; do
  $sudo systemctl stop "$svc" 2>/dev/null || true
done
