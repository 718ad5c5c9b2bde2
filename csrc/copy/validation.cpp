#include "copy/validation.h"

#include "copy/deferred.h"
#include "copy/launch.h"

#include <c10/cuda/CUDAException.h>

namespace speedtorch_ops::torch_cuda {

Report report_for(BoundsCheck mode, bool capturing) {
  switch (mode) {
    case BoundsCheck::kRaise: return capturing ? Report::kDeferred : Report::kWait;
    case BoundsCheck::kDeferred: return Report::kDeferred;
    case BoundsCheck::kPrechecked: return Report::kNone;
  }
  return Report::kWait;
}

Validation::Validation(const c10::Device& device, Report report, int64_t sms, int64_t words)
    : stream_(at::cuda::getCurrentCUDAStream(device.index())),
      grid_(transfer_grid(device, sms)),
      status_(at::empty({words}, at::TensorOptions(at::kLong).device(device))),
      device_(device),
      report_(report) {}

Validation::Validation(const c10::Device& device, Report report, int64_t sms)
    : Validation(device, report, sms, kernels::kStatusWords) {
  // A memset is one queued command, where at::zeros is a dispatched fill kernel.
  C10_CUDA_CHECK(cudaMemsetAsync(status_.mutable_data_ptr(), 0, status_.nbytes(), stream_));
}

Validation Validation::fused(const c10::Device& device, Report report, int64_t scratch_bytes) {
  // int64 words, so the scratch after the status keeps 8-byte alignment
  return Validation(device, report, /*sms=*/0, kernels::kStatusWords + (scratch_bytes + 7) / 8);
}

kernels::Deferred Validation::deferred_for(const char* name) const {
  return report_ == Report::kDeferred ? deferred_record(device_, name) : kernels::Deferred{};
}

kernels::Deferred Validation::add_checked_by_kernel(const char* name, int64_t rows) {
  TORCH_INTERNAL_ASSERT(count_ == 0, "a fused kernel checks a call's only index");
  names_[count_] = name;
  rows_[count_] = rows;
  ++count_;
  return deferred_for(name);
}

at::Tensor Validation::add(const at::Tensor& index, int64_t rows, const char* name,
                           const int64_t* limit) {
  TORCH_INTERNAL_ASSERT(count_ < static_cast<int>(names_.size()));
  auto idx = index.to(at::kLong).contiguous();
  names_[count_] = name;
  rows_[count_] = rows;
  if (idx.numel() > 0) {
    C10_CUDA_CHECK(kernels::launch_validate(idx.const_data_ptr<int64_t>(), idx.numel(), rows,
                                         count_, status_.mutable_data_ptr<int64_t>(), stream_,
                                         limit, deferred_for(name)));
  }
  ++count_;
  return idx;
}

void Validation::raise_if_bad() const {
  if (count_ == 0 || report_ != Report::kWait) return;
  // waits for this stream: the validation kernels' result (the status words alone, not a
  // fused kernel's scratch after them)
  const auto host = status_.narrow(0, 0, kernels::kStatusWords).cpu();
  const int64_t* s = host.const_data_ptr<int64_t>();
  TORCH_CHECK(s[0] == 0, names_[s[1]], "[", s[2], "] = ", s[3], " is out of range for a table of ",
              rows_[s[1]], " rows; every index must be in [0, ", rows_[s[1]],
              "). Nothing was written.");
}

}  // namespace speedtorch_ops::torch_cuda
