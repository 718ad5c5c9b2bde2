// The transfer ops' argument checks, shared by their CPU kernels and CUDA entry points, and
// the CPU kernels themselves, which the C++ tests call directly.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>

namespace speedtorch_ops {

// Checks of pinned_gather_into on either device: table, index, out of shape (n, *row shape) in
// the table's dtype on `device`, contiguous, sharing no memory with table or index.
void check_gather_into_args(const at::Tensor& table, const at::Tensor& index,
                            const at::Tensor& out, const c10::Device& device);

// pinned_gather's result on either device, after checking table and index: rows of the table's
// shape and dtype, one per index, on index's device, not pinned.
at::Tensor gather_output(const at::Tensor& table, const at::Tensor& index);

// Checks of pinned_scatter on either device: table, index, src shaped like out above on
// `device`, sharing no memory with table; index sharing none with table; the accumulate dtype.
void check_scatter_args(const at::Tensor& table, const at::Tensor& index, const at::Tensor& src,
                        bool accumulate, const c10::Device& device);


// Checks shared by both devices' optimizer_state_swap: pairs, shapes, dtypes, aliasing.
void check_swap_args(at::TensorList stores, at::TensorList batch,
                     const std::optional<at::Tensor>& writeback_index,
                     const std::optional<at::Tensor>& load_index,
                     const c10::Device& batch_device);

// Checks shared by both devices' _sorted_transfer: table (rows, len(parts), ...), parts (at
// least one, each (m, ...) like a part of the table's rows, contiguous, all on one device), the
// two indices (n each, on the parts' device), count (one int64 there, optional), no aliasing,
// sms >= 0. Returns the parts' device.
c10::Device check_sorted_transfer_args(const at::Tensor& table, at::TensorList parts,
                                       const at::Tensor& sorted_rows, const at::Tensor& slots,
                                       const std::optional<at::Tensor>& count, int64_t sms);

// The CPU kernels, named <op>_cpu, with the schema's signature.
at::Tensor pinned_gather_cpu(const at::Tensor& table, const at::Tensor& index,
                             c10::string_view bounds_check);
void pinned_gather_into_cpu(const at::Tensor& table, const at::Tensor& index, at::Tensor& out,
                            c10::string_view bounds_check);
void pinned_scatter_cpu(at::Tensor& table, const at::Tensor& index, const at::Tensor& src,
                        bool accumulate, c10::string_view bounds_check);
void optimizer_state_swap_cpu(at::TensorList stores, at::TensorList batch,
                              const std::optional<at::Tensor>& writeback_index,
                              const std::optional<at::Tensor>& load_index,
                              c10::string_view bounds_check);
void sorted_transfer_cpu(at::Tensor& table, at::TensorList parts, const at::Tensor& sorted_rows,
                         const at::Tensor& slots, bool load,
                         const std::optional<at::Tensor>& count, c10::string_view bounds_check,
                         int64_t sms);

}  // namespace speedtorch_ops
