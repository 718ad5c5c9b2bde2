// CUDA kernels of the ops: argument checks, device pointers, the stream, then the launchers of
// kernels.cu. Everything runs on the current stream under a device guard; nothing synchronizes
// the device. CUDA-graph safety: the transfers capture (indices stay on the device); the only
// host wait, reading back the index-validation status to raise in the failing call, is skipped
// while the stream is capturing, where a bad index writes nothing but cannot raise.
#include "kernels.h"
#include "speedtorch_ops/checks.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <array>
#include <limits>

namespace speedtorch_ops {
namespace {

// The address a kernel on `device` uses for `table`'s rows: device memory as is, or the mapped
// address of pinned host memory. Pageable host memory cannot be read by a kernel.
char* device_rows(const at::Tensor& table, const char* name, const c10::Device& device) {
  auto* ptr = static_cast<char*>(const_cast<void*>(table.const_data_ptr()));
  if (table.is_cuda()) {
    TORCH_CHECK(table.device() == device, name, " is on ", table.device(), " but the index is on ",
                device, "; keep the table (or pinned host memory), index and rows on one GPU");
    return ptr;
  }
  TORCH_CHECK(table.is_cpu(), name, " must be a pinned CPU tensor or a CUDA tensor, got ",
              table.device());
  if (table.numel() == 0) return ptr;
  cudaPointerAttributes attr{};
  const bool ok = cudaPointerGetAttributes(&attr, ptr) == cudaSuccess;
  (void)cudaGetLastError();
  TORCH_CHECK(ok && attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr, name,
              " is in pageable host memory, but a CUDA index reads it in place: allocate it with "
              "speedtorch_ops.empty_pinned(...), pin it with speedtorch_ops.pin_(", name,
              "), or pass a CPU index");
  return static_cast<char*>(attr.devicePointer);
}

void check_cuda_index(const at::Tensor& index, const char* name, const c10::Device& device) {
  check_index(index, name);
  TORCH_CHECK(index.device() == device, name, " must be on ", device, " (where the rows go), got ",
              index.device(), "; pass ", name, ".to('", device, "')");
}

cuda::Elem elem_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cuda::Elem::kF32;
    case at::kDouble: return cuda::Elem::kF64;
    case at::kHalf: return cuda::Elem::kF16;
    case at::kBFloat16: return cuda::Elem::kBF16;
    case at::kChar: return cuda::Elem::kI8;
    case at::kByte: return cuda::Elem::kU8;
    case at::kShort: return cuda::Elem::kI16;
    case at::kInt: return cuda::Elem::kI32;
    case at::kLong: return cuda::Elem::kI64;
    case at::kBool: return cuda::Elem::kBool;
    default:
      TORCH_CHECK(false, "accumulate=True supports float, half, bfloat16, double, int8, uint8, "
                  "int16, int32, int64 and bool tables, got ", t);
  }
}

// One call's index validation: every index is checked on the device before any transfer kernel
// runs, and the transfer kernels write nothing if one was bad.
class Validation {
 public:
  explicit Validation(const c10::Device& device)
      : stream_(at::cuda::getCurrentCUDAStream(device.index())),
        sm_count_(at::cuda::getDeviceProperties(device.index())->multiProcessorCount),
        status_(at::zeros({cuda::kStatusWords}, at::TensorOptions(at::kLong).device(device))) {}

  // Returns the index as contiguous int64 on the device, queued for validation.
  at::Tensor add(const at::Tensor& index, int64_t rows, const char* name) {
    auto idx = index.to(at::kLong).contiguous();
    names_[count_] = name;
    rows_[count_] = rows;
    if (idx.numel() > 0) {
      C10_CUDA_CHECK(cuda::launch_validate(idx.const_data_ptr<int64_t>(), idx.numel(), rows,
                                           count_, status_.mutable_data_ptr<int64_t>(), stream_));
    }
    ++count_;
    return idx;
  }

  const int64_t* status() const { return status_.const_data_ptr<int64_t>(); }
  cudaStream_t stream() const { return stream_; }
  int sm_count() const { return sm_count_; }

