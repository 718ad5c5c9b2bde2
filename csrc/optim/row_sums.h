// A row made as the sum of scaled rows: the CPU core of the pooled lookups' sums
// (_bag_segment_sum sums a distinct row's bag gradients, the fused bag update the same before
// it updates the row). Torch-free.
#pragma once

#include "copy/row_copy.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace speedtorch_ops {
namespace row_sums {

// Item k's row and scale (item(k, row, scale) false: leave it out), with the row of item
// k + ahead read ahead (ahead > 0: rows of a table far larger than the caches).
template <class S, class T, class Item>
inline bool take(const Item& item, int64_t k, int64_t count, int64_t ahead, int64_t row_bytes,
                 const S*& row, T& scale) {
  if (ahead > 0 && k + ahead < count && item(k + ahead, row, scale)) {
    prefetch_row(reinterpret_cast<const char*>(row), row_bytes);
  }
  return item(k, row, scale);
}

// kVectors vector accumulators over the columns [c0, c0 + kVectors * lanes) of out: the sum,
// in item order, of each item's scaled row. The accumulators stay in registers (summed in
// memory, each item waited for the last one's stores). GCC's and Clang's vector extension, 16
// bytes: every x86-64 has such registers (32-byte ones, where AVX2 ran them, summed no
// faster; a width the target lacks is kept in memory).
template <int kVectors, class T, class Item>
inline void sum_block(T* out, int64_t c0, int64_t count, const Item& item, int64_t ahead,
                      int64_t row_bytes) {
  typedef T Vec __attribute__((vector_size(16)));
  constexpr int64_t kLanes = 16 / sizeof(T);
  Vec acc[kVectors] = {};
  for (int64_t k = 0; k < count; ++k) {
    const T* row;
    T scale;
    if (!take(item, k, count, c0 == 0 ? ahead : 0, row_bytes, row, scale)) continue;
    for (int v = 0; v < kVectors; ++v) {
      Vec x;
      std::memcpy(&x, row + c0 + v * kLanes, sizeof x);
      acc[v] += scale * x;
    }
  }
  for (int v = 0; v < kVectors; ++v) std::memcpy(out + c0 + v * kLanes, &acc[v], sizeof(Vec));
}

// out (dim columns of S) = the sum over items k < count of scale_k * row_k, in item order, in
// T (float for 16-bit S); item(k, row, scale) sets item k's row (dim values of S) and scale, or
// returns false to leave item k out. With ahead > 0 the row of item k + ahead is read ahead
// while item k is summed.
template <class T, class S, class Item>
void sum_rows(S* out, int64_t dim, int64_t count, const Item& item, int64_t ahead) {
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(S));
  if constexpr (std::is_same_v<T, S>) {
    constexpr int64_t kLanes = 16 / sizeof(T);
    int64_t c0 = 0;
    for (; c0 + 8 * kLanes <= dim; c0 += 8 * kLanes) {
      sum_block<8>(out, c0, count, item, ahead, row_bytes);
    }
    for (; c0 + kLanes <= dim; c0 += kLanes) sum_block<1>(out, c0, count, item, ahead, row_bytes);
    for (; c0 < dim; ++c0) {  // the columns past the last whole vector
      T acc = 0;
      for (int64_t k = 0; k < count; ++k) {
        const S* row;
        T scale;
        if (item(k, row, scale)) acc += scale * row[c0];
      }
      out[c0] = acc;
    }
  } else {  // 16-bit rows: each item's row widened once, into a row of T
    constexpr int64_t kMaxDim = 1024;
    T local[kMaxDim];
    for (int64_t c0 = 0; c0 < dim; c0 += kMaxDim) {
      const int64_t w = dim - c0 < kMaxDim ? dim - c0 : kMaxDim;
      for (int64_t c = 0; c < w; ++c) local[c] = 0;
      for (int64_t k = 0; k < count; ++k) {
        const S* row;
        T scale;
        if (!take(item, k, count, c0 == 0 ? ahead : 0, row_bytes, row, scale)) continue;
        for (int64_t c = 0; c < w; ++c) local[c] += scale * static_cast<T>(row[c0 + c]);
      }
      for (int64_t c = 0; c < w; ++c) out[c0 + c] = static_cast<S>(local[c]);
    }
  }
}

}  // namespace row_sums
}  // namespace speedtorch_ops
