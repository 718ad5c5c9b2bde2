// Argument checks shared by the CPU and CUDA kernels of every op.
//
// Every op validates all of its arguments with these before the first byte moves, so a failing
// call leaves every table exactly as it was. Messages name the argument and say what to pass.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace speedtorch_ops {

// index: 1-D, int32 or int64. Its values are checked separately (check_index_values on the CPU,
// a device-side validation pass on CUDA) because reading them may need the device.
void check_index(const at::Tensor& index, const char* name);

// table: at least 1-D, contiguous (rows are addressed as base + row * row_bytes).
void check_table(const at::Tensor& table, const char* name);

// rows: shape (n, *table.shape[1:]), the table's dtype, on `device`.
void check_rows_like(const at::Tensor& rows, const char* name, const at::Tensor& table,
                     int64_t n, const c10::Device& device);

// The byte ranges of `a` and `b` must not overlap. Pointers are compared across devices too:
// under unified virtual addressing a CUDA view of mapped host memory has the host address.
void check_no_overlap(const at::Tensor& a, const char* a_name, const at::Tensor& b,
                      const char* b_name);

// CPU index values in [0, rows): raises naming `name`, the first bad position and its value.
void check_index_values(const at::Tensor& index, int64_t rows, const char* name);

// Bytes of one row (product of the trailing dims times the element size).
int64_t row_bytes(const at::Tensor& table);

// The CPU cores of the ops, reused by optimizer_state_swap and by the C++ tests. They assume
// the checks above have passed; index is contiguous.
void gather_rows_cpu(const at::Tensor& table, const at::Tensor& index, at::Tensor& out);
void scatter_rows_cpu(at::Tensor& table, const at::Tensor& index, const at::Tensor& src,
                      bool accumulate);

// Kernels, named <op>_<device>, with the schema's signature.
at::Tensor pinned_gather_cpu(const at::Tensor& table, const at::Tensor& index);
void pinned_gather_into_cpu(const at::Tensor& table, const at::Tensor& index, at::Tensor& out);
void pinned_scatter_cpu(at::Tensor& table, const at::Tensor& index, const at::Tensor& src,
                        bool accumulate);
void optimizer_state_swap_cpu(at::TensorList stores, at::TensorList batch,
                              const std::optional<at::Tensor>& writeback_index,
                              const std::optional<at::Tensor>& load_index);
void sorted_transfer_cpu(at::Tensor& table, at::TensorList parts, const at::Tensor& sorted_rows,
                         const at::Tensor& slots, bool load);

// Checks shared by both devices' optimizer_state_swap: pairs, shapes, dtypes, aliasing.
void check_swap_args(at::TensorList stores, at::TensorList batch,
                     const std::optional<at::Tensor>& writeback_index,
                     const std::optional<at::Tensor>& load_index,
                     const c10::Device& batch_device);

// Checks shared by both devices' _sorted_transfer: table (rows, len(parts), ...), parts (at
// least one, each (n, ...) like a part of the table's rows, contiguous, all on one device), the
// two indices (n each, on the parts' device), no aliasing. Returns the parts' device.
c10::Device check_sorted_transfer_args(const at::Tensor& table, at::TensorList parts,
                                       const at::Tensor& sorted_rows, const at::Tensor& slots);

// Whether CUDA calls on this thread wait for their index validation to raise (default true).
bool set_index_wait(bool enabled);
bool index_wait();

}  // namespace speedtorch_ops
