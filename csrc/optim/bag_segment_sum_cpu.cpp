// _bag_segment_sum on the CPU (registration.cpp has the contract): the backward of a pooled
// lookup of a step's staged rows. Each distinct row sums its sorted positions' bag gradients,
// scaled, in position order; the rows split over threads. The step's one sort (_distinct's
// perm and starts) says which positions a row has, so no per-position gradient is made and
// nothing is sorted again.
#include "common/parallel.h"
#include "optim/optim_checks.h"
#include "optim/row_sums.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace speedtorch_ops {
namespace {

// Where each of the n positions offsets covers sits: its bag, and the scale of its row there
// (its weight, 1 / its bag's size for a mean, else 1). offsets is checked on the way (from 0,
// ascending), so a bad entry raises before anything is summed.
template <class T, class S>
void place_positions(const at::Tensor& offsets, const S* weights, bool mean,
                     std::vector<int64_t>& bag_of, std::vector<T>& scale) {
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  const int64_t bags = offsets.numel() - 1;
  TORCH_CHECK(off[0] == 0, "offsets[0] must be 0 (the first bag's first position), got ", off[0]);
  for (int64_t b = 0; b < bags; ++b) {
    TORCH_CHECK(off[b + 1] >= off[b], "offsets must ascend: offsets[", b + 1, "] = ", off[b + 1],
                " < offsets[", b, "] = ", off[b]);
  }
  bag_of.resize(static_cast<size_t>(off[bags]));
  scale.resize(bag_of.size());
  for (int64_t b = 0; b < bags; ++b) {
    const T each = mean ? T(1) / static_cast<T>(off[b + 1] - off[b]) : T(1);
    for (int64_t i = off[b]; i < off[b + 1]; ++i) {
      bag_of[i] = b;
      scale[i] = weights != nullptr ? static_cast<T>(weights[i]) : each;
    }
  }
}

at::Tensor bag_segment_sum_cpu(const at::Tensor& grad, const at::Tensor& offsets,
                               const c10::optional<at::Tensor>& per_sample_weights, bool mean,
                               const at::Tensor& perm, const at::Tensor& starts,
                               const at::Tensor& count, int64_t lo, int64_t rows) {
  check_bag_segment_sum_args(grad, offsets, per_sample_weights, mean, perm, starts, count, lo,
                             rows);
  const int64_t dim = grad.size(1), n_seg = starts.numel() - 1, n_pos = perm.numel();
  auto out = at::empty({rows, dim}, grad.options());
  const int64_t live = std::clamp<int64_t>(count.item<int64_t>(), 0, std::min(rows, n_seg));
  const int64_t* p = perm.const_data_ptr<int64_t>();
  const int64_t* st = starts.const_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(),
                                  "bag_segment_sum", [&] {
    using T = at::opmath_type<scalar_t>;
    const bool weighted = per_sample_weights.has_value();
    std::vector<int64_t> bag_of;
    std::vector<T> scale;
    place_positions<T>(offsets, weighted ? per_sample_weights->const_data_ptr<scalar_t>()
                                         : nullptr, mean, bag_of, scale);
    const int64_t n = static_cast<int64_t>(bag_of.size());
    TORCH_CHECK(lo + n <= n_pos, "offsets[-1] = ", n, " positions from lo = ", lo,
                " run past perm's ", n_pos, " positions");
    TORCH_CHECK(!weighted || per_sample_weights->numel() == n, "per_sample_weights must hold "
                "one weight a position (offsets[-1] = ", n, "), got ",
                per_sample_weights->numel());
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(scalar_t));
    // perm's values first: a bad one raises before any row is summed.
    for (int64_t j = 0; j < n_pos; ++j) {
      TORCH_CHECK(p[j] >= 0 && p[j] < n_pos, "perm[", j, "] = ", p[j],
                  " is not a position of perm's ", n_pos);
    }
    // Each sorted position's bag row and scale laid out in sorted order first: the sums
    // then read them in order, and a row's items wait for one load each, not a chain of
    // three (perm, then the bag, then its gradient row).
    std::vector<int64_t> src(static_cast<size_t>(n_pos));
    std::vector<T> src_scale(static_cast<size_t>(n_pos));
    at::parallel_for(0, n_pos, grain_for(n_pos, 2 * sizeof(int64_t), 4096), [&](int64_t j0,
                                                                               int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t i = p[j] - lo;
        const bool mine = i >= 0 && i < n;  // else a position of another lookup of the step
        src[j] = mine ? bag_of[i] * dim : -1;
        src_scale[j] = mine ? scale[i] : T(0);
      }
    });
    at::parallel_for(0, rows, grain_for(rows, row_bytes * 2, 256), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t s0 = r < live ? std::clamp<int64_t>(st[r], 0, n_pos) : 0;
        const int64_t s1 = r < live ? std::clamp<int64_t>(st[r + 1], s0, n_pos) : 0;
        // Item k: the bag of the row's k-th sorted position, unless that position belongs to
        // another lookup of the step.
        const auto item = [&](int64_t k, const scalar_t*& row, T& s) {
          const int64_t at = src[s0 + k];
          if (at < 0) return false;
          row = g + at;
          s = src_scale[s0 + k];
          return true;
        };
        row_sums::sum_rows<T>(o + r * dim, dim, s1 - s0, item, 0);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(speedtorch_ops, CPU, m) {
  m.impl("_bag_segment_sum", &bag_segment_sum_cpu);
}

}  // namespace speedtorch_ops
