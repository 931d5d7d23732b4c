#!/usr/bin/env bash
# Wheels the lent GPU machine lacks (it has no registry access): kvikio for the GPU benchmark's
# side-by-side, pytest and tqdm for the gpu tests. Downloaded here into .device-wheels/
# (gitignored), then carried with the device tool: carry=[".device-wheels"].
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device-wheels
PIP="${PIP:-.venv/bin/pip}"
args=(download -q --no-deps -d .device-wheels --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all:)
"$PIP" "${args[@]}" kvikio-cu13 libkvikio-cu13 "rapids-logger==0.3.*" cuda-pathfinder
"$PIP" "${args[@]}" pytest iniconfig pluggy packaging pygments tqdm pytest-asyncio hjson
"$PIP" "${args[@]}" --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 crc32c
ls .device-wheels
