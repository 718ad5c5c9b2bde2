// CPU scatter: table[index[i]] = src[i] (or +=) for a CPU table and index.
#include "common/bounds_check.h"
#include "common/checks.h"
#include "copy/rows_cpu.h"
#include "transfer/transfer_checks.h"

#include <torch/library.h>

namespace speedtorch_ops {

void pinned_scatter_cpu(at::Tensor& table, const at::Tensor& index, const at::Tensor& src,
                        bool accumulate, c10::string_view bounds_check) {
  parse_bounds_check(bounds_check);  // the values are checked on the host in every mode
  check_scatter_args(table, index, src, accumulate, index.device());
  const auto idx = index.contiguous();
  check_index_values(idx, table.size(0), "index");
  scatter_rows_cpu(table, idx, src.contiguous(), accumulate);
}

TORCH_LIBRARY_IMPL(speedtorch_ops, CPU, m) {
  m.impl("pinned_scatter", &pinned_scatter_cpu);
}

}  // namespace speedtorch_ops
