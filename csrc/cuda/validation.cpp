#include "validation.h"

#include "launch.h"

#include <c10/cuda/CUDAException.h>

namespace speedtorch_ops::cuda_impl {

Validation::Validation(const c10::Device& device, bool wait, int64_t sms)
    : stream_(at::cuda::getCurrentCUDAStream(device.index())),
      grid_(transfer_grid(device, sms)),
      status_(at::zeros({cuda::kStatusWords}, at::TensorOptions(at::kLong).device(device))),
      wait_(wait) {}

at::Tensor Validation::add(const at::Tensor& index, int64_t rows, const char* name,
                           const int64_t* limit) {
  TORCH_INTERNAL_ASSERT(count_ < static_cast<int>(names_.size()));
  auto idx = index.to(at::kLong).contiguous();
  names_[count_] = name;
  rows_[count_] = rows;
  if (idx.numel() > 0) {
    C10_CUDA_CHECK(cuda::launch_validate(idx.const_data_ptr<int64_t>(), idx.numel(), rows,
                                         count_, status_.mutable_data_ptr<int64_t>(), stream_,
                                         limit));
  }
  ++count_;
  return idx;
}

void Validation::raise_if_bad() const {
  if (count_ == 0 || !wait_) return;
  const auto host = status_.cpu();  // waits for this stream: the validation kernels' result
  const int64_t* s = host.const_data_ptr<int64_t>();
  TORCH_CHECK(s[0] == 0, names_[s[1]], "[", s[2], "] = ", s[3], " is out of range for a table of ",
              rows_[s[1]], " rows; every index must be in [0, ", rows_[s[1]],
              "). Nothing was written.");
}

}  // namespace speedtorch_ops::cuda_impl
