// Row copies for the CPU kernels. Small common row sizes get a fixed-size memcpy, which the
// compiler turns into a few vector moves instead of a libc call per row. Not 256 B and up: g++
// turns those into `rep movs`, measured slower than libc's memcpy for 512 B rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

// Tables larger than most CPUs' last-level caches: their random rows are seldom in cache, so
// their rows are written around it (can_stream_rows) and read ahead (prefetch_ahead).
constexpr int64_t kBeyondCacheBytes = int64_t{256} << 20;

// Writes to random rows of a large table (a scatter) that cover whole 64-byte cache lines can
// bypass the cache: a streaming store writes the line without first reading it from memory (a
// normal store's read-for-ownership), which halves the memory traffic of such writes and takes
// the read's latency off each row. Rows of smaller tables use memcpy.

inline bool can_stream_rows(const void* table, int64_t row_bytes, int64_t table_bytes) {
#if defined(__SSE2__)
  return table_bytes >= kBeyondCacheBytes && row_bytes > 0 && row_bytes % 64 == 0 &&
         reinterpret_cast<uintptr_t>(table) % 64 == 0;
#else
  (void)table;
  (void)row_bytes;
  (void)table_bytes;
  return false;
#endif
}

// Rows gathered into staging that a copy engine reads next (not the CPU): streaming stores
// put them in memory, where the copy reads them at its full rate; rows left in the CPU's
// caches (written normally) slow the copy, which must fetch them from there. Consecutive rows
// fill each line in turn, so rows of any multiple of 16 bytes could stream, but rows under
// 128 B gathered faster with normal stores even beside the copies (docs/decisions.md,
// "Streaming stores for staged rows").
constexpr int64_t kStreamOutMinBytes = 128;

inline bool can_stream_out(const void* out, int64_t row_bytes) {
#if defined(__SSE2__)
  return row_bytes >= kStreamOutMinBytes && row_bytes % 16 == 0 &&
         reinterpret_cast<uintptr_t>(out) % 16 == 0;
#else
  (void)out;
  (void)row_bytes;
  return false;
#endif
}

// @brief Copies a row (a multiple of 16 bytes, dst 16-byte aligned: can_stream_rows or
// can_stream_out) with streaming stores; the thread must call end_streaming() before another
// thread or a device reads the rows.
inline void stream_row(char* dst, const char* src, int64_t row_bytes) {
#if defined(__SSE2__)
  for (int64_t b = 0; b < row_bytes; b += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + b),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + b)));
  }
#else
  std::memcpy(dst, src, row_bytes);
#endif
}

// @brief Orders this thread's streaming stores before its later stores (they are weakly
// ordered): call it at the end of a task that used stream_row.
inline void end_streaming() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Reading random rows of a table larger than the caches, a thread waits on memory (and, over
// many GiB, on a page walk) for each row; out-of-order execution overlaps little more than the
// next row's misses. Asking for the row some 2 KiB of rows ahead (at most 16 rows, at least
// the next one) while copying this one keeps several rows' misses in flight; rows of 512 B
// gained nothing from it (docs/decisions.md, "Read-ahead in the CPU gather").
inline int64_t prefetch_ahead(int64_t row_bytes, int64_t table_bytes) {
  if (table_bytes < kBeyondCacheBytes || row_bytes < 32) return 0;
  return std::clamp<int64_t>((int64_t{2} << 10) / row_bytes, 1, 16);
}

// @brief The 64-byte lines a row of `row_bytes` (> 0) at `row` touches: it may start inside
// one and end inside another.
inline int64_t row_lines(const void* row, int64_t row_bytes) {
  const auto first = reinterpret_cast<uintptr_t>(row) / 64;
  const auto last = (reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(row_bytes) - 1) / 64;
  return static_cast<int64_t>(last - first + 1);
}

// @brief Asks for the cache line at `line` to be read (a hint: never faults, never waits).
// An asm statement, not __builtin_prefetch: g++ 12 judges a function whose only effect is that
// builtin free of side effects and deletes calls to it, so a read-ahead behind a lambda
// vanished from the build unseen (tests/test_build.py checks the built gather for it).
inline void prefetch_line(uintptr_t line) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 (%0)" : : "r"(line));
#elif defined(__aarch64__)
  asm volatile("prfm pldl1keep, [%0]" : : "r"(line));
#else
  // Elsewhere the builtin, which the compiler may drop as above (and the build test, x86-64
  // only, would not see it).
  __builtin_prefetch(reinterpret_cast<const void*>(line), /*rw=*/0, /*locality=*/3);
#endif
}

// @brief Asks for every cache line of a row to be read. Line addresses are computed as
// integers, not by pointer arithmetic, since the first line may begin before the table and
// the last end after it; a hint never dereferences them.
inline void prefetch_row(const char* row, int64_t row_bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(row) & ~uintptr_t{63};
  const int64_t lines = row_lines(row, row_bytes);
  for (int64_t l = 0; l < lines; ++l) prefetch_line(first + static_cast<uintptr_t>(l) * 64);
}

// Rows handled per parallel_for task: about 64 KiB of copying, so small rows are not split into
// tasks that cost more to schedule than to run.
inline int64_t row_grain(int64_t row_bytes) {
  return row_bytes >= (int64_t{64} << 10) ? 1 : (int64_t{64} << 10) / (row_bytes > 0 ? row_bytes : 1);
}

}  // namespace speedtorch_ops
