// CPU kernel of _sorted_transfer: a batch's rows moved by ids the caller sorted (registration.cpp
// has the contract).
#include "common/bounds_check.h"
#include "common/checks.h"
#include "common/parallel.h"
#include "copy/row_copy.h"
#include "transfer/transfer_checks.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace speedtorch_ops {

void sorted_transfer_cpu(at::Tensor& table, at::TensorList parts, const at::Tensor& sorted_rows,
                         const at::Tensor& slots, bool load,
                         const std::optional<at::Tensor>& count, c10::string_view bounds_check,
                         int64_t sms) {
  parse_bounds_check(bounds_check);  // the values are checked on the host in every mode
  check_sorted_transfer_args(table, parts, sorted_rows, slots, count, sms);  // sms: GPU only
  // Only the first `count` positions take part (a CPU tensor: reading it costs no wait).
  const int64_t n = count ? std::clamp<int64_t>(count->item<int64_t>(), 0, sorted_rows.numel())
                          : sorted_rows.numel();
  const auto rows = sorted_rows.narrow(0, 0, n).to(at::kLong).contiguous();
  const auto pos = slots.narrow(0, 0, n).to(at::kLong).contiguous();
  check_index_values(rows, table.size(0), "sorted_rows");
  check_index_values(pos, parts[0].size(0), "slots");
  const int64_t* r = rows.const_data_ptr<int64_t>();
  const int64_t* s = pos.const_data_ptr<int64_t>();
  for (int64_t j = 1; j < n; ++j) {
    TORCH_CHECK(r[j - 1] <= r[j], "sorted_rows must be ascending, but sorted_rows[", j - 1,
                "] = ", r[j - 1], " > sorted_rows[", j, "] = ", r[j]);
  }
  const int64_t rb = row_bytes(table);
  const int64_t pb = rb / static_cast<int64_t>(parts.size());
  if (n == 0 || rb == 0) return;
  char* t = static_cast<char*>(table.mutable_data_ptr());
  std::vector<char*> p;
  for (const auto& part : parts) p.push_back(static_cast<char*>(part.mutable_data_ptr()));
  // The rows of a table larger than the caches are asked for ahead of their copy (copy/row_copy.h,
  // prefetch_ahead): the next rows' misses overlap this row's copy (docs/decisions.md,
  // "Read-ahead in the CPU sorted transfer").
  const int64_t ahead = prefetch_ahead(rb, static_cast<int64_t>(table.nbytes()));
  // Load: slots is a sort's permutation, so each batch row is written once (a repeated slot
  // would get one of its rows, unspecified which). Write-back: the last position of each run
  // writes its row, one writer per table row (sorted). Either way positions split freely.
  at::parallel_for(0, n, grain_for(n, rb, row_grain(rb)), [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      if (ahead > 0 && j + ahead < end) prefetch_row(t + r[j + ahead] * rb, rb);
      if (!load && j + 1 < n && r[j + 1] == r[j]) continue;
      for (size_t k = 0; k < p.size(); ++k) {
        char* row = t + r[j] * rb + static_cast<int64_t>(k) * pb;
        char* slot = p[k] + s[j] * pb;
        std::memcpy(load ? slot : row, load ? row : slot, pb);
      }
    }
  });
}

TORCH_LIBRARY_IMPL(speedtorch_ops, CPU, m) { m.impl("_sorted_transfer", &sorted_transfer_cpu); }

}  // namespace speedtorch_ops
