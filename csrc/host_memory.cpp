// _pin_storage_: page-lock a CPU tensor's existing storage in place, so a pinned table never
// needs a second full-size copy (torch's pinned allocator would also round large tables up to a
// power of two). The storage's deleter is wrapped so the memory is unregistered before it is
// freed, whichever tensor or view releases it last.
#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <torch/library.h>

#ifdef SPEEDTORCH_OPS_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>
#endif

namespace speedtorch_ops {

#ifdef SPEEDTORCH_OPS_WITH_CUDA
namespace {
struct Registered {
  c10::DataPtr original;  // frees the memory once unregistered
};

void unregister_then_free(void* ctx) {
  auto* registered = static_cast<Registered*>(ctx);
  // Never throw from a deleter; a failure here only means the pages stay locked until exit.
  (void)cudaHostUnregister(registered->original.get());
  (void)cudaGetLastError();
  delete registered;
}
}  // namespace
#endif

void pin_storage_cpu(at::Tensor& self) {
  TORCH_CHECK(self.device().is_cpu(), "self must be a CPU tensor, got ", self.device());
#ifndef SPEEDTORCH_OPS_WITH_CUDA
  TORCH_CHECK(false,
              "speedtorch_ops was built without CUDA, so it cannot pin memory; rebuild with a "
              "CUDA build of torch and nvcc available (and SPEEDTORCH_OPS_CPU_ONLY unset)");
#else
  c10::StorageImpl* storage = self.storage().unsafeGetStorageImpl();
  const size_t nbytes = storage->nbytes();
  if (nbytes == 0) return;
  void* ptr = storage->mutable_data();
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) == cudaSuccess && attr.type == cudaMemoryTypeHost) {
    return;  // already pinned (torch's pinned allocator, or registered before)
  }
  (void)cudaGetLastError();
  C10_CUDA_CHECK(
      cudaHostRegister(ptr, nbytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
  auto* registered = new Registered{};
  registered->original =
      storage->set_data_ptr(c10::DataPtr(ptr, registered, &unregister_then_free, self.device()));
#endif
}

TORCH_LIBRARY_IMPL(speedtorch_ops, CPU, m) {
  m.impl("_pin_storage_", &pin_storage_cpu);
}

}  // namespace speedtorch_ops
