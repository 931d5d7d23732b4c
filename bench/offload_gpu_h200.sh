#!/usr/bin/env bash
# dstrain vs DeepSpeed ZeRO-Infinity / ZeRO-Offload on one GPU, interleaved, in one device call (issue 32):
# the 1.07B GPT of bench/offload_gpu.py, bf16, ZeRO-3, one pair (dstrain, then DeepSpeed) per mode, in the
# order of MODES:
#   both       parameters + optimizer state on NVMe (DeepSpeed with the settings that asserted last time,
#              capped at CAP_DEEPSPEED_BOTH=140 s: its failure and traceback are recorded)
#   cpu        optimizer state on the CPU (ZeRO-Offload)
#   optimizer  optimizer state on NVMe, parameters on the GPU
#   big        dstrain alone: parameters + optimizer on NVMe, the largest GPT (d=2560) the disk holds
#              (bench/offload_gpu.py --fit-disk, up to ~3.2B), run only when BIG_MIN_S are left
# and the disk's own GB/s (dsio probe, PROBE_GIB) before the first pair and after each.
#
#   device: carry=[".device-deepspeed"], command: bash bench/offload_gpu_h200.sh          (<= TOTAL_S = 530 s)
#   second call: MODES="big cpu" CAP_DSTRAIN_BIG=280 bash bench/offload_gpu_h200.sh      (big, then a 2nd cpu pair)
#   session 9 (issue 32 items 1-4): MODES="cpu optimizer" TOTAL_S=400 GPU_TESTS=1 bash bench/offload_gpu_h200.sh
#              (GPU_TESTS=1 needs carry [".device-deepspeed", ".device-wheels"]: pytest-asyncio is not in the image)
#              (the two pairs with the host master, GPU memory breakdowns in summary.md, then the -m gpu tests)
#   session 9, h4-gpu's changes (world-1 gathers bound to the shards, gradients put straight into the page-locked
#              partition): carry [".device-deepspeed", ".device-wheels"], command:
#              MODES="cpu optimizer" TOTAL_S=400 GPU_TESTS=1 GPU_TESTS_S=110 bash bench/offload_gpu_h200.sh   (<= ~520 s)
#              expected: dstrain's GPU peak ~8.6 GiB in both modes (activations 5.5 + shards 2.0 + backward's own
#              ~1.0, no gathered copies: 1.72 GiB of them at the s9 call's peak) vs DeepSpeed's 9.5; cpu step <= 0.69 s
#   session 10, h8's params + optimizer gradient partitions in page-locked host memory (dac1440): carry
#              [".device-deepspeed", ".device-wheels"], command:
#              MODES=both TOTAL_S=420 GPU_TESTS=1 GPU_TESTS_S=150 bash bench/offload_gpu_h200.sh
#              (GPU_TEST_PATHS overrides the -m gpu test paths: every offload, bench and dsio GPU test by default)
#   session 10, h3-gpumem's gathered-parameter cap (stage3_max_live_parameters = vocab*d + 12*d*d = 115.9M elements
#              with the parameters on NVMe, the same value in DeepSpeed's config; MAX_LIVE=N sets another for both):
#              carry [".device-deepspeed", ".device-wheels"], command:
#              MODES=both TOTAL_S=420 GPU_TESTS=1 GPU_TESTS_S=150 bash bench/offload_gpu_h200.sh
#              expected: dstrain's GPU peak ~6.7 GiB (activations 5.53 + backward's own ~1.04 + gathered copies
#              <= 0.22, was 1.85) vs DeepSpeed's 7.49; tokens/s as before (~275 vs ~177: disk-bound)
#   DS_MODES (default: MODES) names the modes whose DeepSpeed twin runs; the others record it as skipped
#   here:   DEVICE=cpu DSIO_DEEPSPEED_VENV=/work/venv-deepspeed bash bench/offload_gpu_h200.sh   (CPU dry run, tiny)
#
# Expected on the H200 (from the 2026-12-01 runs; s from the start): DeepSpeed install ~20, dsio build ~15
# (DeepSpeed's ops JIT-build beside it and the first run, ~90), probe ~5; both pair: dstrain ~75, DeepSpeed
# <= 80 (asserted in its 2nd step last time); cpu pair ~45 + ~70; optimizer pair ~50 + <= 90; probes ~5 each:
# ~490 in all, the big model skipped (it needs ~180-250: init writes ~45 GB, ~40 s a step at ~2.5 GB/s).
#
# Time: the whole script stops starting runs TOTAL_S (530) after it began (the device call's limit is 600 s,
# transfers included). Each run gets the cap of its mode (CAP_<impl>_<mode>, s, start-up included) or what is
# left, whichever is less; it stops its steps before one that would end past its budget, and `timeout`
# (SIGTERM, then SIGKILL 10 s later) ends it at the cap with its JSON written (the steps done so far in it).
# A run with fewer than MIN_RUN_S left is skipped and recorded as such.
# $OUT (the device tool brings back 8 files at most) gets three (four with GPU_TESTS=1: gpu-tests.log, the whole pytest output): run.log; runs.jsonl (one line per run or
# probe, appended as soon as each ends, so a cut call keeps what finished); summary.md
# (bench/offload_gpu_table.py over runs.jsonl, printed at the end). Each run's full output stays in
# /tmp/offload-h200-logs; its tail goes to run.log.
set -uo pipefail
OUT=${OUT:-/tmp/offload-h200-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
T0=$SECONDS
TOTAL_S=${TOTAL_S:-530}; MIN_RUN_S=${MIN_RUN_S:-30}; BIG_MIN_S=${BIG_MIN_S:-240}; BUILD_MAX_S=${BUILD_MAX_S:-240}
MODES=${MODES:-both cpu optimizer big}
DEVICE=${DEVICE:-cuda}; NVME=${NVME:-/var/tmp/offload-h200}; PROBE_GIB=${PROBE_GIB:-1}
# steps (warm-up 1 each) and caps per run (DeepSpeed both: 140 s, its initialize took 40.9 s and its first step
# 21.5 s in s10-call1, where the 80 s cap before cut its second step); measured on the H200 (2026-12-01): dstrain both ~13 s a step after a
# 17.6 s first, ~25 s to start; DeepSpeed both asserted in its second step after a 20.6 s first; the anchor's
# DeepSpeed optimizer-on-NVMe ~17 s a step
# (dstrain both: 130 s, so that its step budget, the cap less 45 s, holds the recorded extra step after its 3 of
# ~46 s: s10-call1's 100 s left 55 s, no room, and no breakdown at the peak)
STEPS_DSTRAIN_BOTH=${STEPS_DSTRAIN_BOTH:-3}; CAP_DSTRAIN_BOTH=${CAP_DSTRAIN_BOTH:-130}
STEPS_DEEPSPEED_BOTH=${STEPS_DEEPSPEED_BOTH:-2}; CAP_DEEPSPEED_BOTH=${CAP_DEEPSPEED_BOTH:-140}
STEPS_DSTRAIN_CPU=${STEPS_DSTRAIN_CPU:-5}; CAP_DSTRAIN_CPU=${CAP_DSTRAIN_CPU:-90}
STEPS_DEEPSPEED_CPU=${STEPS_DEEPSPEED_CPU:-5}; CAP_DEEPSPEED_CPU=${CAP_DEEPSPEED_CPU:-110}
STEPS_DSTRAIN_OPTIMIZER=${STEPS_DSTRAIN_OPTIMIZER:-3}; CAP_DSTRAIN_OPTIMIZER=${CAP_DSTRAIN_OPTIMIZER:-75}
STEPS_DEEPSPEED_OPTIMIZER=${STEPS_DEEPSPEED_OPTIMIZER:-2}; CAP_DEEPSPEED_OPTIMIZER=${CAP_DEEPSPEED_OPTIMIZER:-90}
STEPS_DSTRAIN_BIG=${STEPS_DSTRAIN_BIG:-3}; CAP_DSTRAIN_BIG=${CAP_DSTRAIN_BIG:-400}
BIG_ARGS=${BIG_ARGS:---fit-disk --dim 2560 --heads 20 --layers 20}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NVME OUT PROBE_GIB
LOGS=/tmp/offload-h200-logs
rm -rf "$LOGS"; mkdir -p "$LOGS" "$NVME"
echo "== machine $(date -u +%H:%M:%S), device $DEVICE, modes: $MODES, total ${TOTAL_S} s"
nproc; df -h "$NVME" | tail -1; git log --oneline -1 2>/dev/null
if [ "$DEVICE" = cuda ]; then
    nvidia-smi -L
    PY=python3; DSPY=python3
    echo "== deepspeed $(( SECONDS - T0 )) s"
    # shellcheck source=/dev/null
    BUILD=
    if source bench/baselines/deepspeed_device.sh install; then
        # JIT-build DeepSpeed's ops (async_io, cpu_adam) now, beside dsio's build and dstrain's first run (a CPU
        # compile beside a GPU + disk run; noted in the results), so that its own runs time training, not compiling
        python3 -c "
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
AsyncIOBuilder().load(); CPUAdamBuilder().load(); print('deepspeed ops built')" > "$LOGS/ds-build.log" 2>&1 &
        BUILD=$!
    else
        echo "deepspeed install FAILED: dstrain's runs go on, DeepSpeed's record their failure"
    fi
    echo "== build dsio $(( SECONDS - T0 )) s"
    # (without the libaio flags DeepSpeed's install exported: dsio's core needs no libaio)
    env -u CFLAGS -u LDFLAGS -u CPATH -u LIBRARY_PATH python3 -m pip install -q --no-build-isolation --no-deps -e . \
        || exit 1
    TINY=()
    DS_TINY=()
else  # the CPU dry run: a tiny GPT, DeepSpeed from its CPU venv (ops already built there), nothing installed
    PY=${PY:-.venv/bin/python}
    DSPY=${DSIO_DEEPSPEED_VENV:?DEVICE=cpu needs DSIO_DEEPSPEED_VENV}/bin/python
    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TORCH_EXTENSIONS_DIR="$DSIO_DEEPSPEED_VENV/torch_extensions"
    export RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-$((29600 + $$ % 300))}
    BUILD=
    TINY=(--device cpu --tiny)
    DS_TINY=(--device cpu --layers 2 --dim 64 --heads 4 --vocab 512 --seq 32 --batch 2)
    BIG_ARGS="--fit-disk --layers 2 --max-params 1e6"