  // Raises for a bad index. Waits for this stream only; skipped while capturing a graph and
  // for callers that validated on the host (set_index_wait(false)).
  void raise_if_bad() const {
    if (!index_wait()) return;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capture));
    if (capture != cudaStreamCaptureStatusNone) return;
    const auto host = status_.cpu();
    const int64_t* s = host.const_data_ptr<int64_t>();
    TORCH_CHECK(s[0] == 0, names_[s[1]], "[", s[2], "] = ", s[3], " is out of range for a table of ",
                rows_[s[1]], " rows; every index must be in [0, ", rows_[s[1]],
                "). Nothing was written.");
  }

 private:
  cudaStream_t stream_;
  int sm_count_;
  at::Tensor status_;
  std::array<const char*, 2> names_{};
  std::array<int64_t, 2> rows_{};
  int count_ = 0;
};

// Batches at least this long read a host-mapped table in sorted order, each distinct row once:
// PCIe reads in address order reach the link rate on multi-GiB tables, where random rows are
// capped by a row rate, and repeated rows cross the link once. Shorter batches, and tables in
// device memory (where a sort costs more than it saves), are read in the caller's order.
constexpr int64_t kSortedGatherMin = 4096;

void gather_rows_cuda(const char* src, bool host_table, int64_t rb, const at::Tensor& idx,
                      at::Tensor& out, const Validation& v) {
  if (idx.numel() == 0 || rb == 0) return;
  auto* dst = static_cast<char*>(out.mutable_data_ptr());
  if (host_table && idx.numel() >= kSortedGatherMin) {
    const auto [sorted, perm] = at::sort(idx, /*stable=*/false, /*dim=*/0, /*descending=*/false);
    C10_CUDA_CHECK(cuda::launch_gather_sorted(dst, src, sorted.const_data_ptr<int64_t>(),
                                              perm.const_data_ptr<int64_t>(), idx.numel(), rb,
                                              v.status(), v.sm_count(), v.stream()));
    return;
  }
  C10_CUDA_CHECK(cuda::launch_copy_rows(dst, nullptr, src, idx.const_data_ptr<int64_t>(),
                                        idx.numel(), rb, false, nullptr, v.status(), v.sm_count(),
                                        v.stream()));
}

// A scatter into device memory marks each row's last position in a scratch array of one int32
// per table row instead of sorting (a sort costs more than the copy itself there); above this
// many table rows (256 MiB of scratch) it sorts like a host-mapped table, where sorted writes
// also help PCIe.
constexpr int64_t kMarkLastMaxRows = int64_t{64} << 20;

// Scatter with deterministic duplicates: the last one in the caller's order wins (marked, or
// found by a stable sort), and accumulate adds each row's values in index order (sorted).
void scatter_rows_cuda(char* dst, const at::Tensor& table, const at::Tensor& idx,
                       const at::Tensor& src, bool accumulate, const Validation& v) {
  const int64_t rb = row_bytes(table);
  if (idx.numel() == 0 || rb == 0) return;
  if (!accumulate && table.is_cuda() && table.size(0) <= kMarkLastMaxRows &&
      idx.numel() < std::numeric_limits<int32_t>::max()) {
    auto winner = at::empty({table.size(0)}, idx.options().dtype(at::kInt));
    C10_CUDA_CHECK(cudaMemsetAsync(winner.mutable_data_ptr(), 0xff, winner.nbytes(), v.stream()));
    C10_CUDA_CHECK(cuda::launch_mark_last(idx.const_data_ptr<int64_t>(), idx.numel(),
                                          winner.mutable_data_ptr<int32_t>(), v.status(),
                                          v.stream()));
    C10_CUDA_CHECK(cuda::launch_copy_rows(
        dst, idx.const_data_ptr<int64_t>(), static_cast<const char*>(src.const_data_ptr()),
        nullptr, idx.numel(), rb, /*last_of_run=*/false, winner.const_data_ptr<int32_t>(),
        v.status(), v.sm_count(), v.stream()));
    return;
  }
  const auto [sorted, perm] = at::sort(idx, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const auto* s = static_cast<const char*>(src.const_data_ptr());
  if (accumulate) {
    C10_CUDA_CHECK(cuda::launch_accumulate_rows(
        dst, sorted.const_data_ptr<int64_t>(), s, perm.const_data_ptr<int64_t>(), idx.numel(),
        rb / table.element_size(), elem_of(table.scalar_type()), v.status(), v.sm_count(),
        v.stream()));
  } else {
    C10_CUDA_CHECK(cuda::launch_copy_rows(dst, sorted.const_data_ptr<int64_t>(), s,
                                          perm.const_data_ptr<int64_t>(), idx.numel(), rb,
                                          /*last_of_run=*/true, nullptr, v.status(),
                                          v.sm_count(), v.stream()));
  }
}

}  // namespace

