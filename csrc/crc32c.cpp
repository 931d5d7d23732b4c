// crc32c on AVX-512 + VPCLMULQDQ: fold 4 x 512-bit accumulators over 256 bytes per iteration
// (carry-less multiplies by x^D mod P), then fold down to one 128-bit lane and finish with the
// SSE4.2 crc32 instruction over that lane and the tail.
//
// Why the finish needs no Barrett reduction: with the initial register XORed into the first 4
// bytes, the raw (un-inverted) crc of a message depends only on the message polynomial mod P.
// Each fold keeps the accumulator congruent (mod P) to the bytes it replaced, so the crc32
// instruction run over the accumulator's 16 bytes from a zero register gives the register of the
// whole folded prefix; it then continues over the tail.
//
// Only the functions marked FAST are compiled for AVX-512; the rest of the module stays baseline
// x86-64, and the Python side calls crc32c_avx512 only where crc32c_avx512_supported() says so.
#include "crc32c.hpp"

// GCC 12's AVX-512 headers seed results with a self-initialized `__Y = __Y` (_mm512_undefined_*),
// which -Wmaybe-uninitialized reports at every broadcast/extract once inlined: a known false alarm.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

namespace dsio {

namespace {

#define FAST __attribute__((target("avx512f,avx512bw,avx512vl,vpclmulqdq,pclmul,sse4.2")))

// x^e mod P in the normal (unreflected) representation (P = 0x1EDC6F41 plus x^32).
uint64_t xpow_mod(unsigned e) {
  uint64_t r = 1;
  for (unsigned i = 0; i < e; ++i) {
    r <<= 1;
    if (r & (uint64_t{1} << 32)) r ^= 0x11EDC6F41ull;
  }
  return r;
}

// A polynomial of degree < 32 as a 64-bit reflected operand: the coefficient of x^k at bit 63 - k.
// A carry-less product of a reflected 64-bit data word A (bit i: x^(63-i)) and this operand of K
// is, read as a reflected 128-bit lane (bit m: x^(127-m)), A * K * x.
uint64_t reflect64(uint64_t poly) {
  uint64_t out = 0;
  for (unsigned k = 0; k < 32; ++k)
    if (poly >> k & 1) out |= uint64_t{1} << (63 - k);
  return out;
}

// The two operands that move a 128-bit lane D bits further along the message: its low qword
// (the lane's x^64..x^127 part) by x^(D+64), its high qword by x^D; each operand carries the
// x^-1 that the carry-less product's extra x cancels.
struct FoldK {
  uint64_t lo, hi;
};

FoldK fold_k(unsigned d_bits) { return {reflect64(xpow_mod(d_bits + 63)), reflect64(xpow_mod(d_bits - 1))}; }

struct Constants {
  FoldK k2048, k512, k384, k256, k128;
  Constants()
      : k2048(fold_k(2048)), k512(fold_k(512)), k384(fold_k(384)), k256(fold_k(256)), k128(fold_k(128)) {}
};

const Constants& constants() {
  static const Constants c;
  return c;
}

FAST uint32_t crc_bytes(uint32_t s, const uint8_t* p, size_t n) {
  while (n >= 8) {
    uint64_t w;
    __builtin_memcpy(&w, p, 8);
    s = static_cast<uint32_t>(_mm_crc32_u64(s, w));
    p += 8;
    n -= 8;
  }
  while (n--) s = _mm_crc32_u8(s, *p++);
  return s;
}

FAST inline __m512i k512v(FoldK k) { return _mm512_broadcast_i32x4(_mm_set_epi64x(static_cast<long long>(k.hi), static_cast<long long>(k.lo))); }

FAST inline __m128i k128v(FoldK k) { return _mm_set_epi64x(static_cast<long long>(k.hi), static_cast<long long>(k.lo)); }

// x's lanes moved D bits on (the constants' D), XORed with y: the three-way XOR in one instruction.
FAST inline __m512i fold512(__m512i x, __m512i k, __m512i y) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11), y,
                                   0x96);
}

FAST inline __m128i fold128(__m128i x, __m128i k) {
  return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

// The register after the first n & ~15 bytes at p (n >= 256), starting from register s.
FAST uint32_t crc_fold(uint32_t s, const uint8_t* p, size_t n) {
  const Constants& c = constants();
  __m512i x0 = _mm512_loadu_si512(p);
  __m512i x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128);
  __m512i x3 = _mm512_loadu_si512(p + 192);
  x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(s))));
  p += 256;
  n -= 256;
  const __m512i k2048 = k512v(c.k2048);
  while (n >= 256) {
    x0 = fold512(x0, k2048, _mm512_loadu_si512(p));
    x1 = fold512(x1, k2048, _mm512_loadu_si512(p + 64));
    x2 = fold512(x2, k2048, _mm512_loadu_si512(p + 128));
    x3 = fold512(x3, k2048, _mm512_loadu_si512(p + 192));
    p += 256;
    n -= 256;
  }
  const __m512i k512 = k512v(c.k512);
  x1 = fold512(x0, k512, x1);
  x2 = fold512(x1, k512, x2);
  x3 = fold512(x2, k512, x3);
  while (n >= 64) {
    x3 = fold512(x3, k512, _mm512_loadu_si512(p));
    p += 64;
    n -= 64;
  }
  // The four lanes of x3 (lane 0 first in the message) into one: each moved on to lane 3.
  __m128i a = _mm512_extracti32x4_epi32(x3, 3);
  a = _mm_xor_si128(a, fold128(_mm512_extracti32x4_epi32(x3, 0), k128v(c.k384)));
  a = _mm_xor_si128(a, fold128(_mm512_extracti32x4_epi32(x3, 1), k128v(c.k256)));
  a = _mm_xor_si128(a, fold128(_mm512_extracti32x4_epi32(x3, 2), k128v(c.k128)));
  const __m128i k128 = k128v(c.k128);
  while (n >= 16) {
    a = _mm_xor_si128(fold128(a, k128), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    p += 16;
    n -= 16;
  }
  uint64_t r = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(a)));
  return static_cast<uint32_t>(_mm_crc32_u64(r, static_cast<uint64_t>(_mm_extract_epi64(a, 1))));
}

}  // namespace

