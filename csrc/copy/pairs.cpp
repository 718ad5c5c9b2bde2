#include "copy/pairs.h"

#include "common/elem_of.h"
#include "copy/launch.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <limits>

namespace speedtorch_ops::torch_cuda {
namespace {


// Calls go(tables) for the pairs in groups of at most kMaxTables, gather (batch <- table) or
// scatter (table <- batch) direction.
template <typename Go>
void for_each_group(const std::vector<Pair>& pairs, bool to_batch, const Go& go) {
  for (size_t first = 0; first < pairs.size(); first += kernels::kMaxTables) {
    kernels::Tables t{};
    t.count = static_cast<int>(std::min<size_t>(kernels::kMaxTables, pairs.size() - first));
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

}  // namespace

DeviceIndex DeviceIndex::presorted(const at::Tensor& sorted_rows, const at::Tensor& slots,
                                   const int64_t* limit) {
  DeviceIndex index(sorted_rows, slots);
  index.sorted_ = sorted_rows;
  index.sorted_slots_ = slots;
  index.presorted_ = true;
  index.limit_ = limit;
  return index;
}

DeviceIndex DeviceIndex::upload(const at::Tensor& host_index, const c10::Device& device,
                                int64_t bound) {
  const auto idx = host_index.to(at::kLong).contiguous();
  auto pinned = at::empty(idx.sizes(), idx.options().pinned_memory(true));
  // torch's caching host allocator keeps `pinned` alive until the copy has run.
  return DeviceIndex(pinned.copy_(idx).to(device, /*non_blocking=*/true), std::nullopt, bound);
}

void DeviceIndex::sort() {
  auto [sorted, slots] = sort_rows(rows_, slots_, bound_);
  sorted_ = std::move(sorted);
  sorted_slots_ = std::move(slots);
}

std::pair<at::Tensor, at::Tensor> sort_rows(const at::Tensor& rows,
                                            const std::optional<at::Tensor>& slots,
                                            int64_t bound) {
  // The rows' significant bits only: a 1 M-row table sorts 20 bits in 3 radix passes, where a
  // full int64 sort (at::sort) takes 8 (see docs/decisions.md, "Sorting row numbers").
  const int64_t n = rows.numel();
  if (n == 0) return {at::empty_like(rows), slots ? *slots : at::empty_like(rows)};
  if (n > std::numeric_limits<int32_t>::max()) {  // past cub's item count
    auto [sorted, perm] = at::sort(rows, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    return {std::move(sorted), slots ? slots->index_select(0, perm) : perm};
  }
  int bits = 1;
  while (bits < 64 && (bound - 1) >> bits != 0) ++bits;
  const auto stream = at::cuda::getCurrentCUDAStream(rows.device().index());
  const auto values = slots ? slots->contiguous() : at::arange(n, rows.options());
  auto keys_out = at::empty_like(rows);
  auto values_out = at::empty_like(values);
  size_t temp_bytes = 0;
  C10_CUDA_CHECK(kernels::sort_pairs(nullptr, &temp_bytes, nullptr, nullptr, nullptr, nullptr, n,
                                  bits, stream));
  auto temp = at::empty({static_cast<int64_t>(temp_bytes)}, rows.options().dtype(at::kByte));
  C10_CUDA_CHECK(kernels::sort_pairs(temp.mutable_data_ptr(), &temp_bytes,
                                  rows.const_data_ptr<int64_t>(),
                                  keys_out.mutable_data_ptr<int64_t>(),
                                  values.const_data_ptr<int64_t>(),
                                  values_out.mutable_data_ptr<int64_t>(), n, bits, stream));
  return {std::move(keys_out), std::move(values_out)};
}

const at::Tensor& DeviceIndex::sorted() {
  if (!sorted_) sort();
  return *sorted_;
}

const at::Tensor& DeviceIndex::sorted_slots() {
  if (!sorted_) sort();
  return *sorted_slots_;
}

void gather_pairs(const std::vector<Pair>& pairs, DeviceIndex& index, route::Path path,
                  const Validation& v) {
  const int64_t n = index.size();
  if (n == 0) return;
  for_each_group(pairs, /*to_batch=*/true, [&](const kernels::Tables& t) {
    if (path == route::Path::kZeroCopySorted) {
      C10_CUDA_CHECK(kernels::launch_gather_sorted(t, index.sorted().const_data_ptr<int64_t>(),
                                                index.sorted_slots().const_data_ptr<int64_t>(), n,
                                                v.status(), v.grid(), v.stream(), index.limit()));
    } else {
      C10_CUDA_CHECK(kernels::launch_copy_rows(t, index.slots(), index.rows().const_data_ptr<int64_t>(),
                                            n, false, kernels::LastOf{}, v.status(), v.grid(), v.stream(),
                                            index.limit()));
    }
  });
}

void scatter_pairs(const std::vector<Pair>& pairs, DeviceIndex& index, route::Path path,
                   const at::Tensor& like, bool accumulate, const Validation& v) {
  const int64_t n = index.size();
  if (n == 0) return;
  if (accumulate) {
    TORCH_INTERNAL_ASSERT(pairs.size() == 1 && index.limit() == nullptr);
    const Pair& p = pairs[0];
    C10_CUDA_CHECK(kernels::launch_accumulate_rows(
        p.table, index.sorted().const_data_ptr<int64_t>(), p.batch,
        index.sorted_slots().const_data_ptr<int64_t>(), n, p.row_bytes / like.element_size(),
        elem_of(like.scalar_type()), v.status(), v.grid(), v.stream()));
    return;
  }
  if (path != route::Path::kZeroCopySorted && index.slots() == nullptr &&
      index.limit() == nullptr && kernels::can_mark_last(n, index.bound())) {
    const auto& rows = index.rows();
    const int64_t bound = index.bound();
    auto scratch = at::empty({kernels::last_of_bytes(n, bound)}, rows.options().dtype(at::kByte));
    kernels::LastOf last_of;
    C10_CUDA_CHECK(kernels::launch_mark_last(rows.const_data_ptr<int64_t>(), n, bound,
                                          scratch.mutable_data_ptr(), v.status(), v.stream(),
                                          &last_of));
    for_each_group(pairs, /*to_batch=*/false, [&](const kernels::Tables& t) {
      C10_CUDA_CHECK(kernels::launch_copy_rows(t, rows.const_data_ptr<int64_t>(), nullptr, n,
                                            /*last_of_run=*/false, last_of, v.status(), v.grid(),
                                            v.stream()));
    });
    return;
  }
  // Writes routed in sorted order (huge host-mapped tables, where PCIe writes in address order
  // beat the row-rate cap of random ones), and rows given with their slots or a limit: the
  // last position of each run of equal rows writes it.
  for_each_group(pairs, /*to_batch=*/false, [&](const kernels::Tables& t) {
    C10_CUDA_CHECK(kernels::launch_copy_rows(t, index.sorted().const_data_ptr<int64_t>(),
                                          index.sorted_slots().const_data_ptr<int64_t>(), n,
                                          /*last_of_run=*/true, kernels::LastOf{}, v.status(), v.grid(),
                                          v.stream(), index.limit()));
  });
}

// Write-backs of more bytes or positions than these take the separate kernels: their copy
// kernel, in a grid that need not be resident at once, moves bytes faster, and past these
// sizes a call's GPU time is longer than its host time, which the one kernel saves. See
// docs/decisions.md, "Fused CUDA-table scatters".
constexpr int64_t kFusedMaxBytes = int64_t{32} << 20;
constexpr int64_t kFusedMaxPositions = int64_t{1} << 20;

bool can_scatter_fused(const std::vector<Pair>& pairs, int64_t n, int64_t rows,
                       int64_t moved_bytes, bool capturing, const c10::Device& device) {
  return n > 0 && n <= kFusedMaxPositions && moved_bytes <= kFusedMaxBytes &&
         kernels::can_mark_last(n, rows) && !capturing &&
         pairs.size() <= static_cast<size_t>(kernels::kMaxTables) &&
         !transfer_grid(device).capped && kernels::fused_scatter_supported(device.index());
}

bool scatter_fused(const std::vector<Pair>& pairs, const at::Tensor& index, int64_t rows,
                   const char* name, Report report, const c10::Device& device) {
  TORCH_INTERNAL_ASSERT(pairs.size() <= static_cast<size_t>(kernels::kMaxTables));
  const auto idx = index.to(at::kLong).contiguous();
  const int64_t n = idx.numel();
  auto v = Validation::fused(device, report, kernels::last_of_bytes(n, rows));
  const kernels::Deferred deferred = v.add_checked_by_kernel(name, rows);
  cudaError_t err = cudaSuccess;
  for_each_group(pairs, /*to_batch=*/false, [&](const kernels::Tables& t) {
    err = kernels::launch_scatter_fused(t, idx.const_data_ptr<int64_t>(), n, rows, /*arg=*/0,
                                     v.scratch(), v.mutable_status(), deferred, device.index(),
                                     v.grid().sms, v.stream());
  });
  if (err == cudaErrorCooperativeLaunchTooLarge || err == cudaErrorNotSupported) {
    // A refused launch queues nothing; the caller takes the separate kernels. Its error is
    // also the runtime's last error, which a later launch check would otherwise report.
    (void)cudaGetLastError();
    return false;
  }
  C10_CUDA_CHECK(err);
  v.raise_if_bad();
  return true;
}

}  // namespace speedtorch_ops::torch_cuda
