#include "copy/addressing.h"

#include <c10/util/Exception.h>
#include <cuda_runtime.h>

namespace speedtorch_ops::torch_cuda {

char* mapped_host_rows(const at::Tensor& table) {
  auto* ptr = static_cast<char*>(const_cast<void*>(table.const_data_ptr()));
  if (!table.is_cpu() || table.numel() == 0) return nullptr;
  // Pinned memory from torch's allocator or cudaHostRegister(..., Mapped) reports its device
  // address here; pageable memory is an error, cleared so it does not surface later.
  cudaPointerAttributes attr{};
  const bool ok = cudaPointerGetAttributes(&attr, ptr) == cudaSuccess;
  (void)cudaGetLastError();
  return ok && attr.type == cudaMemoryTypeHost ? static_cast<char*>(attr.devicePointer) : nullptr;
}

Addressed address(const at::Tensor& table, const std::string& name, const c10::Device& device) {
  auto* ptr = static_cast<char*>(const_cast<void*>(table.const_data_ptr()));
  if (table.is_cuda()) {
    TORCH_CHECK(table.device() == device, name, " is on ", table.device(), " but the rows go to ",
                device, "; keep the table (or pinned host memory), index and rows on one GPU");
    return {ptr, route::Memory::kDevice};
  }
  TORCH_CHECK(table.is_cpu(), name, " must be a CPU tensor (pinned or not) or a CUDA tensor, got ",
              table.device());
  if (table.numel() == 0) return {ptr, route::Memory::kMappedHost};
  char* rows = mapped_host_rows(table);
  return {rows, rows != nullptr ? route::Memory::kMappedHost : route::Memory::kPageableHost};
}

}  // namespace speedtorch_ops::torch_cuda
