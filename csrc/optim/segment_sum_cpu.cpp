// _segment_sum on the CPU (registration.cpp has the contract): each output row sums its
// segment's positions in order (the order index_add_ would add them), rows split over threads;
// several gradient pieces are joined first (a copy costs little beside the sums here).
#include "common/checks.h"
#include "common/parallel.h"
#include "optim/optim_checks.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace speedtorch_ops {
namespace {

at::Tensor segment_sum_cpu(at::TensorList grads, const at::Tensor& perm,
                           const at::Tensor& starts, const at::Tensor& count, int64_t rows,
                           bool zero_tail) {
  check_segment_sum_args(grads, perm, starts, count, rows);
  const at::Tensor grad = grads.size() == 1 ? grads[0] : at::cat(grads);
  const int64_t dim = grad.size(1), n_pos = grad.size(0), n_seg = starts.numel() - 1;
  auto out = at::empty({rows, dim}, grad.options());
  const int64_t live = std::clamp<int64_t>(count.item<int64_t>(), 0, std::min(rows, n_seg));
  const int64_t* p = perm.const_data_ptr<int64_t>();
  const int64_t* st = starts.const_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "segment_sum",
                                  [&] {
    using T = at::opmath_type<scalar_t>;
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(scalar_t));
    const int64_t written = zero_tail ? rows : live;  // rows past live: zeros, or left
    at::parallel_for(0, written, grain_for(written, row_bytes * 2, 256),
                     [&](int64_t lo, int64_t hi) {
      std::vector<T> acc(dim);
      for (int64_t r = lo; r < hi; ++r) {
        std::fill(acc.begin(), acc.end(), T(0));
        if (r < live) {
          const int64_t s0 = std::clamp<int64_t>(st[r], 0, n_pos);
          const int64_t s1 = std::clamp<int64_t>(st[r + 1], s0, n_pos);
          for (int64_t j = s0; j < s1; ++j) {
            const int64_t pos = p[j];
            TORCH_CHECK(pos >= 0 && pos < n_pos, "perm[", j, "] = ", pos,
                        " is not a row of grads (their rows in turn)");
            const scalar_t* row = g + pos * dim;
            for (int64_t c = 0; c < dim; ++c) acc[c] += static_cast<T>(row[c]);
          }
        }
        for (int64_t c = 0; c < dim; ++c) o[r * dim + c] = static_cast<scalar_t>(acc[c]);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(speedtorch_ops, CPU, m) {
  m.impl("_segment_sum", &segment_sum_cpu);
}

}  // namespace speedtorch_ops
