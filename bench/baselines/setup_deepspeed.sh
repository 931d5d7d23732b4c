#!/usr/bin/env bash
# Build a separate venv with DeepSpeed's DeepNVMe (async_io) on a CPU-only machine, as
# shared/ANCHORS.md describes. Idempotent: re-running skips what is already there.
#
#   bash bench/baselines/setup_deepspeed.sh [VENV]
#
# VENV defaults to $DSIO_DEEPSPEED_VENV, else <checkout>/.venv-deepspeed (where bench/io.py and
# bench/train.py look for it). Needs libaio-dev (and fio for the fio baseline): installed with
# apt-get when running as root; otherwise the script stops and says what to install.
#
# The pin_memory + async_io JIT build took ~2.5 minutes on 2 cores; it is cached in VENV/torch_extensions.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-${DSIO_DEEPSPEED_VENV:-$ROOT/.venv-deepspeed}}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
DS_VERSION="0.19.8"

die() { echo "setup_deepspeed: ERROR: $*" >&2; exit 1; }
log() { echo "setup_deepspeed: [$(date -u +%H:%M:%S)] $*"; }

# 1. System packages: libaio headers for the async_io op, fio for the fio baseline.
need_apt=()
dpkg -s libaio-dev >/dev/null 2>&1 || need_apt+=(libaio-dev)
command -v fio >/dev/null 2>&1 || need_apt+=(fio)
if [ "$(id -u)" -ne 0 ] && [ "${need_apt[*]}" = "fio" ]; then
    log "WARNING: fio is not installed and we are not root: the fio baseline will be skipped (sudo apt-get install fio)"
    need_apt=()
fi
if ((${#need_apt[@]})); then
    # Never sudo behind the user's back: as root install, otherwise say exactly what is missing.
    [ "$(id -u)" -eq 0 ] || die "missing system packages: ${need_apt[*]}. Not root, so not installing them: \
run \`sudo apt-get install ${need_apt[*]}\` (or your distribution's equivalent) and re-run this script."
    command -v apt-get >/dev/null 2>&1 || die "missing system packages: ${need_apt[*]}, and no apt-get here: install them \
with your package manager and re-run this script."
    log "apt-get install ${need_apt[*]}"
    apt-get update -q || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_apt[@]}" \
        || die "apt-get install ${need_apt[*]} failed"
fi

# 2. The venv.
if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv $VENV with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV" || die "could not create venv at $VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q)

# 3. torch FIRST and pinned: a bare `torch` would pull a multi-GB CUDA build.
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
    log "pip install torch==$TORCH_VERSION"
    "${PIP[@]}" "torch==$TORCH_VERSION" || die "pip install torch==$TORCH_VERSION failed"
fi

# 4. DeepSpeed's small runtime dependencies.
log "pip install DeepSpeed dependencies"
"${PIP[@]}" numpy packaging psutil py-cpuinfo 'pydantic>=2' tqdm hjson msgpack ninja einops \
    || die "pip install of DeepSpeed dependencies failed"

# 5. DeepSpeed itself, without build isolation (which would fetch another torch) and without deps.
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('deepspeed') == '$DS_VERSION' else 1)" 2>/dev/null; then
    log "pip install deepspeed==$DS_VERSION (DS_BUILD_OPS=0)"
    DS_BUILD_OPS=0 "${PIP[@]}" --no-deps --no-build-isolation "deepspeed==$DS_VERSION" \
        || die "pip install deepspeed==$DS_VERSION failed"
fi
"$PY" -c "import torch; assert torch.__version__.split('+')[0] == '$TORCH_VERSION', torch.__version__" \
    || die "torch in $VENV is not $TORCH_VERSION (something replaced it)"

# 6. JIT-build the ops once (cached in VENV/torch_extensions), then a 1 MiB write/read smoke test.
export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
mkdir -p "$TORCH_EXTENSIONS_DIR"
log "building/loading AsyncIOBuilder ops into $TORCH_EXTENSIONS_DIR (first time: a few minutes on 2 cores)"
start=$(date +%s)
"$PY" - <<'PYEOF' || die "DeepSpeed async_io build or smoke test failed (see above)"
import os, tempfile, torch
from deepspeed.ops.op_builder import AsyncIOBuilder
b = AsyncIOBuilder()
if not b.is_compatible(verbose=True):
    raise SystemExit("AsyncIOBuilder reports incompatible (libaio-dev missing?)")
mod = b.load()
h = mod.aio_handle()
n = 1 << 20
buf = h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
buf.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as d:
    p = os.path.join(d, "smoke.bin")
    h.sync_pwrite(buf, p)
    assert os.path.getsize(p) == n, os.path.getsize(p)
    out = h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
    h.sync_pread(out, p)
    assert torch.equal(out, buf), "read-back mismatch"
    h.free_cpu_locked_tensor(out)
h.free_cpu_locked_tensor(buf)
print("smoke test ok: 1 MiB write + read-back")
PYEOF
log "ops ready ($(( $(date +%s) - start )) s). Use: DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR $PY ..."
