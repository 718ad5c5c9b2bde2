// The op's arguments as the rules see them (torch-facing glue, shared by the CPU and CUDA
// implementations of _fused_row_update).
#pragma once

#include "optim/optim_checks.h"
#include "optim/rules.h"

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>

namespace speedtorch_ops::optim {

struct Checked {
  Rule rule;
  Hyper hyper;
  bool rounds = false;  // 16-bit stores round stochastically (a rounding tensor was given)
  uint64_t seed = 0;    // read here when the rounding tensor lives on the host (a CPU step)
  uint64_t counter = 0;
};

// Every argument checked (check_fused_update_args: a refused call changes nothing), then the
// rule and its constants, hyper = (lr, weight_decay, a, b, eps). A step count on the host is
// read here and its constants derived; one on a GPU is left to the kernel (a captured step's
// replays count on).
inline Checked checked_update(const at::Tensor& buf, const at::Tensor& grad,
                              const at::Tensor& count, const c10::optional<at::Tensor>& step,
                              int64_t rule, c10::ArrayRef<double> hyper, int64_t flags,
                              c10::ArrayRef<int64_t> fields, at::ScalarType state_dtype,
                              const c10::optional<at::Tensor>& cache,
                              const c10::optional<at::Tensor>& at,
                              const c10::optional<at::Tensor>& rounding) {
  Checked c{check_fused_update_args(buf, grad, count, step, rule, hyper, flags, fields,
                                    state_dtype, cache, at, rounding),
            make_hyper(hyper[0], hyper[1], hyper[2], hyper[3], hyper[4], flags)};
  if (step.has_value() && step->device().is_cpu()) derive(c.hyper, c.rule, step->item<double>());
  const auto narrow = [](at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; };
  c.rounds = rounding.has_value() && (narrow(grad.scalar_type()) || narrow(state_dtype));
  if (c.rounds && rounding->device().is_cpu()) {
    const int64_t* r = rounding->const_data_ptr<int64_t>();
    c.seed = static_cast<uint64_t>(r[0]);
    c.counter = static_cast<uint64_t>(r[1]);
  }
  return c;
}

}  // namespace speedtorch_ops::optim
