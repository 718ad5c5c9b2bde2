// _round_into on the CPU (registration.cpp has the contract; rounding.h the draws): the
// elements are independent, so they split over the threads.
#include "common/parallel.h"
#include "optim/optim_checks.h"
#include "optim/rounding_aten.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace speedtorch_ops {
namespace {

void round_into_cpu(at::Tensor& dst, const at::Tensor& src, const at::Tensor& rounding) {
  check_round_into_args(dst, src, rounding);
  const int64_t* r = rounding.const_data_ptr<int64_t>();
  const auto seed = static_cast<uint64_t>(r[0]), counter = static_cast<uint64_t>(r[1]);
  const float* in = src.const_data_ptr<float>();
  const int64_t n = src.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst.scalar_type(), "round_into", [&] {
    scalar_t* out = dst.mutable_data_ptr<scalar_t>();
    const int64_t grain = grain_for(n, static_cast<int64_t>(sizeof(float)), 1 << 14);
    at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
      int64_t row = -1;
      uint64_t key = 0;
      for (int64_t i = lo; i < hi; ++i) {
        if ((i >> optim::kFlatRowBits) != row) {
          row = i >> optim::kFlatRowBits;
          key = optim::row_key(seed, counter, row);
        }
        out[i] = optim::store_value<scalar_t>(in[i], true, key, optim::flat_element(i));
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(speedtorch_ops, CPU, m) {
  m.impl("_round_into", &round_into_cpu);
}

}  // namespace speedtorch_ops
