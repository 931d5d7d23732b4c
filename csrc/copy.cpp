#include "copy.hpp"

#include "crc32c.hpp"

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace dsio {
namespace {

__attribute__((target("avx2"))) void stream_avx2(char* dst, const char* src, size_t n) {
  size_t head = (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31;
  if (head > n) head = n;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
  _mm_sfence();  // streaming stores are weakly ordered: visible before the piece is reported done
  std::memcpy(dst + i, src + i, n - i);
}

}  // namespace

bool copy_stream_supported() {
  static const bool ok = __builtin_cpu_supports("avx2");
  return ok;
}

void copy_stream(char* dst, const char* src, size_t n) {
  if (n >= 4096 && copy_stream_supported())
    stream_avx2(dst, src, n);
  else
    std::memcpy(dst, src, n);
}

uint32_t copy_crc32c(char* dst, const char* src, size_t n, uint32_t value, bool streaming) {
  for (size_t a = 0; a < n; a += kCopySumStep) {
    size_t k = n - a < kCopySumStep ? n - a : kCopySumStep;
    value = crc32c_hw(reinterpret_cast<const uint8_t*>(src + a), k, value);
    if (dst == nullptr) continue;
    if (streaming)
      copy_stream(dst + a, src + a, k);
    else
      std::memcpy(dst + a, src + a, k);
  }
  return value;
}

}  // namespace dsio
