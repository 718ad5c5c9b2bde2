// The launcher of _segment_sum's CUDA kernels (segment_sum_cuda.cpp has the op). Plain C++
// types only: the kernel file is compiled without torch's headers.
#pragma once

#include "common/kernel_types.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace speedtorch_ops::kernels {

// Positions a chunk of the sorted positions: one warp sums a chunk's rows.
constexpr int64_t kSegmentChunk = 32;

// The gradient as the step's outputs hold it: up to kMaxGradPieces contiguous pieces of rows of
// dim elements, piece k holding positions [end[k - 1], end[k]) (end[-1] = 0), so the outputs'
// gradients are read where they are, never joined first. By value: a kernel argument.
constexpr int kMaxGradPieces = 64;
struct GradPieces {
  const void* ptr[kMaxGradPieces];
  int64_t end[kMaxGradPieces];
  int count;
};

// Bytes of scratch for n_pos sorted positions of rows of dim elements (elem: F32, F64, F16,
// BF16; partial sums in float, double for F64).
size_t segment_sum_scratch_bytes(Elem elem, int64_t n_pos, int64_t dim);

// out (rows x dim, grad's type): out[r] = the sum of the gradient's rows perm[j], j in
// [starts[r], starts[r + 1]), for r < min(*count, rows, n_seg); zero for the others (starts
// ascending, n_seg + 1 entries, n_pos from the last segment on, as _distinct gives them; with
// zero_tail false the rows from min(*count, n_seg) on are left as they are). Each
// chunk of kSegmentChunk sorted positions is summed by one warp; a segment that spans chunks is
// summed from their partial sums in chunk order: deterministic, no atomics. scratch:
// segment_sum_scratch_bytes.
cudaError_t launch_segment_sum(Elem elem, const GradPieces& grad, int64_t n_pos, int64_t dim,
                               const int64_t* perm, const int64_t* starts, int64_t n_seg,
                               const int64_t* count, void* out, int64_t rows, bool zero_tail,
                               void* scratch, cudaStream_t stream);

}  // namespace speedtorch_ops::kernels