fi
set +e  # (a failing run must not end the call: each run records its own failure)
# the same stage3_max_live_parameters for both drivers: MAX_LIVE, else each driver's default (the embedding plus
# one transformer layer with the parameters on NVMe: bench/offload_gpu.py's max_live_params; else unset)
LIVE=(); [ -n "${MAX_LIVE:-}" ] && LIVE=(--max-live-params "$MAX_LIVE")

left() { echo $(( TOTAL_S - (SECONDS - T0) )); }

record() {  # $1 = name, $2 = JSON file (removed), $3 = rc, $4 = wall s, $5 = cap s: one line of runs.jsonl
    "$PY" - "$@" <<'PY'
import json, os, sys
name, path, rc, wall, cap = sys.argv[1:6]
try:
    with open(path) as f:
        data = json.load(f)
    os.unlink(path)
except (OSError, ValueError) as e:  # killed before it wrote (SIGKILL), or crashed before its try
    data = {"error": f"no result file: rc {rc} after {wall} s (cap {cap} s): {type(e).__name__}"}
line = {"name": name, "rc": int(rc), "wall_s": int(wall), "cap_s": int(cap), "data": data}
with open(os.path.join(os.environ["OUT"], "runs.jsonl"), "a") as f:
    f.write(json.dumps(line) + "\n")
PY
}

