// CUDA kernels of the ops: argument checks, then the one routing decision (route.h), then the
// path it names. Everything runs on the current stream under a device guard; nothing
// synchronizes the device. CUDA-graph safety: with CUDA indices and tables a kernel can address
// the transfers capture; bounds_check='raise' cannot wait while capturing, so a captured call
// reports a bad index like a deferred one (deferred.h); paths with host work refuse to capture.
#include "common/bounds_check.h"
#include "common/checks.h"
#include "copy/addressing.h"
#include "copy/deferred.h"
#include "copy/pairs.h"
#include "copy/route.h"
#include "copy/validation.h"
#include "hybrid/hybrid.h"
#include "hybrid/tuner.h"
#include "transfer/transfer_checks.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <string>

namespace speedtorch_ops {
namespace {

using torch_cuda::DeviceIndex;
using torch_cuda::Pair;
using torch_cuda::Validation;
using route::Path;

void check_index_on(const at::Tensor& index, const char* name, const c10::Device& device) {
  check_index(index, name);
  TORCH_CHECK(index.device() == device || index.is_cpu(), name, " must be on ", device,
              " (where the rows go) or on the CPU, got ", index.device());
}

bool capturing(const c10::Device& device) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(device.index()), &capture));
  return capture != cudaStreamCaptureStatusNone;
}

// The tables of one call, addressed for kernels on one device, with the names errors use.
struct TableSet {
  std::vector<std::string> names;
  std::vector<torch_cuda::Addressed> at;
  std::vector<route::Table> routed;  // what route::describe reads of each
};

TableSet address_all(at::TensorList tables, bool listed, const c10::Device& device) {
  TableSet t;
  for (const auto k : c10::irange(tables.size())) {
    t.names.push_back(listed ? "stores[" + std::to_string(k) + "]" : "table");
    t.at.push_back(torch_cuda::address(tables[k], t.names.back(), device));
    t.routed.push_back({t.at.back().memory, static_cast<int64_t>(tables[k].nbytes()),
                        row_bytes(tables[k])});
  }
  return t;
}

// Raises for a path that refuses the call, naming the table or index at fault and the fix.
void raise_if_refused(Path path, const TableSet& t, const c10::Device& device) {
  if (!route::refused(path)) return;
  std::string pageable;
  for (const auto k : c10::irange(t.at.size())) {
    if (t.at[k].memory == route::Memory::kPageableHost && pageable.empty()) pageable = t.names[k];
  }
  const std::string pin = "; allocate it with speedtorch_ops.empty_pinned(...) or pin it with "
                          "speedtorch_ops.pin_(" + pageable + ")";
  TORCH_CHECK(path != Path::kRefusedMixedTables, pageable, " is in pageable host memory, which "
              "no kernel can address, and other tables are on ", device, pin,
              ", or keep every table on the host");
  TORCH_CHECK(path != Path::kRefusedCapture || pageable.empty(), pageable, " is in pageable host "
              "memory, so its rows move through CPU threads, which a CUDA graph cannot capture",
              pin, " to capture the transfer");
  TORCH_CHECK(path != Path::kRefusedCapture, "a CPU index cannot be used while a CUDA graph is "
              "being captured (the host takes part in the transfer); pass the index on ", device);
  TORCH_CHECK(false, "the rows must be on the GPU when a table or an index is; pass them on ",
              device);
}

