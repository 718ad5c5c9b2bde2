// Row copies for the CPU kernels. Small common row sizes get a fixed-size memcpy, which the
// compiler turns into a few vector moves instead of a libc call per row. Not 256 B and up: g++
// turns those into `rep movs`, measured 1.5x slower than libc's memcpy for 512 B rows.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace speedtorch_ops {

// For each i in [begin, end): copy(i) returns {dst_row, src_row}; the row is copied.
template <typename Rows>
inline void copy_rows_cpu(char* dst, const char* src, int64_t row_bytes, int64_t begin,
                          int64_t end, const Rows& rows) {
  auto loop = [&](auto fixed) {
    constexpr int64_t kBytes = decltype(fixed)::value;
    const int64_t rb = kBytes > 0 ? kBytes : row_bytes;
    for (int64_t i = begin; i < end; ++i) {
      const auto [d, s] = rows(i);
      std::memcpy(dst + d * rb, src + s * rb, kBytes > 0 ? kBytes : rb);
    }
  };
  switch (row_bytes) {
    case 4: return loop(std::integral_constant<int64_t, 4>{});
    case 8: return loop(std::integral_constant<int64_t, 8>{});
    case 16: return loop(std::integral_constant<int64_t, 16>{});
    case 32: return loop(std::integral_constant<int64_t, 32>{});
    case 64: return loop(std::integral_constant<int64_t, 64>{});
    case 128: return loop(std::integral_constant<int64_t, 128>{});
    default: return loop(std::integral_constant<int64_t, 0>{});
  }
}

// Rows handled per parallel_for task: about 64 KiB of copying, so small rows are not split into
// tasks that cost more to schedule than to run.
inline int64_t row_grain(int64_t row_bytes) {
  return row_bytes >= (int64_t{64} << 10) ? 1 : (int64_t{64} << 10) / (row_bytes > 0 ? row_bytes : 1);
}

}  // namespace speedtorch_ops
