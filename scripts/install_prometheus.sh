#!/usr/bin/env bash
# Install Prometheus (the Debian/Ubuntu package `prometheus`) when the `prometheus` binary is
# missing; do nothing when it is there. Used by tests/dsio/test_grafana.py and CI.
# Exit status 0: `prometheus` is on PATH afterwards. Non-zero: it could not be installed (the
# reason is on stderr).
set -euo pipefail

if command -v prometheus >/dev/null 2>&1; then
  echo "prometheus already installed: $(command -v prometheus)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_prometheus.sh: no apt-get on this machine; install Prometheus by other means" >&2
  exit 1
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    echo "install_prometheus.sh: not root and no password-less sudo; cannot apt-get install prometheus" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -q
# --no-install-recommends: only the server (no node exporter). Where systemd runs, the package
# also starts a service on :9090; the tests run their own server on a free loopback port.
"${SUDO[@]}" apt-get install -y -q --no-install-recommends prometheus
command -v prometheus >/dev/null 2>&1 || {
  echo "install_prometheus.sh: apt-get finished but no prometheus binary is on PATH" >&2
  exit 1
}
echo "prometheus installed: $(command -v prometheus)"
