// The engine's clock: steady, in nanoseconds (latencies, histograms, the per-piece timeline).
#pragma once

#include <chrono>
#include <cstdint>

namespace dsio {

inline uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

}  // namespace dsio
