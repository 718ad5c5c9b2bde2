// Device-side index validation: every CUDA index of a call is checked on the device before any
// transfer kernel runs, and the transfer kernels write nothing when one was bad (they read the
// status first). Whether the call then waits to raise is the bounds_check mode's choice.
#pragma once

#include "common/bounds_check.h"
#include "copy/kernels.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <array>

namespace speedtorch_ops::torch_cuda {

// How a call reports a bad CUDA index (every way writes nothing).
enum class Report {
  kNone,      // not at all (bounds_check='prechecked'; indices checked on the host)
  kWait,      // raise_if_bad() waits for the stream and raises (bounds_check='raise')
  kDeferred,  // recorded for the next call on the GPU (deferred.h): no wait
};

// @brief The report of a call in `mode`: a capture cannot wait, so 'raise' defers there.
Report report_for(BoundsCheck mode, bool capturing);

class Validation {
 public:
  // Calls whose indices were checked on the host add nothing; their kernels read a zero status.
  // sms > 0: the call's transfer kernels use at most that many SMs (see transfer_grid).
  Validation(const c10::Device& device, Report report, int64_t sms = 0);

  // @brief For a call whose one CUDA index a fused kernel checks itself
  // (kernels::launch_scatter_fused): the status and that kernel's `scratch_bytes` of scratch are
  // one allocation, and the kernel zeroes the status (no memset queued here).
  static Validation fused(const c10::Device& device, Report report, int64_t scratch_bytes);

  // @brief The index as contiguous int64 on the device, queued for validation against `rows`
  // (its first *limit entries only, when limit is a device pointer).
  at::Tensor add(const at::Tensor& index, int64_t rows, const char* name,
                 const int64_t* limit = nullptr);

  // @brief Records that the fused kernel checks the call's only index, called `name`, against
  // `rows` (its argument id in the status: 0); the deferred record that kernel fills for a bad
  // value.
  kernels::Deferred add_checked_by_kernel(const char* name, int64_t rows);

  const int64_t* status() const { return status_.const_data_ptr<int64_t>(); }
  int64_t* mutable_status() { return status_.mutable_data_ptr<int64_t>(); }
  // The fused kernel's scratch (Validation::fused), after the status words.
  void* scratch() { return status_.mutable_data_ptr<int64_t>() + kernels::kStatusWords; }
  at::cuda::CUDAStream stream() const { return stream_; }
  kernels::Grid grid() const { return grid_; }

  // @brief Raises for a bad index, naming it. Waits for this stream only, and only when the
  // call reports by waiting and added an index.
  void raise_if_bad() const;

 private:
  at::cuda::CUDAStream stream_;
  kernels::Grid grid_;
  at::Tensor status_;
  c10::Device device_;
  Report report_;
  // A status of `words` int64 words, not zeroed.
  Validation(const c10::Device& device, Report report, int64_t sms, int64_t words);
  // The deferred record a kernel fills for a bad value of `name` (none unless deferred).
  kernels::Deferred deferred_for(const char* name) const;
  std::array<const char*, 2> names_{};
  std::array<int64_t, 2> rows_{};
  int count_ = 0;
};

}  // namespace speedtorch_ops::torch_cuda
