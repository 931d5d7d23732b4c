#!/usr/bin/env bash
# DeepSpeed 0.19.8 with its async_io (NVMe) op on the lent GPU machine, which reaches no registry.
#
#   bash bench/baselines/deepspeed_device.sh fetch     # here: fills .device-deepspeed/ (gitignored, ~6 MB)
#   source bench/baselines/deepspeed_device.sh install # there (carry=[".device-deepspeed"]): installs, exports
#
# fetch: DeepSpeed's sdist, the wheels it needs that the device image lacks (hjson, pydantic + pydantic-core,
# annotated-types, typing-inspection, typing-extensions; versions as in the CPU DeepSpeed venv; and crc32c, which
# dsio itself needs there) for CPython 3.12,
# and Debian's libaio1 + libaio-dev unpacked with `dpkg -x` into .device-deepspeed/aio (never into /).
# install: pip-installs those into /tmp/ds-site (--no-index, DS_BUILD_OPS=0: ops are JIT-built there) and exports
# what DeepSpeed needs on that machine: PYTHONPATH; CFLAGS / LDFLAGS (its libaio probe, `has_function`) and CPATH /
# LIBRARY_PATH (the JIT build of async_io: gcc reads those) / LD_LIBRARY_PATH (loading it) pointing at the unpacked
# libaio; TORCH_CUDA_ARCH_LIST=9.0 (the image sets 9.0a, which DeepSpeed's builder cannot parse);
# TORCH_EXTENSIONS_DIR; and RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT for a world of one (the two settings
# the H200 anchor run needed: shared/anchors/h200/README.md).
# (no `set -e` at the top: `install` is sourced, and -e would then stop the caller at its first failing run;
# the first H200 call with this script lost its CPU-offload pair that way)

_DS_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
_DS_DIR="${DSIO_DS_DEVICE_DIR:-$_DS_ROOT/.device-deepspeed}"
_DS_VERSION=0.19.8
_DS_WHEELS=(hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0 crc32c)  # (crc32c: dsio.checkpoint's, absent from the device image)

_ds_fetch() (
    set -euo pipefail
    local pip="${PIP:-$_DS_ROOT/.venv/bin/pip}"
    rm -rf "$_DS_DIR" && mkdir -p "$_DS_DIR/wheels" "$_DS_DIR/aio" "$_DS_DIR/debs"
    "$pip" download -q --no-deps --no-binary :all: -d "$_DS_DIR" "deepspeed==$_DS_VERSION"
    "$pip" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$_DS_DIR/wheels" "${_DS_WHEELS[@]}"
    (cd "$_DS_DIR/debs" && apt-get download libaio1 libaio-dev)
    for deb in "$_DS_DIR"/debs/*.deb; do dpkg -x "$deb" "$_DS_DIR/aio"; done
    rm -rf "$_DS_DIR/debs"
    # libaio-dev's libaio.so links to the libaio1 file by a relative name: check both are there
    test -f "$_DS_DIR/aio/usr/include/libaio.h" && ls "$_DS_DIR"/aio/usr/lib/x86_64-linux-gnu/libaio.so* >/dev/null
    du -sh "$_DS_DIR" && ls "$_DS_DIR" "$_DS_DIR/wheels"
)

_ds_install() {
    local site=/tmp/ds-site lib="$_DS_DIR/aio/usr/lib/x86_64-linux-gnu" inc="$_DS_DIR/aio/usr/include"
    [ -d "$_DS_DIR/wheels" ] || { echo "deepspeed_device: $_DS_DIR missing: carry .device-deepspeed" >&2; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "$_DS_DIR"/wheels/*.whl || return 1
    DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
        --target "$site" "$_DS_DIR"/deepspeed-$_DS_VERSION.tar.gz || return 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
    export CFLAGS="-I$inc ${CFLAGS:-}" LDFLAGS="-L$lib ${LDFLAGS:-}"
    export CPATH="$inc${CPATH:+:$CPATH}" LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/ds-torch-ext}"
    export RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT="${MASTER_PORT:-29511}"
    python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)"
}

case "${1:-}" in
    fetch) _ds_fetch ;;
    install) _ds_install ;;
    *) echo "usage: bash $0 fetch | source $0 install" >&2; return 2 2>/dev/null || exit 2 ;;
esac
