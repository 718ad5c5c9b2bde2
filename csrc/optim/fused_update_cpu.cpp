// _fused_row_update on the CPU (registration.cpp has the contract; rules.h the arithmetic):
// the staged rows are independent, so they split over the threads.
#include "hyper.h"
#include "rounding_aten.h"
#include "rules.h"
#include "speedtorch_ops/checks.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace speedtorch_ops {
namespace {

// A value stored in a row: 16-bit types round stochastically under the row's key when the
// step asks for it (rounding.h), every other store rounds to nearest.
template <class S> struct Stores {
  bool rounds;
  uint64_t key;
  S operator()(float x, uint32_t element) const {
    return optim::store_value<S>(x, rounds, key, element);
  }
  S operator()(double x, uint32_t) const { return static_cast<S>(x); }
};

void fused_row_update_cpu(at::Tensor& buf, const at::Tensor& grad, const at::Tensor& count,
                          const c10::optional<at::Tensor>& step, int64_t rule_arg,
                          at::ArrayRef<double> hyper, int64_t flags,
                          at::ArrayRef<int64_t> state_parts,
                          const c10::optional<at::Tensor>& cache,
                          const c10::optional<at::Tensor>& at,
                          const c10::optional<at::Tensor>& rounding) {
  const optim::Checked checked = optim::checked_update(buf, grad, count, step, rule_arg, hyper,
                                                       flags, state_parts, cache, at, rounding);
  const optim::Rule rule = checked.rule;
  const optim::Hyper h = checked.hyper;
  const int64_t n = buf.size(1), width = buf.size(2), dim = grad.size(1);
  const int64_t rows = std::clamp<int64_t>(count.item<int64_t>(), 0, n);
  const int64_t part_stride = buf.stride(0);
  const int states = static_cast<int>(state_parts.size());
  const bool momentum = rule == optim::Rule::kSgd && states > 0;
  const std::vector<int64_t> parts(state_parts.begin(), state_parts.end());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, buf.scalar_type(), "fused_row_update",
                                  [&] {
    using T = at::opmath_type<scalar_t>;
    scalar_t* base = buf.mutable_data_ptr<scalar_t>();
    const scalar_t* g_base = grad.const_data_ptr<scalar_t>();
    scalar_t* c_base = cache.has_value() ? cache->mutable_data_ptr<scalar_t>() : nullptr;
    const int64_t c_stride = cache.has_value() ? cache->stride(0) : 0;
    const int64_t slots = cache.has_value() ? cache->size(1) : 0;
    const int64_t* slot_at = at.has_value() ? at->const_data_ptr<int64_t>() : nullptr;
    const int64_t at_len = at.has_value() ? at->numel() : 0;
    const int64_t row_bytes = (1 + states) * dim * static_cast<int64_t>(sizeof(scalar_t));
    at::parallel_for(0, rows, grain_for(rows, row_bytes, 256), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const Stores<scalar_t> put{checked.rounds,
                                   optim::row_key(checked.seed, checked.counter, r)};
        const scalar_t* g_row = g_base + r * dim;
        // Where the row lives: its cache slot, else its staged row (part 0; parts `stride` apart).
        scalar_t* home = base + r * width;
        int64_t stride = part_stride;
        if (c_base != nullptr && r < at_len && slot_at[r] >= 0 && slot_at[r] < slots) {
          home = c_base + slot_at[r] * width;
          stride = c_stride;
        }
        const scalar_t* w_row = home;  // the weight too is read where the row lives
        T row_sum = 0;
        if (optim::has_row_value(rule)) {
          T sq = 0;
          for (int64_t j = 0; j < dim; ++j) {
            const T g = optim::effective_grad<T>(g_row[j], w_row[j], h, rule);
            sq += g * g;
          }
          row_sum = optim::row_value<T>(rule, h, static_cast<T>(w_row[dim]),
                                        sq / static_cast<T>(dim));
          home[dim] = put(row_sum, optim::kRowElement);
        }
        for (int64_t j = 0; j < dim; ++j) {
          T w = w_row[j];
          const T g = optim::effective_grad<T>(g_row[j], w, h, rule);
          T s[3] = {0, 0, 0};
          for (int k = 0; k < states; ++k) s[k] = home[parts[k] * stride + j];
          optim::update<T>(rule, h, g, w, s, momentum, row_sum);
          home[j] = put(w, optim::weight_element(j));
          for (int k = 0; k < states; ++k) {
            home[parts[k] * stride + j] = put(s[k], optim::state_element(k, j));
          }
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(speedtorch_ops, CPU, m) {
  m.impl("_fused_row_update", &fused_row_update_cpu);
}

}  // namespace speedtorch_ops
