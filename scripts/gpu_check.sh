#!/usr/bin/env bash
# Everything the GPU machine proves, in one call (device time is scarce):
#   build dsio there, check the cuFile ABI, run the gpu tests, run the GPU benchmark.
# Usage (through the device tool): bash scripts/gpu_check.sh "$OUT"
set -uo pipefail
OUT=${1:-/tmp/dsio-gpu-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
echo "== machine"; nvidia-smi -L; uname -r; python3 --version; nproc; date -u
ls /sys/module | grep -i nvidia || true
echo "== build"
python3 -m pip install -q --no-build-isolation --no-deps -e . || exit 1
python3 -m pip install -q --no-deps .device-wheels/*.whl 2>&1 | tail -2 || true
echo "== cuFile ABI"; bash scripts/cufile_abi_check.sh
# Containers without a udev database make cuFileHandleRegister fail outright (see fake_udev.sh).
if [ "${DSIO_FAKE_UDEV:-0}" = 1 ]; then bash scripts/fake_udev.sh /tmp; fi
rm -f cufile.log
echo "== status"; python3 -c "import dsio.gpu as g, dsio; print(g.gpu_status()); print(dsio.backend_status())"
echo "== gpu tests"
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/dsio/test_gpu.py 2>&1 | tail -15
echo "== core tests on this machine"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/dsio/test_roundtrip.py tests/dsio/test_errors.py tests/dsio/test_compat.py 2>&1 | tail -5
echo "== gpu bench"
python3 bench/gpu_io.py --dir "${DSIO_BENCH_DIR:-/tmp/dsio-gpubench}" --out "$OUT" --size-gib "${GPU_BENCH_GIB:-4}" --reps "${GPU_BENCH_REPS:-3}"
[ -f cufile.log ] && { echo "== cufile.log (tail)"; tail -5 cufile.log; }
