// _fused_row_update on the CPU (registration.cpp has the contract; rules.h the arithmetic):
// the staged records are independent, so they split over the threads.
#include "common/parallel.h"
#include "copy/row_copy.h"
#include "optim/optim_checks.h"
#include "optim/rounding_aten.h"
#include "optim/rules.h"

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

// go(W{}, S{}) for the weights' and the state's element types (the pairs check_fused_update_args
// lets through: float64 with float64, else a state of float32, bfloat16 or the weights' type).
template <class F> void with_types(at::ScalarType type, F&& go) {
  switch (type) {
    case at::kFloat: return go(float{});
    case at::kDouble: return go(double{});
    case at::kHalf: return go(at::Half{});
    case at::kBFloat16: return go(at::BFloat16{});
    default: TORCH_CHECK(false, "unsupported dtype ", type);
  }
}

template <class F> void with_pair(at::ScalarType weights, at::ScalarType state, F&& go) {
  with_types(weights, [&](auto w) {
    with_types(state, [&](auto s) {
      using W = decltype(w);
      using S = decltype(s);
      constexpr bool wide_w = std::is_same_v<W, double>, wide_s = std::is_same_v<S, double>;
      if constexpr (wide_w == wide_s &&
                    (std::is_same_v<S, W> || std::is_same_v<S, float> ||
                     std::is_same_v<S, at::BFloat16>)) {
        go(w, s);
      } else {
        TORCH_CHECK(false, "state_dtype ", state, " with ", weights, " weights");
      }
    });
  });
}

// A rule and its count of per-element states as constants: each (rule, states) pair gets its
// own element loop, in which the rule's switch and the state loops fold away, so the loop is
// straight-line arithmetic the compiler vectorizes (the generic loop ran scalar, and the CPU
// step's update was bound by it, not by its rows' memory).
template <optim::Rule kRule, int kStates> struct RuleOf {
  static constexpr optim::Rule rule = kRule;
  static constexpr int states = kStates;
};

template <class F> void with_rule(optim::Rule rule, int states, F&& go) {
  using optim::Rule;
  switch (rule) {
    case Rule::kSgd:
      return states > 0 ? go(RuleOf<Rule::kSgd, 1>{}) : go(RuleOf<Rule::kSgd, 0>{});
    case Rule::kAdagrad: return go(RuleOf<Rule::kAdagrad, 1>{});
    case Rule::kRowWiseAdagrad: return go(RuleOf<Rule::kRowWiseAdagrad, 0>{});
    case Rule::kAdam:
      return states > 2 ? go(RuleOf<Rule::kAdam, 3>{}) : go(RuleOf<Rule::kAdam, 2>{});
    case Rule::kAdamW:
      return states > 2 ? go(RuleOf<Rule::kAdamW, 3>{}) : go(RuleOf<Rule::kAdamW, 2>{});
    case Rule::kPartialRowWiseAdam: return go(RuleOf<Rule::kPartialRowWiseAdam, 1>{});
  }
}

// Where one row's weight, per-element states and row value live (the fields of its record),
// none overlapping another (check_fused_update_args), nor the gradient.
template <class W, class S, class R> struct RowFields {
  W* __restrict__ w;
  S* __restrict__ s[3];
  R* value;
};

// The mean square of a row's effective gradient, summed in kLanes partial sums so that the
// sum vectorizes (one running sum is a chain of dependent adds); the order is fixed, so a
// row's value does not depend on the threads.
template <optim::Rule kRule, class T, class W>
T mean_square(const optim::Hyper& h, const W* g_row, const W* w_row, int64_t dim) {
  constexpr int kLanes = 8;
  T part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= dim; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const T g = optim::effective_grad<T>(g_row[j + l], w_row[j + l], h, kRule);
      part[l] += g * g;
    }
  }
  T sq = 0;
  for (int l = 0; l < kLanes; ++l) sq += part[l];
  for (; j < dim; ++j) {
    const T g = optim::effective_grad<T>(g_row[j], w_row[j], h, kRule);
    sq += g * g;
  }
  return sq / static_cast<T>(dim);
}

