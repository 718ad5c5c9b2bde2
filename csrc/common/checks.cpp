#include "common/checks.h"

#include "common/parallel.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>

#include <atomic>
#include <limits>
#include <utility>
#include <vector>

namespace speedtorch_ops {

void check_index(const at::Tensor& index, const char* name) {
  TORCH_CHECK(index.dim() == 1, name, " must be a 1-D tensor of row numbers, got ", index.dim(),
              "-D with shape ", index.sizes(), "; pass ", name, ".reshape(-1)");
  TORCH_CHECK(index.scalar_type() == at::kLong || index.scalar_type() == at::kInt, name,
              " must be int64 or int32, got ", index.scalar_type(), "; pass ", name,
              ".long()");
}

void check_table(const at::Tensor& table, const char* name) {
  TORCH_CHECK(table.dim() >= 1, name, " must have at least one dimension (rows along dim 0)");
  TORCH_CHECK(table.is_contiguous(), name,
              " must be contiguous: rows are read in place, so a copy would not be written "
              "back; pass a contiguous table (e.g. .contiguous() once, before training)");
}

int64_t row_bytes(const at::Tensor& table) {
  int64_t elems = 1;
  for (const auto d : c10::irange(1, table.dim())) elems *= table.size(d);
  return elems * static_cast<int64_t>(table.element_size());
}

void check_rows_like(const at::Tensor& rows, const char* name, const at::Tensor& table,
                     int64_t n, const c10::Device& device) {
  TORCH_CHECK(rows.device() == device, name, " must be on ", device, ", got ", rows.device());
  TORCH_CHECK(rows.scalar_type() == table.scalar_type(), name, " must have the table's dtype ",
              table.scalar_type(), ", got ", rows.scalar_type());
  std::vector<int64_t> expected{n};
  for (const auto d : c10::irange(1, table.dim())) expected.push_back(table.size(d));
  TORCH_CHECK(rows.sizes() == at::IntArrayRef(expected), name, " must have shape ",
              at::IntArrayRef(expected), " (one row per index, the table's row shape), got ",
              rows.sizes());
}

void check_no_overlap(const at::Tensor& a, const char* a_name, const at::Tensor& b,
                      const char* b_name) {
  if (a.numel() == 0 || b.numel() == 0) return;
  // Byte span covered by each tensor (conservative for non-contiguous views).
  auto span = [](const at::Tensor& t) {
    int64_t last = 0;
    for (const auto d : c10::irange(t.dim())) last += (t.size(d) - 1) * t.stride(d);
    const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
    return std::make_pair(begin, begin + (last + 1) * t.element_size());
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  TORCH_CHECK(a1 <= b0 || b1 <= a0, a_name, " and ", b_name,
              " share memory; pass separate tensors (e.g. ", b_name, ".clone())");
}

void check_index_values(const at::Tensor& index, int64_t rows, const char* name) {
  const int64_t n = index.numel();
  std::atomic<int64_t> first_bad{std::numeric_limits<int64_t>::max()};
  AT_DISPATCH_INDEX_TYPES(index.scalar_type(), "check_index_values", [&] {
    const index_t* idx = index.const_data_ptr<index_t>();
    const int64_t grain = grain_for(n, static_cast<int64_t>(sizeof(index_t)), 1 << 14);
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t v = idx[i];
        if (v < 0 || v >= rows) {
          int64_t seen = first_bad.load();
          while (i < seen && !first_bad.compare_exchange_weak(seen, i)) {
          }
          return;
        }
      }
    });
    const int64_t bad = first_bad.load();
    TORCH_CHECK(bad == std::numeric_limits<int64_t>::max(), name, "[", bad, "] = ",
                static_cast<int64_t>(idx[bad]), " is out of range for a table of ", rows,
                " rows; every index must be in [0, ", rows, ")");
  });
}

void check_vector(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& like,
                       const char* like_name) {
  TORCH_CHECK(t.device() == like.device(), name, " must be on ", like_name, "'s device ",
              like.device(), ", got ", t.device());
}

at::ScalarType check_step_float(const at::Tensor& t, const char* name) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
                  dtype == at::kBFloat16,
              name, " must be float32, float64, float16 or bfloat16, got ", dtype);
  return dtype;
}

void check_vectors(std::initializer_list<Vector> vectors) {
  const Vector& first = *vectors.begin();
  for (const Vector& v : vectors) {
    check_vector(v.tensor, v.name, v.dtype);
    check_same_device(v.tensor, v.name, first.tensor, first.name);
  }
}

void check_one_int64(const at::Tensor& t, const char* name, const at::Tensor& like,
                     const char* like_name) {
  TORCH_CHECK(t.numel() == 1 && t.scalar_type() == at::kLong && t.is_contiguous(), name,
              " must be one int64 (shape (1,)), got ", t.scalar_type(), " of shape ", t.sizes());
  check_same_device(t, name, like, like_name);
}

void check_items(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.numel() <= std::numeric_limits<int32_t>::max(), name, " has ", t.numel(),
              " entries; at most 2^31 - 1 per call");
}

}  // namespace speedtorch_ops
