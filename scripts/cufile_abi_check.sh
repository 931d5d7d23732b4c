#!/usr/bin/env bash
# Compare dsio's own cuFile declarations (csrc/cuda.hpp) with the real cufile.h, where it exists.
set -u
hdr=$(ls /usr/local/cuda/include/cufile.h /usr/include/cufile.h /usr/local/cuda*/targets/*/include/cufile.h 2>/dev/null | head -1)
[ -n "$hdr" ] || { echo "cufile.h not found: ABI check skipped"; exit 0; }
tmp=$(mktemp -d)
cat > "$tmp/abi.cpp" <<CPP
#include <cstddef>
#include <cstdio>
#include "$hdr"
#include "$(pwd)/csrc/cuda.hpp"
int main() {
  bool ok = sizeof(CUfileDescr_t) == sizeof(dsio::CuFileDescr) &&
            offsetof(CUfileDescr_t, handle) == offsetof(dsio::CuFileDescr, handle) &&
            offsetof(CUfileDescr_t, fs_ops) == offsetof(dsio::CuFileDescr, fs_ops) &&
            sizeof(CUfileError_t) == sizeof(dsio::CuFileError) && CU_FILE_HANDLE_TYPE_OPAQUE_FD == 1;
  std::printf("cufile ABI %s: descr %zu/%zu error %zu/%zu\n", ok ? "matches" : "MISMATCH", sizeof(CUfileDescr_t),
              sizeof(dsio::CuFileDescr), sizeof(CUfileError_t), sizeof(dsio::CuFileError));
  return ok ? 0 : 1;
}
CPP
inc=$(dirname "$hdr")
g++ -std=c++17 -I"$inc" -I/usr/local/cuda/include "$tmp/abi.cpp" -o "$tmp/abi" && "$tmp/abi"
