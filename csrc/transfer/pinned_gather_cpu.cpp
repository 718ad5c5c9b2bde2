// CPU gather: out[i] = table[index[i]] for a CPU table (pinned or not) and a CPU index. Index
// values are checked on the host in every bounds_check mode (it costs no wait; see
// common/bounds_check.h).
#include "common/bounds_check.h"
#include "common/checks.h"
#include "copy/rows_cpu.h"
#include "transfer/transfer_checks.h"

#include <torch/library.h>

namespace speedtorch_ops {

void pinned_gather_into_cpu(const at::Tensor& table, const at::Tensor& index, at::Tensor& out,
                            c10::string_view bounds_check) {
  parse_bounds_check(bounds_check);
  check_gather_into_args(table, index, out, index.device());
  const auto idx = index.contiguous();
  check_index_values(idx, table.size(0), "index");
  gather_rows_cpu(table, idx, out);
}

at::Tensor pinned_gather_cpu(const at::Tensor& table, const at::Tensor& index,
                             c10::string_view bounds_check) {
  auto out = gather_output(table, index);
  pinned_gather_into_cpu(table, index, out, bounds_check);
  return out;
}

TORCH_LIBRARY_IMPL(speedtorch_ops, CPU, m) {
  m.impl("pinned_gather", &pinned_gather_cpu);
  m.impl("pinned_gather_into", &pinned_gather_into_cpu);
}

}  // namespace speedtorch_ops
