#include "lookup/lookup_checks.h"

#include "common/checks.h"

namespace speedtorch_ops {
namespace {

// (rows, dim) with each row's elements contiguous and rows any stride (>= dim) apart.
bool is_row_matrix(const at::Tensor& t) {
  return t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1) && t.stride(0) >= t.size(1);
}

}  // namespace

void check_gather_staged_args(const at::Tensor& rows, const at::Tensor& index,
                              const c10::optional<at::Tensor>& cache,
                              const c10::optional<at::Tensor>& at) {
  const auto dtype = check_step_float(rows, "rows");
  TORCH_CHECK(is_row_matrix(rows),
              "rows must be (rows, dim) with each row's elements contiguous, got shape ",
              rows.sizes(), " strides ", rows.strides());
  check_vectors({{index, "index", at::kLong}});
  check_same_device(index, "index", rows, "rows");
  TORCH_CHECK(cache.has_value() == at.has_value(), "cache and at go together: give both or "
              "neither");
  if (!cache.has_value()) return;
  TORCH_CHECK(is_row_matrix(*cache) && cache->size(1) == rows.size(1),
              "cache must be (slots, ", rows.size(1), ") with each row's elements contiguous, "
              "got shape ", cache->sizes(), " strides ", cache->strides());
  TORCH_CHECK(cache->scalar_type() == dtype, "cache must be ", dtype, " like rows, got ",
              cache->scalar_type());
  check_same_device(*cache, "cache", rows, "rows");
  check_vectors({{*at, "at", at::kLong}});
  check_same_device(*at, "at", rows, "rows");
  TORCH_CHECK(at->numel() >= rows.size(0), "at must have an entry a row of rows (",
              rows.size(0), "), got ", at->numel());
}

}  // namespace speedtorch_ops
