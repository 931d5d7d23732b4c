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

}  // namespace dsio