// The common body of the ops: optional write-back of batch to rows writeback_index, then
// optional load of rows load_index into batch, for every (table, batch) pair. Arguments are
// checked except index values.
void transfer(at::TensorList tables, at::TensorList batch,
              const std::optional<at::Tensor>& writeback_index,
              const std::optional<at::Tensor>& load_index, bool accumulate, bool listed,
              BoundsCheck mode, const c10::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  // A 'prechecked' caller (a store's step of several calls) must not stop halfway for another
  // call's bad index: it is reported to the next call that checks.
  if (mode != BoundsCheck::kPrechecked) torch_cuda::raise_deferred(device);
  const auto& any_index = writeback_index ? *writeback_index : *load_index;
  TORCH_CHECK(!writeback_index || !load_index ||
              writeback_index->device() == load_index->device(),
              "writeback_index and load_index must both be on the CPU or both on ", device);
  const TableSet t = address_all(tables, listed, device);
  int64_t min_rows = std::numeric_limits<int64_t>::max();
  for (const auto& table : tables) min_rows = std::min(min_rows, table.size(0));
  const int64_t n_wb = writeback_index ? writeback_index->numel() : 0;
  route::Call asked;
  asked.load_rows = load_index ? load_index->numel() : 0;
  asked.writeback_rows = n_wb;
  asked.index_on_device = any_index.is_cuda();
  asked.rows_on_device = true;
  asked.capturing = capturing(device);
  asked.may_wait = mode != BoundsCheck::kPrechecked;
  asked.hybrid_share = torch_cuda::fixed_share();
  asked.hybrid_min_span = torch_cuda::hybrid_min_span();
  const route::Call call = route::describe(t.routed, asked);
  const Path path = route::route(call);
  raise_if_refused(path, t, device);

  std::vector<Pair> pairs;
  for (const auto k : c10::irange(tables.size())) {
    pairs.push_back({t.at[k].rows, static_cast<char*>(const_cast<void*>(batch[k].const_data_ptr())),
                     row_bytes(tables[k])});
  }
  // Errors name the caller's argument: pinned_gather's and pinned_scatter's is `index`.
  const char* wb_name = listed ? "writeback_index" : "index";
  const char* load_name = listed ? "load_index" : "index";
  // The paths that read the indices on the host bring a CUDA index there (that copy waits for
  // the current stream, as the CPU side must before it touches the rows anyway) and check
  // the values there.
  if (route::reads_index_on_host(path)) {
    torch_cuda::hybrid_transfer(tables.vec(), pairs, writeback_index, load_index, accumulate,
                               path, device, {min_rows, wb_name, load_name});
    return;
  }
  // A write-back alone by a CUDA index into tables in device memory: one kernel does it all,
  // as such a call's time is the host's time to queue the separate kernels.
  if (path == Path::kDevice && writeback_index && !load_index && writeback_index->is_cuda() &&
      !accumulate && torch_cuda::can_scatter_fused(pairs, n_wb, min_rows, call.moved_bytes,
                                                 call.capturing, device) &&
      torch_cuda::scatter_fused(pairs, *writeback_index, min_rows, wb_name,
                               torch_cuda::report_for(mode, call.capturing), device)) {
    return;
  }
  Validation v(device, torch_cuda::report_for(mode, call.capturing));
  const auto on_device = [&](const std::optional<at::Tensor>& index, const char* name) {
    std::optional<DeviceIndex> di;
    if (!index) return di;
    if (index->is_cuda()) {
      di.emplace(v.add(*index, min_rows, name), std::nullopt, min_rows);
    } else {
      // A CPU index is checked on the host (no wait) and uploaded.
      const auto host = index->contiguous();
      check_index_values(host, min_rows, name);
      di.emplace(DeviceIndex::upload(host, device, min_rows));
    }
    return di;
  };
  auto wb = on_device(writeback_index, wb_name);
  auto load = on_device(load_index, load_name);
  // Per pair, the write-back is queued before the load on the same stream, so a row in both
  // indices is written back before it is loaded.
  if (wb) torch_cuda::scatter_pairs(pairs, *wb, path, tables[0], accumulate, v);
  if (load) torch_cuda::gather_pairs(pairs, *load, path, v);
  v.raise_if_bad();
}

}  // namespace

void pinned_gather_into_cuda(const at::Tensor& table, const at::Tensor& index, at::Tensor& out,
                             c10::string_view bounds_check) {
  const auto mode = parse_bounds_check(bounds_check);
  TORCH_CHECK(out.is_cuda() || index.is_cuda(), "index is on ", index.device(), " and out on ",
              out.device(), " but table is on the GPU; keep all on the CPU, or put out on the GPU");
  const auto device = out.is_cuda() ? out.device() : index.device();
  check_index_on(index, "index", device);
  check_gather_into_args(table, index, out, device);
  transfer({table}, {out}, std::nullopt, index, /*accumulate=*/false, /*listed=*/false, mode,
           device);
}