void pinned_gather_into_cuda(const at::Tensor& table, const at::Tensor& index, at::Tensor& out) {
  check_table(table, "table");
  const auto device = index.device();
  TORCH_CHECK(index.is_cuda(), "index is on ", index.device(), " but table or out is on the GPU; "
              "pass a CUDA index (rows land on index's device), or keep all on the CPU");
  check_cuda_index(index, "index", device);
  check_rows_like(out, "out", table, index.numel(), device);
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous (it is written in place)");
  check_no_overlap(out, "out", table, "table");
  check_no_overlap(out, "out", index, "index");
  c10::cuda::CUDAGuard guard(device);
  const char* src = device_rows(table, "table", device);
  Validation v(device);
  const auto idx = v.add(index, table.size(0), "index");
  gather_rows_cuda(src, !table.is_cuda(), row_bytes(table), idx, out, v);
  v.raise_if_bad();
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
  TORCH_CHECK(index.is_cuda(), "index is on ", index.device(), " but table or src is on the GPU; "
              "pass a CUDA index on src's device, or keep all on the CPU");
  const auto device = index.device();
  check_cuda_index(index, "index", device);
  check_rows_like(src, "src", table, index.numel(), device);
  check_no_overlap(table, "table", src, "src");
  check_no_overlap(table, "table", index, "index");
  if (accumulate) (void)elem_of(table.scalar_type());
  c10::cuda::CUDAGuard guard(device);
  char* dst = device_rows(table, "table", device);
  Validation v(device);
  const auto idx = v.add(index, table.size(0), "index");
  scatter_rows_cuda(dst, table, idx, src.contiguous(), accumulate, v);
  v.raise_if_bad();
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
  if (writeback_index) check_cuda_index(*writeback_index, "writeback_index", device);
  if (load_index) check_cuda_index(*load_index, "load_index", device);
  c10::cuda::CUDAGuard guard(device);
  std::vector<char*> rows;
  int64_t min_rows = std::numeric_limits<int64_t>::max();
  for (const auto k : c10::irange(stores.size())) {
    rows.push_back(device_rows(stores[k], ("stores[" + std::to_string(k) + "]").c_str(), device));
    min_rows = std::min(min_rows, stores[k].size(0));
  }
  Validation v(device);
  const auto wb = writeback_index ? std::optional(v.add(*writeback_index, min_rows, "writeback_index"))
                                  : std::nullopt;
  const auto load =
      load_index ? std::optional(v.add(*load_index, min_rows, "load_index")) : std::nullopt;
  // Per pair, the write-back is queued before the load on the same stream, so a row in both
  // indices is written back before it is loaded.
  for (const auto k : c10::irange(stores.size())) {
    auto b = batch[k];
    if (wb) scatter_rows_cuda(rows[k], stores[k], *wb, b, /*accumulate=*/false, v);
    if (load) gather_rows_cuda(rows[k], !stores[k].is_cuda(), row_bytes(stores[k]), *load, b, v);
  }
  v.raise_if_bad();
}

TORCH_LIBRARY_IMPL(speedtorch_ops, CUDA, m) {
  m.impl("pinned_gather", &pinned_gather_cuda);
  m.impl("pinned_gather_into", &pinned_gather_into_cuda);
  m.impl("pinned_scatter", &pinned_scatter_cuda);
  m.impl("optimizer_state_swap", &optimizer_state_swap_cuda);
}

}  // namespace speedtorch_ops
