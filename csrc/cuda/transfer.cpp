#include "transfer.h"

#include "speedtorch_ops/checks.h"

#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <atomic>
#include <limits>

namespace speedtorch_ops::cuda_impl {
namespace {

std::atomic<int64_t> g_sm_limit{0};

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

// Calls go(tables) for the pairs in groups of at most kMaxTables, gather (batch <- table) or
// scatter (table <- batch) direction.
template <typename Go>
void for_each_group(const std::vector<Pair>& pairs, bool to_batch, const Go& go) {
  for (size_t first = 0; first < pairs.size(); first += cuda::kMaxTables) {
    cuda::Tables t{};
    t.count = static_cast<int>(std::min<size_t>(cuda::kMaxTables, pairs.size() - first));
    for (int k = 0; k < t.count; ++k) {
      const Pair& p = pairs[first + k];
      if (to_batch) {
        t.set(k, p.batch, p.table, p.row_bytes, 0, p.table_stride);
      } else {
        t.set(k, p.table, p.batch, p.row_bytes, p.table_stride, 0);
      }
      t.row_major = t.row_major || p.table_stride > 0;
    }
    go(t);
  }
}

// Batches at least this long read host-mapped tables in sorted order, each distinct row once:
// PCIe reads in address order reach the link rate on multi-GiB tables, where random rows are
// capped by a row rate, and repeated rows cross the link once. Shorter batches, and tables in
// device memory (where a sort costs more than it saves), are read in the caller's order; rows the
// caller sorted always take the sorted read (it costs nothing then).
// Measured on the H100 (bench/sweep.py, 8 GiB table, 512 B rows): 8,192 rows 0.28 ms sorted vs
// 0.16 ms unsorted; 65,536 rows 1.72 vs 2.22 ms.
constexpr int64_t kSortedGatherMin = 32768;

// A scatter into device memory marks each row's last position in a scratch array of one int32
// per table row instead of sorting (a sort costs more than the copy itself there); above this
// many table rows (256 MiB of scratch) it sorts like a host-mapped table, where sorted writes
// also help PCIe.
constexpr int64_t kMarkLastMaxRows = int64_t{64} << 20;

}  // namespace

char* mapped_host_rows(const at::Tensor& table) {
  auto* ptr = static_cast<char*>(const_cast<void*>(table.const_data_ptr()));
  if (!table.is_cpu() || table.numel() == 0) return nullptr;
  cudaPointerAttributes attr{};
  const bool ok = cudaPointerGetAttributes(&attr, ptr) == cudaSuccess;
  (void)cudaGetLastError();
  return ok && attr.type == cudaMemoryTypeHost ? static_cast<char*>(attr.devicePointer) : nullptr;
}

char* device_rows(const at::Tensor& table, const std::string& name, const c10::Device& device) {
  if (table.is_cuda()) {
    TORCH_CHECK(table.device() == device, name, " is on ", table.device(), " but the rows go to ",
                device, "; keep the table (or pinned host memory), index and rows on one GPU");
    return static_cast<char*>(const_cast<void*>(table.const_data_ptr()));
  }
  TORCH_CHECK(table.is_cpu(), name, " must be a pinned CPU tensor or a CUDA tensor, got ",
              table.device());
  if (table.numel() == 0) return static_cast<char*>(const_cast<void*>(table.const_data_ptr()));
  char* rows = mapped_host_rows(table);
  TORCH_CHECK(rows != nullptr, name,
              " is in pageable host memory, but a CUDA index reads it in place: allocate it with "
              "speedtorch_ops.empty_pinned(...), pin it with speedtorch_ops.pin_(", name,
              "), or pass a CPU index");
  return rows;
}

void check_accumulate_dtype(at::ScalarType dtype) { (void)elem_of(dtype); }

cuda::Grid transfer_grid(const c10::Device& device) {
  const int sms = at::cuda::getDeviceProperties(device.index())->multiProcessorCount;
  const int64_t limit = g_sm_limit.load();
  if (limit > 0 && limit < sms) return {static_cast<int>(limit), true};
  return {sms, false};
}

int64_t set_transfer_sm_limit(int64_t sms) {
  TORCH_CHECK(sms >= 0, "sms must be >= 0 (0 removes the cap), got ", sms);
  return g_sm_limit.exchange(sms);
}

Validation::Validation(const c10::Device& device)
    : stream_(at::cuda::getCurrentCUDAStream(device.index())),
      grid_(transfer_grid(device)),
      status_(at::zeros({cuda::kStatusWords}, at::TensorOptions(at::kLong).device(device))) {}

at::Tensor Validation::add(const at::Tensor& index, int64_t rows, const char* name) {
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

void Validation::raise_if_bad() const {
  if (count_ == 0 || !index_wait()) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capture));
  if (capture != cudaStreamCaptureStatusNone) return;
  const auto host = status_.cpu();
  const int64_t* s = host.const_data_ptr<int64_t>();
  TORCH_CHECK(s[0] == 0, names_[s[1]], "[", s[2], "] = ", s[3], " is out of range for a table of ",
              rows_[s[1]], " rows; every index must be in [0, ", rows_[s[1]],
              "). Nothing was written.");
}

