// Staging copies (pool buffer -> caller memory) for reads.
//
// glibc's memcpy switches to non-temporal stores only above a threshold derived from the
// last-level cache size; in this VM the reported L3 is 480 MiB, so a 1 MiB piece is copied with
// ordinary stores: every destination line is first read (RFO) and then written back, twice the
// memory traffic, competing with the device's DMA. copy_stream() writes the destination with
// non-temporal (streaming) stores: the destination is not read soon after a load, so keeping it
// out of the cache costs nothing. Falls back to memcpy without AVX2.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dsio {

// Whether copy_stream uses streaming stores here (the CPU has AVX2).
bool copy_stream_supported();
// memcpy(dst, src, n) with non-temporal stores for the 32-byte-aligned middle of dst.
void copy_stream(char* dst, const char* src, size_t n);

// crc32c of [src, src + n) continuing `value` (crc32c_hw: call only where crc32c_hw_supported()),
// and, with dst, the bytes copied there: in steps of kCopySumStep, each step's crc32c first (which
// brings it into L1/L2), then its copy from the cache (copy_stream when `streaming`, else memcpy).
// One pass over the source instead of a copy and a checksum each reading it from memory.
constexpr size_t kCopySumStep = 64 << 10;
uint32_t copy_crc32c(char* dst, const char* src, size_t n, uint32_t value, bool streaming = true);

}  // namespace dsio
