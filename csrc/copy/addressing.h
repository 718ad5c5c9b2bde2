// Where a kernel finds a table's rows: device memory as is, pinned host memory through its
// mapped address (the GPU reads it over PCIe in place), pageable host memory not at all.
#pragma once

#include "copy/route.h"

#include <ATen/core/Tensor.h>

#include <string>

namespace speedtorch_ops::torch_cuda {

// A table's rows as the kernels on one device see them.
struct Addressed {
  char* rows;  // the device-visible address; nullptr for pageable host memory
  route::Memory memory;
};

// @brief The address of `table`'s rows for kernels on `device`. An empty host table counts as
// mapped (there is nothing to read). Raises, naming `name`, for a table on another GPU or on
// neither the CPU nor a GPU.
Addressed address(const at::Tensor& table, const std::string& name, const c10::Device& device);

// @brief The mapped address of a CPU table's rows, or nullptr when no kernel can address them
// (pageable memory).
char* mapped_host_rows(const at::Tensor& table);

}  // namespace speedtorch_ops::torch_cuda