void DeviceIndex::sort() {
  auto [sorted, perm] = at::sort(rows_, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  sorted_slots_ = slots_ ? slots_->index_select(0, perm) : perm;
  sorted_ = std::move(sorted);
}

const at::Tensor& DeviceIndex::sorted() {
  if (!sorted_) sort();
  return *sorted_;
}

const at::Tensor& DeviceIndex::sorted_slots() {
  if (!sorted_) sort();
  return *sorted_slots_;
}

void gather_pairs(const std::vector<Pair>& pairs, DeviceIndex& index, const Validation& v) {
  const int64_t n = index.size();
  if (n == 0) return;
  const bool any_host = std::any_of(pairs.begin(), pairs.end(), [](const Pair& p) { return p.host; });
  const bool sorted = any_host && (index.presorted() || n >= kSortedGatherMin);
  for_each_group(pairs, /*to_batch=*/true, [&](const cuda::Tables& t) {
    if (sorted) {
      C10_CUDA_CHECK(cuda::launch_gather_sorted(t, index.sorted().const_data_ptr<int64_t>(),
                                                index.sorted_slots().const_data_ptr<int64_t>(), n,
                                                v.status(), v.grid(), v.stream()));
    } else {
      C10_CUDA_CHECK(cuda::launch_copy_rows(t, index.slots(), index.rows().const_data_ptr<int64_t>(),
                                            n, false, nullptr, v.status(), v.grid(), v.stream()));
    }
  });
}

void scatter_pairs(const std::vector<Pair>& pairs, DeviceIndex& index, int64_t min_rows,
                   const at::Tensor& like, bool accumulate, const Validation& v) {
  const int64_t n = index.size();
  if (n == 0) return;
  const bool any_host = std::any_of(pairs.begin(), pairs.end(), [](const Pair& p) { return p.host; });
  if (accumulate) {
    TORCH_INTERNAL_ASSERT(pairs.size() == 1);
    const Pair& p = pairs[0];
    C10_CUDA_CHECK(cuda::launch_accumulate_rows(
        p.table, index.sorted().const_data_ptr<int64_t>(), p.batch,
        index.sorted_slots().const_data_ptr<int64_t>(), n, p.row_bytes / like.element_size(),
        elem_of(like.scalar_type()), v.status(), v.grid(), v.stream()));
    return;
  }
  if (!any_host && index.slots() == nullptr && min_rows <= kMarkLastMaxRows &&
      n < std::numeric_limits<int32_t>::max()) {
    const auto& rows = index.rows();
    auto winner = at::empty({min_rows}, rows.options().dtype(at::kInt));
    C10_CUDA_CHECK(cudaMemsetAsync(winner.mutable_data_ptr(), 0xff, winner.nbytes(), v.stream()));
    C10_CUDA_CHECK(cuda::launch_mark_last(rows.const_data_ptr<int64_t>(), n,
                                          winner.mutable_data_ptr<int32_t>(), v.status(),
                                          v.stream()));
    for_each_group(pairs, /*to_batch=*/false, [&](const cuda::Tables& t) {
      C10_CUDA_CHECK(cuda::launch_copy_rows(t, rows.const_data_ptr<int64_t>(), nullptr, n,
                                            /*last_of_run=*/false, winner.const_data_ptr<int32_t>(),
                                            v.status(), v.grid(), v.stream()));
    });
    return;
  }
  for_each_group(pairs, /*to_batch=*/false, [&](const cuda::Tables& t) {
    C10_CUDA_CHECK(cuda::launch_copy_rows(t, index.sorted().const_data_ptr<int64_t>(),
                                          index.sorted_slots().const_data_ptr<int64_t>(), n,
                                          /*last_of_run=*/true, nullptr, v.status(), v.grid(),
                                          v.stream()));
  });
}

void transfer_with_host_indices(const std::vector<Pair>& pairs,
                                const std::optional<at::Tensor>& writeback_index,
                                const std::optional<at::Tensor>& load_index, int64_t min_rows,
                                const at::Tensor& like, bool accumulate,
                                const c10::Device& device) {
  const auto upload = [&](const at::Tensor& index) {
    const auto idx = index.to(at::kLong).contiguous();
    auto pinned = at::empty(idx.sizes(), idx.options().pinned_memory(true));
    return pinned.copy_(idx).to(device, /*non_blocking=*/true);  // torch keeps `pinned` alive
  };
  Validation v(device);  // nothing to validate on the device: the values were checked
  if (writeback_index) {
    DeviceIndex di(upload(*writeback_index), std::nullopt);
    scatter_pairs(pairs, di, min_rows, like, accumulate, v);
  }
  if (load_index) {
    DeviceIndex di(upload(*load_index), std::nullopt);
    gather_pairs(pairs, di, v);
  }
}

}  // namespace speedtorch_ops::cuda_impl
