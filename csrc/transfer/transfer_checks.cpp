#include "transfer/transfer_checks.h"

#include "common/checks.h"

#include <ATen/ops/empty.h>
#include <c10/util/irange.h>

#include <string>
#include <utility>

namespace speedtorch_ops {
namespace {

// accumulate=True is defined for real and bool dtypes (the dtypes both devices' kernels add).
void check_accumulate_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16: case at::kChar:
    case at::kByte: case at::kShort: case at::kInt: case at::kLong: case at::kBool:
      return;
    default:
      TORCH_CHECK(false, "accumulate=True supports float, half, bfloat16, double, int8, uint8, "
                  "int16, int32, int64 and bool tables, got ", dtype);
  }
}

}  // namespace

void check_gather_into_args(const at::Tensor& table, const at::Tensor& index,
                            const at::Tensor& out, const c10::Device& device) {
  check_table(table, "table");
  check_index(index, "index");
  check_rows_like(out, "out", table, index.numel(), device);
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous (it is written in place)");
  check_no_overlap(out, "out", table, "table");
  check_no_overlap(out, "out", index, "index");
}

at::Tensor gather_output(const at::Tensor& table, const at::Tensor& index) {
  check_table(table, "table");
  check_index(index, "index");
  auto sizes = table.sizes().vec();
  sizes[0] = index.numel();
  return at::empty(sizes, table.options().device(index.device()).pinned_memory(false));
}

void check_scatter_args(const at::Tensor& table, const at::Tensor& index, const at::Tensor& src,
                        bool accumulate, const c10::Device& device) {
  check_table(table, "table");
  check_index(index, "index");
  check_rows_like(src, "src", table, index.numel(), device);
  check_no_overlap(table, "table", src, "src");
  check_no_overlap(table, "table", index, "index");
  if (accumulate) check_accumulate_dtype(table.scalar_type());
}

void check_swap_args(at::TensorList stores, at::TensorList batch,
                     const std::optional<at::Tensor>& writeback_index,
                     const std::optional<at::Tensor>& load_index,
                     const c10::Device& batch_device) {
  const std::pair<const std::optional<at::Tensor>*, const char*> indices[] = {
      {&writeback_index, "writeback_index"}, {&load_index, "load_index"}};
  for (const auto& [idx, name] : indices) {
    if (idx->has_value()) check_index(**idx, name);
  }
  TORCH_CHECK(stores.size() == batch.size(), "stores and batch must pair up: got ",
              stores.size(), " stores and ", batch.size(), " batch tensors");
  auto named = [](const char* list, size_t k) { return std::string(list) + "[" + std::to_string(k) + "]"; };
  for (const auto k : c10::irange(stores.size())) {
    const auto& store = stores[k];
    const auto& b = batch[k];
    const auto store_name = named("stores", k);
    const auto batch_name = named("batch", k);
    check_table(store, store_name.c_str());
    TORCH_CHECK(b.dim() >= 1 && b.is_contiguous(), batch_name,
                " must be a contiguous tensor of batch rows (it is written in place)");
    check_rows_like(b, batch_name.c_str(), store, b.size(0), batch_device);
    for (const auto& [idx, name] : indices) {
      if (!idx->has_value()) continue;
      TORCH_CHECK((*idx)->numel() == b.size(0), name, " has ", (*idx)->numel(), " entries but ",
                  batch_name, " has ", b.size(0), " rows; both must equal the batch size");
      check_no_overlap(b, batch_name.c_str(), **idx, name);
      check_no_overlap(store, store_name.c_str(), **idx, name);
    }
    for (const auto j : c10::irange(stores.size())) {
      check_no_overlap(b, batch_name.c_str(), stores[j], named("stores", j).c_str());
      if (j == k) continue;
      check_no_overlap(b, batch_name.c_str(), batch[j], named("batch", j).c_str());
      check_no_overlap(store, store_name.c_str(), stores[j], named("stores", j).c_str());
    }
  }
}

c10::Device check_sorted_transfer_args(const at::Tensor& table, at::TensorList parts,
                                       const at::Tensor& sorted_rows, const at::Tensor& slots,
                                       const std::optional<at::Tensor>& count, int64_t sms) {
  TORCH_CHECK(!parts.empty(), "parts must hold at least one tensor");
  TORCH_CHECK(sms >= 0, "sms must be >= 0 (0: the process-wide transfer SM limit), got ", sms);
  const auto device = parts[0].device();
  check_table(table, "table");
  check_index(sorted_rows, "sorted_rows");
  check_index(slots, "slots");
  TORCH_CHECK(table.dim() >= 2 && table.size(1) == static_cast<int64_t>(parts.size()),
              "table must have shape (rows, len(parts), ...) = (rows, ", parts.size(),
              ", ...), got ", table.sizes());
  TORCH_CHECK(slots.numel() == sorted_rows.numel(), "slots has ", slots.numel(),
              " entries but sorted_rows has ", sorted_rows.numel(), "; pass one slot per row");
  TORCH_CHECK(sorted_rows.device() == device && slots.device() == device, "sorted_rows and slots "
              "must be on ", device, " (where parts are), got ", sorted_rows.device(), " and ",
              slots.device());
  const auto part_like = table.select(1, 0);  // the shape and dtype of one part of a row
  for (const auto k : c10::irange(parts.size())) {
    const auto name = "parts[" + std::to_string(k) + "]";
    check_rows_like(parts[k], name.c_str(), part_like, parts[0].size(0), device);
    TORCH_CHECK(parts[k].is_contiguous(), name, " must be contiguous (it is read and written in "
                "place)");
    check_no_overlap(parts[k], name.c_str(), table, "table");
    check_no_overlap(parts[k], name.c_str(), sorted_rows, "sorted_rows");
    check_no_overlap(parts[k], name.c_str(), slots, "slots");
    for (const auto j : c10::irange(k)) {
      const auto other = "parts[" + std::to_string(j) + "]";
      check_no_overlap(parts[k], name.c_str(), parts[j], other.c_str());
    }
  }
  check_no_overlap(table, "table", sorted_rows, "sorted_rows");
  check_no_overlap(table, "table", slots, "slots");
  if (count) {
    TORCH_CHECK(count->scalar_type() == at::kLong && count->numel() == 1, "count must be one "
                "int64 value, got ", count->scalar_type(), " of shape ", count->sizes());
    TORCH_CHECK(count->device() == device, "count must be on ", device, " (where parts are), "
                "got ", count->device());
  }
  return device;
}

}  // namespace speedtorch_ops