skip() {  # $1 = name, $2 = why
    echo "== $1: skipped ($2)"
    "$PY" -c "
import json, os, sys
with open(os.path.join(os.environ['OUT'], 'runs.jsonl'), 'a') as f:
    f.write(json.dumps({'name': sys.argv[1], 'skipped': sys.argv[2]}) + '\n')" "$1" "$2"
}

probe() {  # $1 = index
    "$PY" - "$1" <<'PY'
import json, os, sys
sys.path.insert(0, os.getcwd())
from bench.offload_gpu import disk_probe
os.makedirs(os.environ["NVME"], exist_ok=True)
r = disk_probe(os.environ["NVME"], int(float(os.environ["PROBE_GIB"]) * 2**30) // 4096 * 4096)
print("probe", sys.argv[1], json.dumps(r))
with open(os.path.join(os.environ["OUT"], "runs.jsonl"), "a") as f:
    f.write(json.dumps({"name": "probe", "at": int(sys.argv[1]), **r}) + "\n")
PY
}

# run IMPL MODE: one run under its cap (or what is left), its JSON recorded as soon as it ends
run() {
    local impl=$1 mode=$2 up steps cap name="$1-$2" rest t json="$LOGS/$1-$2.json" rc
    up=$(echo "${1}_${2}" | tr '[:lower:]' '[:upper:]')
    steps=$(eval echo "\${STEPS_$up}"); cap=$(eval echo "\${CAP_$up}")
    rest=$(( $(left) - 5 ))
    [ "$rest" -lt "$cap" ] && cap=$rest
    if [ "$cap" -lt "$MIN_RUN_S" ]; then skip "$name" "${rest} s left of TOTAL_S ${TOTAL_S}"; return; fi
    if [ "$mode" = big ] && [ "$cap" -lt "$BIG_MIN_S" ]; then skip "$name" "${cap} s left, BIG_MIN_S ${BIG_MIN_S}"; return; fi
    echo "== $name at $(( SECONDS - T0 )) s: $steps steps, cap ${cap} s"
    rm -rf "${NVME:?}"/*
    t=$SECONDS
    # (the step budget: the cap less the start-up and initialize, ~45 s; ~90 s for the big model; >= 20 s)
    local up_s=45; [ "$mode" = big ] && up_s=90
    local budget=$(( cap - up_s > 20 ? cap - up_s : 20 ))
    if [ "$impl" = dstrain ]; then
        local what=$mode extra=()
        [ "$mode" = big ] && { what=both; read -r -a extra <<< "$BIG_ARGS"; }
        timeout -k 10 "$cap" "$PY" bench/offload_gpu.py --offload "$what" --nvme-path "$NVME" \
            --steps "$steps" --warmup 1 --probe-gib 0.25 --time-budget-s "$budget" --out "${json%.json}" \
            "${TINY[@]}" "${extra[@]}" "${LIVE[@]}" > "$LOGS/$name.log" 2>&1
        rc=$?
        grep -v "^$" "$LOGS/$name.log" | grep -v "^wrote \|^Command: " | tail -n 22
        rm -f "${json%.json}.md"
    else
        timeout -k 10 "$cap" "$DSPY" bench/baselines/deepspeed_offload_gpu.py --offload "$mode" \
            --nvme-path "$NVME/ds" --steps "$steps" --warmup 1 --time-budget-s "$budget" --out "$json" \
            "${DS_TINY[@]}" "${LIVE[@]}" > "$LOGS/$name.log" 2>&1
        rc=$?
        grep -v "^\[\|^$\|Warning\|warn\|^ *warnings\.\|^  return " "$LOGS/$name.log" | tail -n 12
    fi
    echo "   $name: rc $rc after $(( SECONDS - t )) s"
    record "$name" "$json" "$rc" $(( SECONDS - t )) "$cap"
    rm -rf "${NVME:?}"/*
}

built() {  # DeepSpeed's ops JIT-built (before its runs, and before a run that needs the CPU cores), waited
    [ -z "$BUILD" ] && return  # for until BUILD_MAX_S after the start at most (then stopped: its runs record why)
    while kill -0 "$BUILD" 2>/dev/null && [ $(( SECONDS - T0 )) -lt "$BUILD_MAX_S" ]; do sleep 1; done
    if kill -0 "$BUILD" 2>/dev/null; then
        kill "$BUILD"; echo "deepspeed op build still running at ${BUILD_MAX_S} s: stopped"
    fi
    wait "$BUILD"; echo "deepspeed op build rc=$? at $(( SECONDS - T0 )) s"; tail -n 3 "$LOGS/ds-build.log"; BUILD=
}

echo "== probe 0 at $(( SECONDS - T0 )) s"; probe 0
i=1
for mode in $MODES; do
    [ "$mode" = cpu ] && built  # (ZeRO-Offload steps Adam on the CPU: not beside a compile)
    run dstrain "$mode"
    if [ "$mode" != big ]; then
        case " ${DS_MODES-$MODES} " in
            *" $mode "*) built; run deepspeed "$mode" ;;
            *) skip "deepspeed-$mode" "not in DS_MODES (its twin measured in an earlier call)" ;;
        esac
    fi
    echo "== probe $i at $(( SECONDS - T0 )) s"; probe $i; i=$((i + 1))
done
echo "== done at $(( SECONDS - T0 )) s"
# issue 32's GPU tests (host master for cpu and nvme, the step thread on CUDA, the cast back's one wait,
# the bench's breakdown), when asked: GPU_TESTS=1 (they take ~1-2 minutes; their tail goes to run.log)
if [ "${GPU_TESTS:-0}" = 1 ] && [ "$DEVICE" = cuda ]; then
    echo "== gpu tests at $(( SECONDS - T0 )) s"
    # the image has pytest but not pytest-asyncio, whose hook tests/conftest.py implements (carry
    # ".device-wheels" too: without it collection stops with "unknown hook 'pytest_asyncio_loop_factories'")
    if ! "$PY" -c "import pytest_asyncio" 2>/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-wheels/pytest_asyncio-*.whl \
            && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    timeout -k 10 "${GPU_TESTS_S:-150}" "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
        ${GPU_TEST_PATHS:-tests/dstrain/offload tests/bench/test_offload_gpu_bench.py tests/dsio/test_gpu.py} > "$OUT/gpu-tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | tail -n 30
fi
"$PY" bench/offload_gpu_table.py "$OUT" --commit "$(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
    --out "$OUT/summary.md" > /dev/null
cat "$OUT/summary.md"
ls -la "$OUT"