at::Tensor pinned_gather_cuda(const at::Tensor& table, const at::Tensor& index,
                              c10::string_view bounds_check) {
  TORCH_CHECK(index.is_cuda(), "index is on ", index.device(), " but table is on the GPU; pass "
              "index.to('", table.device(), "') (rows land on index's device)");
  auto out = gather_output(table, index);
  pinned_gather_into_cuda(table, index, out, bounds_check);
  return out;
}

void pinned_scatter_cuda(at::Tensor& table, const at::Tensor& index, const at::Tensor& src,
                         bool accumulate, c10::string_view bounds_check) {
  const auto mode = parse_bounds_check(bounds_check);
  TORCH_CHECK(src.is_cuda() || index.is_cuda(), "index is on ", index.device(), " and src on ",
              src.device(), " but table is on the GPU; keep all on the CPU, or put src on the "
              "GPU");
  const auto device = index.is_cuda() ? index.device() : src.device();
  check_index_on(index, "index", device);
  check_scatter_args(table, index, src, accumulate, device);
  transfer({table}, {src.contiguous()}, index, std::nullopt, accumulate, /*listed=*/false, mode,
           device);
}

void optimizer_state_swap_cuda(at::TensorList stores, at::TensorList batch,
                               const std::optional<at::Tensor>& writeback_index,
                               const std::optional<at::Tensor>& load_index,
                               c10::string_view bounds_check) {
  const auto mode = parse_bounds_check(bounds_check);
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
  if (stores.empty() || (!writeback_index && !load_index)) return;
  transfer(stores, batch, writeback_index, load_index, /*accumulate=*/false, /*listed=*/true, mode,
           device);
}

void sorted_transfer_cuda(at::Tensor& table, at::TensorList parts, const at::Tensor& sorted_rows,
                          const at::Tensor& slots, bool load,
                          const std::optional<at::Tensor>& count,
                          c10::string_view bounds_check, int64_t sms) {
  const auto mode = parse_bounds_check(bounds_check);
  const auto device = check_sorted_transfer_args(table, parts, sorted_rows, slots, count, sms);
  TORCH_CHECK(device.is_cuda(), "parts are on ", device, " but table is on the GPU; put the "
              "parts and both indices on the table's GPU");
  c10::cuda::CUDAGuard guard(device);
  if (mode != BoundsCheck::kPrechecked) torch_cuda::raise_deferred(device);
  const auto at = torch_cuda::address(table, "table", device);
  route::Call asked;
  asked.load_rows = load ? sorted_rows.numel() : 0;
  asked.writeback_rows = load ? 0 : sorted_rows.numel();
  asked.index_on_device = asked.rows_on_device = asked.presorted = true;
  asked.capturing = capturing(device);
  asked.may_wait = mode != BoundsCheck::kPrechecked;
  const route::Call call = route::describe(
      {{at.memory, static_cast<int64_t>(table.nbytes()), row_bytes(table)}}, asked);
  const Path path = route::route(call);
  TORCH_CHECK(path != Path::kHostStaged && path != Path::kRefusedCapture, "table is in pageable "
              "host memory, which _sorted_transfer cannot reach from the GPU; allocate it with "
              "speedtorch_ops.empty_pinned(...) or pin it with speedtorch_ops.pin_(table), or move "
              "its rows with pinned_gather_into / pinned_scatter (they take such tables through "
              "the CPU)");
  const int64_t rb = row_bytes(table);
  const int64_t pb = rb / static_cast<int64_t>(parts.size());
  std::vector<Pair> pairs;
  for (const auto k : c10::irange(parts.size())) {
    pairs.push_back({at.rows + static_cast<int64_t>(k) * pb,
                     static_cast<char*>(parts[k].mutable_data_ptr()), pb, rb});
  }
  Validation v(device, torch_cuda::report_for(mode, call.capturing), sms);
  // A count stays on the device: the kernels read it, the host never does.
  const int64_t* limit = count ? count->const_data_ptr<int64_t>() : nullptr;
  auto rows = v.add(sorted_rows, table.size(0), "sorted_rows", limit);
  auto pos = v.add(slots, parts[0].size(0), "slots", limit);
  auto index = DeviceIndex::presorted(rows, pos, limit);
  if (load) {
    torch_cuda::gather_pairs(pairs, index, path, v);
  } else {
    torch_cuda::scatter_pairs(pairs, index, path, table, /*accumulate=*/false, v);
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
