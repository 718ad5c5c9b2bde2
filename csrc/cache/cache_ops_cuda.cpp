// CUDA entry points of the row cache's ops (registration.cpp has their contracts): a row cache's step
// planned on the device in a few launches, with nothing read back to the host.
#include "cache/cache_checks.h"
#include "cache/cache_kernels.h"
#include "common/checks.h"
#include "copy/pairs.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

namespace speedtorch_ops {
namespace {

cudaStream_t stream_of(const at::Tensor& t) {
  return at::cuda::getCurrentCUDAStream(t.device().index());
}

// At least one byte, so a launcher never mistakes the scratch for a size query.
at::Tensor scratch(size_t bytes, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))},
                   like.options().dtype(at::kByte));
}

std::tuple<at::Tensor, at::Tensor> sort_ids_cuda(const at::Tensor& keys, int64_t bound) {
  check_sort_ids_args(keys, "keys", bound);
  const c10::cuda::CUDAGuard guard(keys.device());
  return torch_cuda::sort_rows(keys, std::nullopt, bound);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> distinct_cuda(
    const at::Tensor& index, int64_t bound) {
  check_sort_ids_args(index, "index", bound);
  check_items(index, "index");
  const c10::cuda::CUDAGuard guard(index.device());
  const int64_t n = index.numel();
  auto ids = at::zeros({n}, index.options());
  auto inverse = at::empty({n}, index.options());
  auto count = at::empty({1}, index.options());
  auto starts = at::empty({n + 1}, index.options());
  auto [sorted, perm] = torch_cuda::sort_rows(index, std::nullopt, bound);
  auto rank = at::empty({n}, index.options());
  size_t bytes = 0;
  C10_CUDA_CHECK(kernels::launch_unique_sorted(nullptr, &bytes, nullptr, nullptr, nullptr, n,
                                            nullptr, nullptr, nullptr, nullptr, stream_of(index)));
  auto temp = scratch(bytes, index);
  C10_CUDA_CHECK(kernels::launch_unique_sorted(
      temp.mutable_data_ptr(), &bytes, sorted.const_data_ptr<int64_t>(),
      perm.const_data_ptr<int64_t>(), rank.mutable_data_ptr<int64_t>(), n,
      ids.mutable_data_ptr<int64_t>(), inverse.mutable_data_ptr<int64_t>(),
      count.mutable_data_ptr<int64_t>(), starts.mutable_data_ptr<int64_t>(), stream_of(index)));
  return {ids, inverse, count, perm, starts};
}

std::tuple<at::Tensor, at::Tensor> partition_cuda(const at::Tensor& flags) {
  check_partition_args(flags);
  const c10::cuda::CUDAGuard guard(flags.device());
  const int64_t n = flags.numel();
  auto order = at::empty({n}, flags.options().dtype(at::kLong));
  auto count = at::empty({1}, flags.options().dtype(at::kLong));
  size_t bytes = 0;
  C10_CUDA_CHECK(kernels::launch_partition(nullptr, &bytes, nullptr, n, nullptr, nullptr,
                                        stream_of(flags)));
  auto temp = scratch(bytes, flags);
  C10_CUDA_CHECK(kernels::launch_partition(temp.mutable_data_ptr(), &bytes,
                                        flags.const_data_ptr<bool>(), n,
                                        order.mutable_data_ptr<int64_t>(),
                                        count.mutable_data_ptr<int64_t>(), stream_of(flags)));
  return {order, count};
}

std::tuple<at::Tensor, at::Tensor> cache_lookup_cuda(const at::Tensor& ids, const at::Tensor& count,
                                                     const at::Tensor& slot_of, at::Tensor& freq,
                                                     int64_t scratch_slot) {
  check_cache_lookup_args(ids, count, slot_of, freq, scratch_slot);
  const c10::cuda::CUDAGuard guard(ids.device());
  const int64_t n = ids.numel();
  auto at_slot = at::empty({n}, ids.options());
  auto miss = at::empty({n}, ids.options().dtype(at::kBool));
  C10_CUDA_CHECK(kernels::launch_cache_lookup(
      ids.const_data_ptr<int64_t>(), count.const_data_ptr<int64_t>(), n,
      slot_of.const_data_ptr<int32_t>(), slot_of.numel(), freq.mutable_data_ptr<float>(),
      scratch_slot,
      at_slot.mutable_data_ptr<int64_t>(), miss.mutable_data_ptr<bool>(), stream_of(ids)));
  return {at_slot, miss};
}

std::tuple<at::Tensor, at::Tensor> coldest_slots_cuda(const at::Tensor& id_of,
                                                      const at::Tensor& freq, const at::Tensor& at,
                                                      int64_t k,
                                                      const c10::optional<at::Tensor>& hand,
                                                      int64_t window) {
  check_coldest_slots_args(id_of, freq, at, k, hand, window);
  const c10::cuda::CUDAGuard guard(id_of.device());
  const int64_t slots = id_of.numel();
  const int64_t w = window > 0 ? window : slots;
  int64_t* hand_ptr = window > 0 ? hand->mutable_data_ptr<int64_t>() : nullptr;
  auto victims = at::empty({k}, id_of.options());
  auto cold = at::empty({k}, freq.options());
  auto prio = at::empty({w}, freq.options());
  auto keys = at::empty({2, w}, id_of.options().dtype(at::kInt));  // uint32 bits
  auto cand = at::empty({2, w}, id_of.options());
  auto* keys_in = reinterpret_cast<uint32_t*>(keys.mutable_data_ptr<int32_t>());
  size_t bytes = 0;
  const auto go = [&](void* temp) {
    return kernels::launch_coldest_slots(
        temp, &bytes, id_of.const_data_ptr<int64_t>(), slots, freq.const_data_ptr<float>(),
        freq.numel(), at.const_data_ptr<int64_t>(), at.numel(), k, hand_ptr, w,
        prio.mutable_data_ptr<float>(), keys_in, keys_in + w, cand.mutable_data_ptr<int64_t>(),
        cand.mutable_data_ptr<int64_t>() + w, victims.mutable_data_ptr<int64_t>(),
        cold.mutable_data_ptr<float>(), stream_of(id_of));
  };
  C10_CUDA_CHECK(go(nullptr));
  auto temp = scratch(bytes, id_of);
  C10_CUDA_CHECK(go(temp.mutable_data_ptr()));
  return {victims, cold};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> admission_cuda(
    const at::Tensor& ids, const at::Tensor& first, const at::Tensor& victims,
    const at::Tensor& cold, const at::Tensor& misses, const at::Tensor& freq,
    const at::Tensor& id_of, bool by_frequency) {
  check_admission_args(ids, first, victims, cold, misses, freq, id_of);
  const c10::cuda::CUDAGuard guard(ids.device());
  const int64_t k = first.numel();
  auto admit = at::empty({k}, ids.options().dtype(at::kBool));
  auto keys = at::empty({k}, ids.options());
  auto evicted = at::zeros({1}, ids.options());
  C10_CUDA_CHECK(kernels::launch_admission(
      ids.const_data_ptr<int64_t>(), ids.numel(), first.const_data_ptr<int64_t>(),
      victims.const_data_ptr<int64_t>(), cold.const_data_ptr<float>(), k,
      misses.const_data_ptr<int64_t>(), freq.const_data_ptr<float>(),
      id_of.const_data_ptr<int64_t>(), id_of.numel(), freq.numel(), by_frequency,
      admit.mutable_data_ptr<bool>(), keys.mutable_data_ptr<int64_t>(),
      evicted.mutable_data_ptr<int64_t>(), stream_of(ids)));
  return {admit, keys, evicted};
}

at::Tensor cache_admit_cuda(at::Tensor& slot_of, at::Tensor& id_of, const at::Tensor& ids,
                            const at::Tensor& at, const at::Tensor& first,
                            const at::Tensor& victims, const at::Tensor& admit) {
  check_cache_admit_args(slot_of, id_of, ids, at, first, victims, admit);
  const c10::cuda::CUDAGuard guard(slot_of.device());
  auto dest = at.clone();
  C10_CUDA_CHECK(kernels::launch_cache_admit(
      slot_of.mutable_data_ptr<int32_t>(), slot_of.numel(), id_of.mutable_data_ptr<int64_t>(),
      id_of.numel(), ids.const_data_ptr<int64_t>(), ids.numel(), first.const_data_ptr<int64_t>(),
      victims.const_data_ptr<int64_t>(), admit.const_data_ptr<bool>(), first.numel(),
      dest.mutable_data_ptr<int64_t>(), stream_of(slot_of)));
  return dest;
}

void move_rows_cuda(at::Tensor& dst, const at::Tensor& src, const at::Tensor& index,
                    const at::Tensor& count, bool take) {
  check_move_rows_args(dst, src, index, count, take);
  const c10::cuda::CUDAGuard guard(dst.device());
  const int64_t item = dst.element_size();
  C10_CUDA_CHECK(kernels::launch_move_rows(
      dst.mutable_data_ptr(), dst.stride(0) * item, dst.stride(1) * item, src.const_data_ptr(),
      src.stride(0) * item, src.stride(1) * item, take ? src.size(1) : dst.size(1),
      c10::multiply_integers(dst.sizes().slice(2)) * item, dst.size(0),
      index.const_data_ptr<int64_t>(), count.const_data_ptr<int64_t>(), index.numel(), take,
      stream_of(dst)));
}

void take_rows_cuda(at::Tensor& out, const at::Tensor& src, const at::Tensor& index,
                    const at::Tensor& count) {
  move_rows_cuda(out, src, index, count, /*take=*/true);
}

void put_rows_cuda(at::Tensor& dst, const at::Tensor& src, const at::Tensor& index,
                   const at::Tensor& count) {
  move_rows_cuda(dst, src, index, count, /*take=*/false);
}

void age_frequencies_cuda(at::Tensor& freq, at::Tensor& age, int64_t period) {
  check_age_args(freq, age, period);
  const c10::cuda::CUDAGuard guard(freq.device());
  C10_CUDA_CHECK(kernels::launch_age(freq.mutable_data_ptr<float>(), freq.numel(),
                                  age.mutable_data_ptr<int64_t>(), period, stream_of(freq)));
}

}  // namespace

TORCH_LIBRARY_IMPL(speedtorch_ops, CUDA, m) {
  m.impl("_sort_ids", &sort_ids_cuda);
  m.impl("_distinct", &distinct_cuda);
  m.impl("_partition", &partition_cuda);
  m.impl("_cache_lookup", &cache_lookup_cuda);
  m.impl("_coldest_slots", &coldest_slots_cuda);
  m.impl("_admission", &admission_cuda);
  m.impl("_cache_admit", &cache_admit_cuda);
  m.impl("_take_rows", &take_rows_cuda);
  m.impl("_put_rows", &put_rows_cuda);
  m.impl("_age_frequencies", &age_frequencies_cuda);
}

}  // namespace speedtorch_ops
