// CPU gather: out[i] = table[index[i]] for a CPU table (pinned or not) and a CPU index. Index
// values are checked on the host in every bounds_check mode (it costs no wait; see
// common/bounds_check.h).
#include "row_copy.h"
#include "common/bounds_check.h"
#include "common/checks.h"
#include "common/parallel.h"
#include "transfer/rows_cpu.h"
#include "transfer/transfer_checks.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace speedtorch_ops {

void gather_rows_cpu(const at::Tensor& table, const at::Tensor& index, at::Tensor& out,
                     bool for_device) {
  const int64_t n = index.numel();
  const int64_t rb = row_bytes(table);
  if (n == 0 || rb == 0) return;
  const char* src = static_cast<const char*>(table.const_data_ptr());
  char* dst = static_cast<char*>(out.mutable_data_ptr());
  AT_DISPATCH_INDEX_TYPES(index.scalar_type(), "gather_rows_cpu", [&] {
    const index_t* idx = index.const_data_ptr<index_t>();
    const int64_t ahead = prefetch_ahead(rb, static_cast<int64_t>(table.nbytes()));
    const auto row = [&](int64_t i) { return src + static_cast<int64_t>(idx[i]) * rb; };
    // Before copying position i of a task ending at `end`: ask for the row `ahead` on.
    const auto read_ahead = [&](int64_t i, int64_t end) {
      if (ahead > 0 && i + ahead < end) prefetch_row(row(i + ahead), rb);
    };
    const int64_t grain = grain_for(n, rb, row_grain(rb));
    // Each output row is written once, so rows split across threads freely (duplicates only
    // read the same source row twice).
    if (for_device && can_stream_out(dst, rb)) {
      at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          read_ahead(i, end);
          stream_row(dst + i * rb, row(i), rb);
        }
        end_streaming();
      });
      return;
    }
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      copy_rows_cpu(dst, src, rb, begin, end, [&](int64_t i) {
        read_ahead(i, end);
        return std::pair<int64_t, int64_t>{i, idx[i]};
      });
    });
  });
}

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