bool crc32c_avx512_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq") &&
         __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.2");
}

FAST uint32_t crc32c_avx512(const uint8_t* p, size_t n, uint32_t value) {
  uint32_t s = ~value;
  // Below this the folds' set-up does not pay; the crc32 instruction alone does it.
  if (n >= 512) {
    size_t head = (0 - reinterpret_cast<uintptr_t>(p)) & 63;  // to a 64-byte boundary: aligned loads
    s = crc_bytes(s, p, head);
    p += head;
    n -= head;
    s = crc_fold(s, p, n);
    p += n & ~size_t{15};
    n &= 15;
  }
  return ~crc_bytes(s, p, n);
}

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // crc32c, reflected

// a * b mod P, both reflected polynomials (bit 31: x^0), as zlib's multmodp.
uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = uint32_t{1} << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = b & 1 ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

struct X2n {
  uint32_t t[64];  // t[k] = x^(2^k) mod P
  X2n() {
    uint32_t p = uint32_t{1} << 30;  // x^1
    t[0] = p;
    for (int k = 1; k < 64; ++k) t[k] = p = multmodp(p, p);
  }
};

const X2n& x2n() {
  static const X2n v;
  return v;
}

// x^(8 n) mod P: the operator that moves a register over n zero bytes.
uint32_t x8nmodp(uint64_t n) {
  const X2n& x = x2n();
  uint32_t p = uint32_t{1} << 31;  // x^0
  unsigned k = 3;
  while (n) {
    if (n & 1) p = multmodp(x.t[k & 63], p);
    n >>= 1;
    ++k;
  }
  return p;
}

#define SSE42 __attribute__((target("sse4.2")))

SSE42 uint32_t crc_words(uint32_t s, const uint8_t* p, size_t n) {
  uint64_t r = s;
  while (n >= 8) {
    uint64_t w;
    __builtin_memcpy(&w, p, 8);
    r = _mm_crc32_u64(r, w);
    p += 8;
    n -= 8;
  }
  s = static_cast<uint32_t>(r);
  while (n--) s = _mm_crc32_u8(s, *p++);
  return s;
}

}  // namespace

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  if (len_b == 0) return crc_a;
  return multmodp(x8nmodp(len_b), crc_a) ^ crc_b;
}

bool crc32c_sse42_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}

// The crc32 instruction has a 3-cycle latency and a 1-cycle throughput: three independent
// registers over three thirds of the data keep it busy, then the thirds' crcs are joined. The
// join's shift operators are cached for the last length (a load's 64 KiB steps repeat it).
SSE42 uint32_t crc32c_sse42(const uint8_t* p, size_t n, uint32_t value) {
  if (n < 3 * 1024) return ~crc_words(~value, p, n);
  size_t third = n / 3 & ~size_t{7};
  const uint8_t *a = p, *b = p + third, *c = p + 2 * third;
  uint64_t ra = ~value, rb = 0xFFFFFFFFu, rc = 0xFFFFFFFFu;
  for (size_t i = 0; i < third; i += 8) {
    uint64_t wa, wb, wc;
    __builtin_memcpy(&wa, a + i, 8);
    __builtin_memcpy(&wb, b + i, 8);
    __builtin_memcpy(&wc, c + i, 8);
    ra = _mm_crc32_u64(ra, wa);
    rb = _mm_crc32_u64(rb, wb);
    rc = _mm_crc32_u64(rc, wc);
  }
  uint32_t tail = ~crc_words(static_cast<uint32_t>(rc), c + third, n - 3 * third);
  thread_local size_t cached_n = 0;
  thread_local uint32_t op_third = 0, op_rest = 0;
  if (cached_n != n) {
    op_third = x8nmodp(third);
    op_rest = x8nmodp(n - 2 * third);
    cached_n = n;
  }
  uint32_t ab = multmodp(op_third, ~static_cast<uint32_t>(ra)) ^ ~static_cast<uint32_t>(rb);
  return multmodp(op_rest, ab) ^ tail;
}

bool crc32c_hw_supported() {
  static const bool ok = crc32c_avx512_supported() || crc32c_sse42_supported();
  return ok;
}

uint32_t crc32c_hw(const uint8_t* data, size_t n, uint32_t value) {
  static const bool avx512 = crc32c_avx512_supported();
  return avx512 ? crc32c_avx512(data, n, value) : crc32c_sse42(data, n, value);
}

}  // namespace dsio

#pragma GCC diagnostic pop
