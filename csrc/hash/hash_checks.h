// The id map ops' argument checks (_hash_find, _hash_insert), shared by their kernels.
#pragma once

#include <ATen/core/Tensor.h>

namespace speedtorch_ops {

// keys and rows: the map's slots, each 1-D int64 contiguous, of one power-of-two length (at
// least 1), on one device; ids: 1-D int64 contiguous on their device; new_rows (insert only,
// else undefined): like ids, of ids' length.
void check_hash_args(const at::Tensor& keys, const at::Tensor& rows, const at::Tensor& ids,
                     const at::Tensor& new_rows);

}  // namespace speedtorch_ops
