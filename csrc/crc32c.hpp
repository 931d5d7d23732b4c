// crc32c (Castagnoli, reflected polynomial 0x82F63B78) with the `crc32c` PyPI package's
// convention: crc32c(data, value) continues `value`, a previous result (inverted in, inverted out).
#pragma once

#include <cstddef>
#include <cstdint>

namespace dsio {

// Whether this CPU (and its OS) can run the AVX-512 + VPCLMULQDQ path: avx512f, avx512bw, avx512vl,
// vpclmulqdq, pclmul and sse4.2, as __builtin_cpu_supports reports them (it checks XCR0 too).
bool crc32c_avx512_supported();

// crc32c of [data, data + n) continuing `value`, on the AVX-512 folding path. Only call it where
// crc32c_avx512_supported() is true (an illegal instruction elsewhere).
uint32_t crc32c_avx512(const uint8_t* data, size_t n, uint32_t value);

// Whether this CPU has the SSE4.2 crc32 instruction (every x86-64 CPU since ~2008; not the bare
// x86-64 baseline, e.g. QEMU's default "qemu64" model).
bool crc32c_sse42_supported();

// crc32c of [data, data + n) continuing `value` with the crc32 instruction over three interleaved
// streams, joined with crc32c_combine. Only call it where crc32c_sse42_supported() is true.
uint32_t crc32c_sse42(const uint8_t* data, size_t n, uint32_t value);

// crc32c(A + B) from crc32c(A), crc32c(B) and len(B) (zlib's crc32_combine for the Castagnoli
// polynomial: multiply by x^(8 len(B)) mod P). Plain x86-64.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// The fastest crc32c kernel this CPU runs (AVX-512 folds, else SSE4.2), and whether there is one.
bool crc32c_hw_supported();
uint32_t crc32c_hw(const uint8_t* data, size_t n, uint32_t value);

}  // namespace dsio