// One step of rule R (a RuleOf) on one row: rules.h's formulas element by element.
template <class Rl, class T, class W, class S, class R>
void step_row(const optim::Hyper& h, const W* g_row, const RowFields<W, S, R>& f, int64_t dim,
              const Stores<W>& put_w, const Stores<S>& put_s) {
  constexpr optim::Rule kRule = Rl::rule;
  constexpr int kStates = Rl::states;
  T row_sum = 0;
  if (optim::has_row_value(kRule)) {
    row_sum = optim::row_value<T>(kRule, h, static_cast<T>(*f.value),
                                  mean_square<kRule, T>(h, g_row, f.w, dim));
    *f.value = static_cast<R>(row_sum);
  }
  for (int64_t j = 0; j < dim; ++j) {
    T w = f.w[j];
    const T g = optim::effective_grad<T>(g_row[j], w, h, kRule);
    T s[3] = {0, 0, 0};
    for (int k = 0; k < kStates; ++k) s[k] = static_cast<T>(f.s[k][j]);
    optim::update<T>(kRule, h, g, w, s, kStates > 0, row_sum);
    f.w[j] = put_w(w, optim::weight_element(j));
    for (int k = 0; k < kStates; ++k) f.s[k][j] = put_s(s[k], optim::state_element(k, j));
  }
}

void fused_row_update_cpu(at::Tensor& buf, const at::Tensor& grad, const at::Tensor& count,
                          const c10::optional<at::Tensor>& step, int64_t rule_arg,
                          at::ArrayRef<double> hyper, int64_t flags, at::ArrayRef<int64_t> fields,
                          at::ScalarType state_dtype, const c10::optional<at::Tensor>& cache,
                          const c10::optional<at::Tensor>& at,
                          const c10::optional<at::Tensor>& rounding) {
  const FusedUpdateArgs checked = check_fused_update_args(
      buf, grad, count, step, rule_arg, hyper, flags, fields, state_dtype, cache, at, rounding);
  const optim::Hyper h = checked.hyper;
  const int64_t n = buf.size(0), record = buf.size(1), dim = grad.size(1);
  const int64_t rows = std::clamp<int64_t>(count.item<int64_t>(), 0, n);
  const int states = static_cast<int>(fields.size()) - 2;
  const std::vector<int64_t> offsets(fields.begin(), fields.end());
  uint8_t* base = buf.mutable_data_ptr<uint8_t>();
  uint8_t* c_base = cache.has_value() ? cache->mutable_data_ptr<uint8_t>() : nullptr;
  const int64_t slots = cache.has_value() ? cache->size(0) : 0;
  const int64_t* slot_at = at.has_value() ? at->const_data_ptr<int64_t>() : nullptr;
  const int64_t at_len = at.has_value() ? at->numel() : 0;
  with_pair(grad.scalar_type(), state_dtype, [&](auto w_zero, auto s_zero) {
  with_rule(checked.rule, states, [&](auto rule_of) {
    using W = decltype(w_zero);
    using S = decltype(s_zero);
    using Rl = decltype(rule_of);
    using T = at::opmath_type<W>;
    using R = std::conditional_t<std::is_same_v<S, double>, double, float>;  // the row value
    const W* g_base = grad.const_data_ptr<W>();
    // Rows updated where they live in a table larger than the caches (the CPU step updates
    // its host table in place) are read ahead as a sorted transfer reads them.
    const int64_t ahead = c_base != nullptr ? prefetch_ahead(record, slots * record) : 0;
    at::parallel_for(0, rows, grain_for(rows, record, 256), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        if (ahead > 0 && r + ahead < hi && r + ahead < at_len) {
          const int64_t next = slot_at[r + ahead];
          if (next >= 0 && next < slots) {
            prefetch_row(reinterpret_cast<const char*>(c_base + next * record), record);
          }
        }
        const uint64_t key = optim::row_key(checked.seed, checked.counter, r);
        // Where the row lives: its cache slot, else its staged record.
        uint8_t* home = base + r * record;
        if (c_base != nullptr && r < at_len && slot_at[r] >= 0 && slot_at[r] < slots) {
          home = c_base + slot_at[r] * record;
        }
        RowFields<W, S, R> f{reinterpret_cast<W*>(home + offsets[0]), {nullptr, nullptr, nullptr},
                             offsets[1] >= 0 ? reinterpret_cast<R*>(home + offsets[1]) : nullptr};
        for (int k = 0; k < Rl::states; ++k) f.s[k] = reinterpret_cast<S*>(home + offsets[2 + k]);
        step_row<Rl, T>(h, g_base + r * dim, f, dim, Stores<W>{checked.rounds, key},
                        Stores<S>{checked.rounds, key});
      }
    });
  });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(speedtorch_ops, CPU, m) {
  m.impl("_fused_row_update", &fused_row_update_cpu);
}

}  // namespace speedtorch_ops
