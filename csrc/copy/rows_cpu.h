// The CPU cores of the transfer ops: rows copied by an index between a table and its batch
// rows, reused by optimizer_state_swap, by the hybrid path's CPU side and by the C++ tests.
// They assume the ops' checks have passed; index is contiguous.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace speedtorch_ops {

// out[i] = table[index[i]]. for_device: out is staging that a copy engine reads next, not the
// CPU (streaming stores where the rows allow).
void gather_rows_cpu(const at::Tensor& table, const at::Tensor& index, at::Tensor& out,
                     bool for_device = false);
// table[index[i]] = src[i] (+= with accumulate); a repeated row: the last position wins (or
// every one adds, in index order).
void scatter_rows_cpu(at::Tensor& table, const at::Tensor& index, const at::Tensor& src,
                      bool accumulate);
// The same into several tables by one index (tables[k][index[i]] = srcs[k][i]; the index
// bucketed once for all), with the srcs' rows arriving in chunks of `chunk` positions (or
// nullptr ready: all there): ready(c) returns once rows [c * chunk, (c + 1) * chunk) may be
// read. It is called from the CPU threads, each asking for rising chunks, so rows that have
// landed are written while the rest arrive.
using ChunkReady = std::function<void(int64_t)>;
void scatter_rows_cpu(const std::vector<at::Tensor>& tables, const at::Tensor& index,
                      const std::vector<at::Tensor>& srcs, bool accumulate, int64_t chunk,
                      const ChunkReady* ready);

}  // namespace speedtorch_ops
