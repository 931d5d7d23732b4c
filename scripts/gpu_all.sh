#!/usr/bin/env bash
# Everything the 2-GPU machine proves in one call (device time is scarce):
#   dsio's GPU path (scripts/gpu_check.sh: build, cuFile ABI, gpu tests, GPU I/O bench),
#   dstrain on NCCL (ZeRO 0-3 tests, 1-bit Adam's compressed all-reduce on CUDA), bench/onebit.py on NCCL.
# Usage (device tool, kind nvidia-h200-x2, carry [".device-wheels"]):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .device-wheels/*.whl; \
#   PYTHONPATH=/tmp/site DSIO_FAKE_UDEV=1 bash scripts/gpu_all.sh "$OUT"
set -uo pipefail
OUT=${1:-/tmp/dsio-gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
GPU_BENCH_GIB=${GPU_BENCH_GIB:-2} GPU_BENCH_REPS=${GPU_BENCH_REPS:-3} bash scripts/gpu_check.sh "$OUT"
exec > >(tee "$OUT/gpu_all.log") 2>&1
echo "== dstrain on NCCL ($(python3 -c 'import torch; print(torch.cuda.device_count())') GPUs)"
timeout 420 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/dstrain 2>&1 | tail -15
echo "== bench/onebit.py on NCCL"
timeout 300 python3 bench/onebit.py --device cuda --backend nccl --reps 3 --steps 5 --layers 24 --dim 1024 \
    --heads 16 --seq 512 --batch 4 --output "$OUT/onebit-h200x2-nccl" 2>&1 | tail -14
date -u
