// _peer_rows's kernel (peer_rows.h). Free of torch headers.
#include "peer/peer_rows.h"

#include "common/kernel_types.h"

#include <algorithm>
#include <cstdint>

namespace speedtorch_ops::kernels {
namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;
// Rows a warp reads at once: their loads (over the link, for a peer's row) are all in flight
// before the first store.
constexpr int kRowsPerWarp = 4;

// W: the word a lane moves (the widest of 16, 8, 4, 2 or 1 bytes that every row, the offset
// and out are aligned to); words = row_bytes / sizeof(W).
template <class W>
__global__ void peer_rows_kernel(const int64_t* ptrs, int64_t offset, const int64_t* rank_of,
                                 const int64_t* row_of, int64_t n, int64_t words, W* out) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t{gridDim.x} * (kThreads / kWarp);
  for (int64_t p0 = (blockIdx.x * int64_t{kThreads / kWarp} + threadIdx.x / kWarp) * kRowsPerWarp;
       p0 < n; p0 += warps * kRowsPerWarp) {
    const W* src[kRowsPerWarp];
    for (int k = 0; k < kRowsPerWarp; ++k) {
      const int64_t p = p0 + k;
      src[k] = nullptr;
      if (p >= n || row_of[p] < 0) continue;
      const char* base = reinterpret_cast<const char*>(ptrs[rank_of[p]]) + offset;
      src[k] = reinterpret_cast<const W*>(base) + row_of[p] * words;
    }
    for (int64_t j = lane; j < words; j += kWarp) {
      W x[kRowsPerWarp];
      for (int k = 0; k < kRowsPerWarp; ++k) {
        if (src[k] != nullptr) x[k] = src[k][j];
      }
      for (int k = 0; k < kRowsPerWarp; ++k) {
        if (p0 + k >= n) continue;
        if (src[k] != nullptr) {
          out[(p0 + k) * words + j] = x[k];
        } else {
          out[(p0 + k) * words + j] = W{};
        }
      }
    }
  }
}

}  // namespace

cudaError_t launch_peer_rows(const int64_t* ptrs, int64_t offset, const int64_t* rank_of,
                             const int64_t* row_of, int64_t n, int64_t row_bytes, void* out,
                             cudaStream_t stream) {
  if (n == 0 || row_bytes == 0) return cudaSuccess;
  const int64_t warps = (n + kRowsPerWarp - 1) / kRowsPerWarp;
  const int blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>((warps * kWarp + kThreads - 1) / kThreads, 65535)));
  // The buffers' addresses live on the device; the op's contract asks them 16-byte aligned
  // (allocations are), so the offset, the row length and out decide the widest word.
  const uintptr_t align = static_cast<uintptr_t>(row_bytes) | static_cast<uintptr_t>(offset) |
                          reinterpret_cast<uintptr_t>(out);
  return by_word(align, [&](auto word) {
    using W = decltype(word);
    peer_rows_kernel<W><<<blocks, kThreads, 0, stream>>>(
        ptrs, offset, rank_of, row_of, n, row_bytes / static_cast<int64_t>(sizeof(W)),
        static_cast<W*>(out));
    return cudaGetLastError();
  });
}

}  // namespace speedtorch_ops::kernels
