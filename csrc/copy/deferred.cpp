#include "copy/deferred.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <map>
#include <mutex>

namespace speedtorch_ops::torch_cuda {
namespace {

// The names a record can hold, by code (the validation kernel writes the code).
constexpr const char* kNames[] = {"index", "writeback_index", "load_index", "sorted_rows",
                                  "slots"};
constexpr int kNameCount = sizeof(kNames) / sizeof(kNames[0]);

int code_of(const char* name) {
  for (int k = 0; k < kNameCount; ++k) {
    if (std::strcmp(kNames[k], name) == 0) return k;
  }
  TORCH_INTERNAL_ASSERT(false, "no deferred-report code for index name ", name);
}

struct Slot {
  unsigned long long* claim = nullptr;  // device memory
  int64_t* record = nullptr;            // pinned host memory, mapped (the same address on the GPU)
};

// Per device for the life of the process, like the GPU's context. The mutex also makes one
// host thread report a record, never two.
std::mutex g_mutex;
std::map<c10::DeviceIndex, Slot>& slots() {
  static auto* s = new std::map<c10::DeviceIndex, Slot>();
  return *s;
}

// Allocates a device's slot. May run while the current stream captures a CUDA graph: the capture
// mode is relaxed for these few calls (none of them is queued on a capturing stream), and the
// claim is zeroed on a private stream that only this function waits for.
Slot make_slot(const c10::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  Slot s;
  void* record = nullptr;
  cudaError_t err = cudaHostAlloc(&record, kernels::kRecordWords * sizeof(int64_t),
                                  cudaHostAllocMapped | cudaHostAllocPortable);
  if (err == cudaSuccess) {
    std::memset(record, 0, kernels::kRecordWords * sizeof(int64_t));
    s.record = static_cast<int64_t*>(record);
    err = cudaMalloc(reinterpret_cast<void**>(&s.claim), sizeof(*s.claim));
  }
  cudaStream_t zeroing = nullptr;
  if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&zeroing, cudaStreamNonBlocking);
  if (err == cudaSuccess) err = cudaMemsetAsync(s.claim, 0, sizeof(*s.claim), zeroing);
  if (err == cudaSuccess) err = cudaStreamSynchronize(zeroing);
  if (zeroing != nullptr) cudaStreamDestroy(zeroing);
  if (err != cudaSuccess) {  // nothing half-made stays behind
    if (s.claim != nullptr) cudaFree(s.claim);
    if (s.record != nullptr) cudaFreeHost(s.record);
  }
  cudaThreadExchangeStreamCaptureMode(&mode);
  C10_CUDA_CHECK(err);
  return s;
}

}  // namespace

kernels::Deferred deferred_record(const c10::Device& device, const char* name) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = slots().find(device.index());
  if (it == slots().end()) it = slots().emplace(device.index(), make_slot(device)).first;
  return {it->second.claim, it->second.record, code_of(name)};
}

void raise_deferred(const c10::Device& device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto it = slots().find(device.index());
  if (it == slots().end()) return;
  int64_t* r = it->second.record;
  // The kernel wrote the fields, then a system fence, then r[0]: an acquire load of r[0] makes
  // the fields of the record it announces visible.
  const int64_t recorded = __atomic_load_n(&r[0], __ATOMIC_ACQUIRE);
  if (recorded == __atomic_load_n(&r[1], __ATOMIC_RELAXED)) return;  // nothing new (r[1]: ours)
  const int64_t code = __atomic_load_n(&r[2], __ATOMIC_RELAXED);
  const int64_t pos = __atomic_load_n(&r[3], __ATOMIC_RELAXED);
  const int64_t value = __atomic_load_n(&r[4], __ATOMIC_RELAXED);
  const int64_t rows = __atomic_load_n(&r[5], __ATOMIC_RELAXED);
  __atomic_store_n(&r[1], recorded, __ATOMIC_RELEASE);  // reported: the next may be recorded
  const char* name = code >= 0 && code < kNameCount ? kNames[code] : "an index";
  TORCH_CHECK(false, "in an earlier call on ", device, " (bounds_check='deferred', or a CUDA "
              "graph's replay), ", name,
              "[", pos, "] = ", value, " is out of range for a table of ", rows, " rows; every "
              "index must be in [0, ", rows, "). That call wrote nothing, and neither did this "
              "one. A deferred call's bad CUDA index is raised by the next 'deferred' or 'raise' "
              "call on its GPU or by speedtorch_ops.sync_bounds_check(); pass "
              "bounds_check='raise' to raise in the failing call");
}

void sync_bounds_check(int64_t device) {
  TORCH_CHECK(device >= 0 && device < c10::cuda::device_count(), "device must be a CUDA device "
              "index in [0, ", static_cast<int>(c10::cuda::device_count()), "), got ", device);
  const c10::Device dev(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
  C10_CUDA_CHECK(cudaStreamSynchronize(at::cuda::getCurrentCUDAStream(dev.index())));
  raise_deferred(dev);
}

}  // namespace speedtorch_ops::torch_cuda
