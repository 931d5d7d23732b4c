#!/usr/bin/env bash
# Make a Prometheus server available to tests/dsio/test_grafana.py and bench/metrics_overhead.py.
#
#   bash scripts/install_prometheus.sh        # prints the binary's path as its last line of stdout
#
# In order:
#   1. `prometheus` already on PATH, or already unpacked into $DSIO_PROMETHEUS_DIR: nothing to do.
#   2. root (or password-less sudo) with apt-get (CI): `apt-get install prometheus` (Debian/Ubuntu's package).
#   3. not root, apt-get present: `apt-get download prometheus` + `dpkg -x` (neither needs root) into
#      $DSIO_PROMETHEUS_DIR (default: <checkout>/.cache/prometheus), binary at $DSIO_PROMETHEUS_DIR/bin/prometheus.
#      `make test` puts that folder on PATH. Needs apt's package lists (`apt-get update` run once by an admin).
# Exit status 0: a working binary's path was printed. Non-zero: none could be obtained; the reason and how
# to enable it are on stderr (the Grafana test then skips with the same advice; under DSIO_CI=1 it fails).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${DSIO_PROMETHEUS_DIR:-$ROOT/.cache/prometheus}"
HOWTO="install Prometheus (Debian/Ubuntu: sudo apt-get install prometheus; elsewhere https://prometheus.io/download/) and put \`prometheus\` on PATH"

if exe="$(command -v prometheus 2>/dev/null)"; then
  echo "prometheus already installed:" >&2
  echo "$exe"
  exit 0
fi
if [ -x "$DEST/bin/prometheus" ] && "$DEST/bin/prometheus" --version >/dev/null 2>&1; then
  echo "prometheus already unpacked:" >&2
  echo "$DEST/bin/prometheus"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_prometheus.sh: no apt-get on this machine; $HOWTO" >&2
  exit 1
fi

SUDO=()
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO=(sudo -n)
fi
if [ "$(id -u)" -eq 0 ] || [ "${#SUDO[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  "${SUDO[@]}" apt-get update -q >&2
  # --no-install-recommends: only the server (no node exporter). Where systemd runs, the package also starts
  # a service on :9090; the tests run their own server on a free loopback port.
  "${SUDO[@]}" apt-get install -y -q --no-install-recommends prometheus >&2
  exe="$(command -v prometheus 2>/dev/null)" || {
    echo "install_prometheus.sh: apt-get finished but no prometheus binary is on PATH" >&2
    exit 1
  }
  echo "prometheus installed:" >&2
  echo "$exe"
  exit 0
fi

# Not root: fetch Debian's package and unpack it in the checkout (no dpkg database, no root).
if ! command -v dpkg >/dev/null 2>&1; then
  echo "install_prometheus.sh: not root and no dpkg to unpack the package; $HOWTO" >&2
  exit 1
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if ! (cd "$work" && apt-get download prometheus >&2); then
  echo "install_prometheus.sh: not root and \`apt-get download prometheus\` failed (no package lists? an admin" \
    "can run \`apt-get update\`); $HOWTO" >&2
  exit 1
fi
rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp/bin"
dpkg -x "$work"/prometheus_*.deb "$DEST.tmp/pkg"
ln -s ../pkg/usr/bin/prometheus "$DEST.tmp/bin/prometheus"
if ! "$DEST.tmp/bin/prometheus" --version >/dev/null 2>&1; then
  echo "install_prometheus.sh: the unpacked binary does not run; $HOWTO" >&2
  exit 1
fi
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
echo "prometheus unpacked (Debian's package, no root):" >&2
echo "$DEST/bin/prometheus"
