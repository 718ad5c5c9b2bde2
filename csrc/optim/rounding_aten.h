// rounding.h for ATen's 16-bit types on the CPU (the CPU kernels of _fused_row_update and
// _round_into).
#pragma once

#include "optim/rounding.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

namespace speedtorch_ops::optim {

// x stored as S: rounded stochastically under (key, element) for a 16-bit S when `rounds`,
// else to nearest.
template <class S>
inline S store_value(float x, bool rounds, uint64_t key, uint32_t element) {
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    if (rounds) return static_cast<S>(round_for(Format::kBFloat16, x, key, element));
  } else if constexpr (std::is_same_v<S, c10::Half>) {
    if (rounds) return static_cast<S>(round_for(Format::kHalf, x, key, element));
  }
  return static_cast<S>(x);
}

}  // namespace speedtorch_ops::optim
