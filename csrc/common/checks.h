// Argument checks every feature's ops share (each feature's own checks are in its folder's
// <feature>_checks.h). Every op validates all of its arguments before the first byte moves, so
// a failing call leaves every table exactly as it was. Messages name the argument and say what
// to pass.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <initializer_list>

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

// t: 1-D, of `dtype`, contiguous.
void check_vector(const at::Tensor& t, const char* name, at::ScalarType dtype);

// t on `like`'s device.
void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& like,
                       const char* like_name);

// A step's rows, gradients or state: float32, float64, float16 or bfloat16 (the kernels' Math
// types); returns the dtype.
at::ScalarType check_step_float(const at::Tensor& t, const char* name);

// One of check_vectors' tensors, with its name and the dtype it must have.
struct Vector {
  const at::Tensor& tensor;
  const char* name;
  at::ScalarType dtype;
};

// Each of `vectors` 1-D, of its dtype, contiguous, on the first one's device.
void check_vectors(std::initializer_list<Vector> vectors);

// One int64 (shape (1,)) on `like`'s device: a count kept on the device.
void check_one_int64(const at::Tensor& t, const char* name, const at::Tensor& like,
                     const char* like_name);

// Of a device op's 1-D input: at most 2^31 - 1 entries (cub's item count), naming `name`.
void check_items(const at::Tensor& t, const char* name);

}  // namespace speedtorch_ops
