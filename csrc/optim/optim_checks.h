// The optimizer ops' argument checks, shared by their CPU and CUDA kernels.
#pragma once

#include "optim/rules.h"

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace speedtorch_ops {

// _segment_sum: grads at least one (n_k, dim) tensor, each contiguous, of one floating dtype
// (float32, float64, float16, bfloat16), one dim and one device; perm 1-D int64 of sum(n_k)
// entries, starts 1-D int64 of at least 1, count one int64, all contiguous on grads' device;
// rows >= 0.
void check_segment_sum_args(at::TensorList grads, const at::Tensor& perm,
                            const at::Tensor& starts, const at::Tensor& count, int64_t rows);

// _bag_segment_sum: grad a contiguous (bags, dim) floating tensor (float32, float64, float16,
// bfloat16); offsets 1-D int64 of bags + 1 entries; per_sample_weights (if given) 1-D of
// grad's dtype, not with mean; perm, starts and count as _segment_sum's; lo >= 0; rows >= 0;
// all contiguous on the CPU. The values of offsets, perm and the weights' count are checked by
// the kernel as it reads them (before it writes its output).
void check_bag_segment_sum_args(const at::Tensor& grad, const at::Tensor& offsets,
                                const c10::optional<at::Tensor>& per_sample_weights, bool mean,
                                const at::Tensor& perm, const at::Tensor& starts,
                                const at::Tensor& count, int64_t lo, int64_t rows);

// _fused_row_update: buf (n, record) uint8, contiguous, its data aligned to its fields' widest
// element; grad (n, dim) contiguous floating (float32, float64, float16, bfloat16: the
// weights' dtype) on buf's device; state_dtype float32, bfloat16 or grad's (float64 weights:
// float64 only); fields the byte offsets of the weight (dim of grad's type), the row value
// (float32, float64 with float64 state; -1 for the rules without one) and the rule's
// per-element states (dim of state_dtype each), each aligned to its element size, inside the
// record (a multiple of each element size) and not overlapping; count one int64 on buf's
// device; rule a Rule; hyper 5 values; flags the Flag bits (both rules.h); step a float32/float64 scalar on
// the CPU or buf's device, required by the rules that count steps (Adagrad, Adam, AdamW,
// PartialRowWiseAdam); cache and at together or neither: cache (slots, record) uint8,
// contiguous, aligned as buf, on buf's device, at 1-D int64 there, neither overlapping buf;
// rounding 2 contiguous int64 on buf's device.
// The arguments as the rules see them, after every check (a refused call changes nothing):
// the rule, its constants from hyper = (lr, weight_decay, a, b, eps) and flags, and the
// stochastic rounding. A step count on the host is read here and the step's constants derived;
// one on a GPU is left to the kernel (a captured step's replays count on).
struct FusedUpdateArgs {
  optim::Rule rule;
  optim::Hyper hyper;
  bool rounds = false;  // 16-bit stores round stochastically (a rounding tensor was given)
  uint64_t seed = 0;    // read here when the rounding tensor lives on the host (a CPU step)
  uint64_t counter = 0;
};
FusedUpdateArgs check_fused_update_args(const at::Tensor& buf, const at::Tensor& grad,
                                        const at::Tensor& count,
                                        const c10::optional<at::Tensor>& step, int64_t rule,
                                        c10::ArrayRef<double> hyper, int64_t flags,
                                        c10::ArrayRef<int64_t> fields,
                                        at::ScalarType state_dtype,
                                        const c10::optional<at::Tensor>& cache,
                                        const c10::optional<at::Tensor>& at,
                                        const c10::optional<at::Tensor>& rounding);

// _round_into: dst floating (float32, float64, float16, bfloat16) and contiguous, src float32,
// contiguous, dst's shape and device, not overlapping dst; rounding 2 contiguous int64 on
// dst's device.
void check_round_into_args(const at::Tensor& dst, const at::Tensor& src,
                           const at::Tensor& rounding);

}  // namespace speedtorch_ops
