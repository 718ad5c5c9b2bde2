// CUDA kernels of the ops: argument checks, then the transfers of transfer.cpp (indices on the
// GPU) or hybrid.cpp (indices on the host). Everything runs on the current stream under a
// device guard; nothing synchronizes the device. CUDA-graph safety: with CUDA indices the
// transfers capture; the only host wait, reading back the index-validation status to raise in
// the failing call, is skipped while the stream is capturing, where a bad index writes nothing
// but cannot raise.
#include "hybrid.h"
#include "speedtorch_ops/checks.h"
#include "transfer.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

namespace speedtorch_ops {
namespace {

using cuda_impl::DeviceIndex;
using cuda_impl::Pair;
using cuda_impl::Validation;

void check_index_on(const at::Tensor& index, const char* name, const c10::Device& device) {
  check_index(index, name);
  TORCH_CHECK(index.device() == device || index.is_cpu(), name, " must be on ", device,
              " (where the rows go) or on the CPU, got ", index.device());
}

std::vector<Pair> pairs_of(at::TensorList tables, at::TensorList batch, const c10::Device& device) {
  std::vector<Pair> pairs;
  for (const auto k : c10::irange(tables.size())) {
    const auto name = tables.size() == 1 ? std::string("table") : "stores[" + std::to_string(k) + "]";
    pairs.push_back({cuda_impl::device_rows(tables[k], name, device),
                     static_cast<char*>(const_cast<void*>(batch[k].const_data_ptr())),
                     row_bytes(tables[k]), !tables[k].is_cuda()});
  }
  return pairs;
}

// The common body of the three ops: optional write-back of batch to rows writeback_index, then
// optional load of rows load_index into batch, for every (table, batch) pair. Arguments are
// checked except index values.
void transfer(at::TensorList tables, at::TensorList batch,
              const std::optional<at::Tensor>& writeback_index,
              const std::optional<at::Tensor>& load_index, bool accumulate,
              const c10::Device& device) {
  int64_t min_rows = std::numeric_limits<int64_t>::max();
  bool host_tables = true;
  for (const auto& t : tables) {
    min_rows = std::min(min_rows, t.size(0));
    host_tables = host_tables && t.is_cpu();
  }
  const bool host_wb = writeback_index && writeback_index->is_cpu();
  const bool host_load = load_index && load_index->is_cpu();
  c10::cuda::CUDAGuard guard(device);
  if (host_wb || host_load) {
    TORCH_CHECK((!writeback_index || host_wb) && (!load_index || host_load),
                "writeback_index and load_index must both be on the CPU or both on ", device);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(device.index()), &capture));
    TORCH_CHECK(capture == cudaStreamCaptureStatusNone, "a CPU index cannot be used while a CUDA "
                "graph is being captured (the host takes part in the transfer); pass the index "
                "on ", device);
    if (writeback_index) check_index_values(writeback_index->contiguous(), min_rows, "writeback_index");
    if (load_index) check_index_values(load_index->contiguous(), min_rows, "load_index");
    if (host_tables) {  // CPU threads and DMA share the work with the zero-copy kernels
      cuda_impl::hybrid_transfer(tables.vec(), batch.vec(), writeback_index, load_index,
                                 accumulate, device);
      return;
    }
    cuda_impl::transfer_with_host_indices(pairs_of(tables, batch, device), writeback_index,
                                          load_index, min_rows, tables[0], accumulate, device);
    return;
  }
  auto pairs = pairs_of(tables, batch, device);
  Validation v(device);
  std::optional<DeviceIndex> wb, load;
  if (writeback_index) wb.emplace(v.add(*writeback_index, min_rows, "writeback_index"), std::nullopt);
  if (load_index) load.emplace(v.add(*load_index, min_rows, "load_index"), std::nullopt);
  // Per pair, the write-back is queued before the load on the same stream, so a row in both
  // indices is written back before it is loaded.
  if (wb) cuda_impl::scatter_pairs(pairs, *wb, min_rows, tables[0], accumulate, v);
  if (load) cuda_impl::gather_pairs(pairs, *load, v);
  v.raise_if_bad();
}

}  // namespace

void pinned_gather_into_cuda(const at::Tensor& table, const at::Tensor& index, at::Tensor& out) {
  check_table(table, "table");
  TORCH_CHECK(out.is_cuda() || index.is_cuda(), "index is on ", index.device(), " and out on ",
              out.device(), " but table is on the GPU; keep all on the CPU, or put out on the GPU");
  const auto device = out.is_cuda() ? out.device() : index.device();
  check_index_on(index, "index", device);
  check_rows_like(out, "out", table, index.numel(), device);
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous (it is written in place)");
  check_no_overlap(out, "out", table, "table");
  check_no_overlap(out, "out", index, "index");
  transfer({table}, {out}, std::nullopt, index, /*accumulate=*/false, device);
}

