// What every feature's kernels share: the element types they take, and the widest word a
// launcher can move rows in. Torch-free, like the kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace speedtorch_ops::kernels {

// The element type of a kernel's values (torch_cuda::elem_of gives a tensor's).
enum class Elem { kF32, kF64, kF16, kBF16, kI8, kU8, kI16, kI32, kI64, kBool };

// Calls go(W{}) with the widest word W of 16, 8, 4, 2 or 1 bytes that divides `align` (the OR
// of every address, row size and stride a kernel moves words of): rows that are not a multiple
// of 16 bytes take a narrower, never a wrong, path.
template <typename Go>
cudaError_t by_word(uintptr_t align, const Go& go) {
  if (align % 16 == 0) return go(uint4{});
  if (align % 8 == 0) return go(uint2{});
  if (align % 4 == 0) return go(uint32_t{});
  if (align % 2 == 0) return go(uint16_t{});
  return go(uint8_t{});
}

}  // namespace speedtorch_ops::kernels
