#!/usr/bin/env bash
# The CPU test suite on the lent GPU machine (another x86-64 model, torch 2.11, Python 3.12) in one device call:
# its 16 cores run SHARDS pytest processes side by side, each on a share of the test files (round-robin over
# the files sorted by name), then every failed node id is re-run alone, one at a time, so that a clash of
# two shards (a rendezvous port taken between free_port() and bind) is told apart from a real failure.
#
#   device: carry=[".device-wheels"], command: bash scripts/device_cpu_suite.sh tests/dstrain
#   env: SHARDS (default 6), OUT (logs; the device tool brings $OUT back)
set -uo pipefail
OUT=${OUT:-/tmp/device-cpu-suite}
SHARDS=${SHARDS:-6}
mkdir -p "$OUT"
exec > >(tee "$OUT/suite.log") 2>&1
echo "== machine $(date -u +%H:%M:%S)"; nproc; python3 --version; lscpu | grep -m1 "Model name"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device-wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-build-isolation --no-deps -e . || exit 1
bash scripts/fake_udev.sh /tmp >/dev/null 2>&1 || true
python3 -c "import torch, dsio; print('torch', torch.__version__, 'capability', torch.backends.cpu.get_cpu_capability())"
export CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mapfile -t files < <(find "${@:-tests}" -name 'test_*.py' | sort)
echo "== ${#files[@]} files in $SHARDS shards $(date -u +%H:%M:%S)"
start=$(date +%s)
pids=()
for ((s = 0; s < SHARDS; s++)); do
    mine=()
    for ((i = s; i < ${#files[@]}; i += SHARDS)); do mine+=("${files[i]}"); done
    [ ${#mine[@]} -gt 0 ] || continue
    python3 -m pytest -p no:cacheprovider -q -m "not gpu" -rfE --durations=15 "${mine[@]}" > "$OUT/shard-$s.log" 2>&1 &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
echo "== shards done in $(( $(date +%s) - start )) s"
for ((s = 0; s < SHARDS; s++)); do [ -f "$OUT/shard-$s.log" ] && echo "shard $s: $(tail -1 "$OUT/shard-$s.log")"; done
mapfile -t failed < <(grep -h -E "^(FAILED|ERROR) " "$OUT"/shard-*.log | awk '{print $2}' | sort -u)
echo "== ${#failed[@]} failed node ids"
for n in "${failed[@]}"; do
    echo "-- alone: $n"
    python3 -m pytest -p no:cacheprovider -q -m "not gpu" -rfE "$n" 2>&1 | tail -3
done
echo "== end $(date -u +%H:%M:%S), $(( $(date +%s) - start )) s"