at::Tensor pinned_gather_cuda(const at::Tensor& table, const at::Tensor& index) {
  TORCH_CHECK(index.is_cuda(), "index is on ", index.device(), " but table is on the GPU; pass "
              "index.to('", table.device(), "') (rows land on index's device)");
  auto sizes = table.sizes().vec();
  sizes[0] = index.numel();
  auto out = at::empty(sizes, table.options().device(index.device()).pinned_memory(false));
  pinned_gather_into_cuda(table, index, out);
  return out;
}

void pinned_scatter_cuda(at::Tensor& table, const at::Tensor& index, const at::Tensor& src,
                         bool accumulate) {
  check_table(table, "table");
  TORCH_CHECK(src.is_cuda() || index.is_cuda(), "index is on ", index.device(), " and src on ",
              src.device(), " but table is on the GPU; keep all on the CPU, or put src on the "
              "GPU");
  const auto device = index.is_cuda() ? index.device() : src.device();
  check_index_on(index, "index", device);
  check_rows_like(src, "src", table, index.numel(), device);
  check_no_overlap(table, "table", src, "src");
  check_no_overlap(table, "table", index, "index");
  if (accumulate) cuda_impl::check_accumulate_dtype(table.scalar_type());
  transfer({table}, {src.contiguous()}, index, std::nullopt, accumulate, device);
}

void optimizer_state_swap_cuda(at::TensorList stores, at::TensorList batch,
                               const std::optional<at::Tensor>& writeback_index,
                               const std::optional<at::Tensor>& load_index) {
  // The rows go where the batch lives (or, with no batch, where an index lives).
  const auto device = !batch.empty()    ? batch[0].device()
                      : load_index      ? load_index->device()
                      : writeback_index ? writeback_index->device()
                                        : stores[0].device();
  check_swap_args(stores, batch, writeback_index, load_index, device);
  TORCH_CHECK(device.is_cuda(), "batch[0] is on ", device, "; with CUDA stores or indices the "
              "batch tensors must be on the GPU");
  if (writeback_index) check_index_on(*writeback_index, "writeback_index", device);
  if (load_index) check_index_on(*load_index, "load_index", device);
  if (stores.empty()) return;
  transfer(stores, batch, writeback_index, load_index, /*accumulate=*/false, device);
}

void sorted_transfer_cuda(at::Tensor& table, at::TensorList parts, const at::Tensor& sorted_rows,
                          const at::Tensor& slots, bool load) {
  const auto device = check_sorted_transfer_args(table, parts, sorted_rows, slots);
  TORCH_CHECK(device.is_cuda(), "parts are on ", device, " but table is on the GPU; put the "
              "parts and both indices on the table's GPU");
  c10::cuda::CUDAGuard guard(device);
  char* rows_base = cuda_impl::device_rows(table, "table", device);
  const int64_t rb = row_bytes(table);
  const int64_t pb = rb / static_cast<int64_t>(parts.size());
  std::vector<Pair> pairs;
  for (const auto k : c10::irange(parts.size())) {
    pairs.push_back({rows_base + static_cast<int64_t>(k) * pb,
                     static_cast<char*>(parts[k].mutable_data_ptr()), pb, !table.is_cuda(), rb});
  }
  Validation v(device);
  auto rows = v.add(sorted_rows, table.size(0), "sorted_rows");
  auto pos = v.add(slots, parts[0].size(0), "slots");
  auto index = DeviceIndex::presorted(rows, pos);
  if (load) {
    cuda_impl::gather_pairs(pairs, index, v);
  } else {
    cuda_impl::scatter_pairs(pairs, index, table.size(0), table, /*accumulate=*/false, v);
  }
  v.raise_if_bad();
}

TORCH_LIBRARY_IMPL(speedtorch_ops, CUDA, m) {
  m.impl("_sorted_transfer", &sorted_transfer_cuda);
  m.impl("pinned_gather", &pinned_gather_cuda);
  m.impl("pinned_gather_into", &pinned_gather_into_cuda);
  m.impl("pinned_scatter", &pinned_scatter_cuda);
  m.impl("optimizer_state_swap", &optimizer_state_swap_cuda);
}

}  // namespace speedtorch_ops
