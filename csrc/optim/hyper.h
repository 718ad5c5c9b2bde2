// The op's hyper-parameter arguments as the rules' Hyper (torch-facing glue, shared by the CPU
// and CUDA implementations of _fused_row_update).
#pragma once

#include "rules.h"

#include <c10/util/ArrayRef.h>

namespace speedtorch_ops::optim {

// hyper = (lr, weight_decay, a, b, eps), already checked (check_fused_update_args).
inline Hyper make_hyper(c10::ArrayRef<double> hyper, int64_t flags) {
  Hyper h;
  h.lr = hyper[0];
  h.weight_decay = hyper[1];
  h.a = hyper[2];
  h.b = hyper[3];
  h.eps = hyper[4];
  h.flags = flags;
  return h;
}

}  // namespace speedtorch_ops::optim
