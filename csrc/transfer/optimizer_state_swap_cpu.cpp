// CPU optimizer_state_swap: per pair, write the batch rows back, then load the next batch's rows.
#include "common/bounds_check.h"
#include "common/checks.h"
#include "copy/rows_cpu.h"
#include "transfer/transfer_checks.h"

#include <torch/library.h>

namespace speedtorch_ops {

void optimizer_state_swap_cpu(at::TensorList stores, at::TensorList batch,
                              const std::optional<at::Tensor>& writeback_index,
                              const std::optional<at::Tensor>& load_index,
                              c10::string_view bounds_check) {
  parse_bounds_check(bounds_check);  // the values are checked on the host in every mode
  check_swap_args(stores, batch, writeback_index, load_index, c10::Device(c10::kCPU));
  const auto wb = writeback_index ? std::optional(writeback_index->contiguous()) : std::nullopt;
  const auto load = load_index ? std::optional(load_index->contiguous()) : std::nullopt;
  // Every index value is checked against every store before anything is written.
  for (const auto& store : stores) {
    if (wb) check_index_values(*wb, store.size(0), "writeback_index");
    if (load) check_index_values(*load, store.size(0), "load_index");
  }
  // Every store written back (the index bucketed once for all), then every store loaded.
  if (wb) {
    scatter_rows_cpu(stores.vec(), *wb, batch.vec(), /*accumulate=*/false, wb->numel(), nullptr);
  }
  if (load) {
    for (const auto k : c10::irange(stores.size())) {
      auto b = batch[k];
      gather_rows_cpu(stores[k], *load, b);
    }
  }
}

TORCH_LIBRARY_IMPL(speedtorch_ops, CPU, m) {
  m.impl("optimizer_state_swap", &optimizer_state_swap_cpu);
}

}  // namespace speedtorch_ops
