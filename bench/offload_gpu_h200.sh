#!/usr/bin/env bash
# dstrain vs DeepSpeed ZeRO-Infinity / ZeRO-Offload on one GPU, interleaved, in one device call (issue 32):
# the 1.07B GPT of bench/offload_gpu.py, bf16, ZeRO-3; (1) parameters + optimizer state on NVMe,
# (2) optimizer state on the CPU; dstrain then DeepSpeed for each; the disk's own GB/s (dsio probe)
# before, between and after. Each run writes a JSON under $OUT (run.log, probes.jsonl and 4 JSONs come back);
# bench/offload_gpu_table.py renders them.
#
#   device: carry=[".device-deepspeed"], command: bash bench/offload_gpu_h200.sh
#   env: STEPS (default 4, WARMUP 1 of them), NVME (default /var/tmp/offload-h200), BUDGET_S per run (200)
set -uo pipefail
OUT=${OUT:-/tmp/offload-h200-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
STEPS=${STEPS:-4}; WARMUP=${WARMUP:-1}; NVME=${NVME:-/var/tmp/offload-h200}; BUDGET_S=${BUDGET_S:-200}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
echo "== machine $(date -u +%H:%M:%S)"; nvidia-smi -L; nproc; df -h /var/tmp | tail -1; git log --oneline -1 2>/dev/null
echo "== build dsio"; python3 -m pip install -q --no-build-isolation --no-deps -e . || exit 1
echo "== deepspeed $(date -u +%H:%M:%S)"
# shellcheck source=/dev/null
source bench/baselines/deepspeed_device.sh install || exit 1
set +e  # (a failing run must not end the call: each run records its own failure)
# JIT-build DeepSpeed's ops (async_io, cpu_adam) now, beside dstrain's first run (CPU compile vs a GPU +
# disk run: noted in the results), so that its own runs time training, not compiling
python3 -c "
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
AsyncIOBuilder().load(); CPUAdamBuilder().load(); print('deepspeed ops built')" > "$OUT/ds-build.log" 2>&1 &  # (its tail goes to run.log)
BUILD=$!
probe() { python3 - "$1" <<'PY'
import json, os, sys
sys.path.insert(0, os.getcwd())
from bench.offload_gpu import disk_probe
os.makedirs(os.environ["NVME"], exist_ok=True)
r = disk_probe(os.environ["NVME"], 1 << 30)
print("probe", sys.argv[1], json.dumps(r))
with open(os.path.join(os.environ["OUT"], "probes.jsonl"), "a") as f:
    f.write(json.dumps({"at": int(sys.argv[1]), **r}) + "\n")
PY
}
export NVME OUT
probe 0
run_dstrain() {  # $1 = both | cpu
    echo "== dstrain $1 $(date -u +%H:%M:%S)"
    rm -rf "$NVME/ds"; timeout $((BUDGET_S + 120)) python3 bench/offload_gpu.py --offload "$1" --nvme-path "$NVME" \
        --steps "$STEPS" --warmup "$WARMUP" --probe-gib 0.25 --time-budget-s "$BUDGET_S" --out "$OUT/dstrain-$1" \
        | grep -v "^$" | tail -12
    rm -f "$OUT/dstrain-$1.md"  # (printed above; $OUT brings back 8 files at most)
}
run_deepspeed() {  # $1 = both | cpu
    echo "== deepspeed $1 $(date -u +%H:%M:%S)"
    rm -rf "$NVME/ds"; timeout $((BUDGET_S + 150)) python3 bench/baselines/deepspeed_offload_gpu.py --offload "$1" \
        --nvme-path "$NVME/ds" --steps "$STEPS" --warmup "$WARMUP" --time-budget-s "$BUDGET_S" \
        --out "$OUT/deepspeed-$1.json" 2>&1 | grep -v "^\[\|^$\|Warning\|warn" | tail -12
    rm -rf "$NVME/ds"
}
run_dstrain both
wait $BUILD; echo "deepspeed op build rc=$? $(date -u +%H:%M:%S)"; tail -3 "$OUT/ds-build.log"; rm -f "$OUT/ds-build.log"
run_deepspeed both
probe 1
run_dstrain cpu
run_deepspeed cpu
probe 2
echo "== done $(date -u +%H:%M:%S)"; ls -la "$OUT"
