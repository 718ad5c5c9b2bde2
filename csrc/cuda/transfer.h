// The host side of the CUDA transfers, shared by the op entry points (ops.cpp) and the hybrid
// CPU + DMA path (hybrid.cpp): device addresses of tables, the index validation of a call, and
// the row moves of one or more (table, batch) pairs with indices already on the device.
#pragma once

#include "kernels.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <array>
#include <optional>
#include <string>
#include <vector>

namespace speedtorch_ops::cuda_impl {

// The device-visible address of a CPU table's rows when a kernel can address them in place
// (pinned, mapped memory), else nullptr.
char* mapped_host_rows(const at::Tensor& table);

// The address a kernel on `device` uses for `table`'s rows: device memory as is, or the mapped
// address of pinned host memory. Pageable host memory: an error naming `name` and the fix.
char* device_rows(const at::Tensor& table, const std::string& name, const c10::Device& device);

// Raises unless accumulate=True supports the table's dtype.
void check_accumulate_dtype(at::ScalarType dtype);

// The launch grid of the transfer kernels on `device` (the SM cap applied).
cuda::Grid transfer_grid(const c10::Device& device);

// Upper bound on the SMs the transfer kernels use (0: no cap); returns the previous value.
int64_t set_transfer_sm_limit(int64_t sms);

// One call's index validation: every index is checked on the device before any transfer kernel
// runs, and the transfer kernels write nothing if one was bad. Indices checked on the host
// (the hybrid path) skip add(); the kernels still read the (zero) status.
class Validation {
 public:
  explicit Validation(const c10::Device& device);

  // Returns the index as contiguous int64 on the device, queued for validation.
  at::Tensor add(const at::Tensor& index, int64_t rows, const char* name);

  const int64_t* status() const { return status_.const_data_ptr<int64_t>(); }
  at::cuda::CUDAStream stream() const { return stream_; }
  cuda::Grid grid() const { return grid_; }

  // Raises for a bad index. Waits for this stream only; skipped while capturing a graph, for
  // callers that validated on the host (set_index_wait(false)), and when nothing was added.
  void raise_if_bad() const;

 private:
  at::cuda::CUDAStream stream_;
  cuda::Grid grid_;
  at::Tensor status_;
  std::array<const char*, 2> names_{};
  std::array<int64_t, 2> rows_{};
  int count_ = 0;
};

// One store and its batch-sized tensor, as device-visible addresses.
struct Pair {
  char* table;
  char* batch;
  int64_t row_bytes;
  bool host;  // the table is mapped host memory (rows cross PCIe)
  // Bytes between the table's rows when the pair is a part of a wider row (0: row_bytes). Such
  // pairs are moved row by row (all parts of a row together).
  int64_t table_stride = 0;
};

// An index on the device, sorted once (stably) when a path needs it and shared by every pair.
class DeviceIndex {
 public:
  // rows: int64 row numbers; slots (optional): the batch position of each (else 0..n-1).
  DeviceIndex(at::Tensor rows, std::optional<at::Tensor> slots)
      : rows_(std::move(rows)), slots_(std::move(slots)) {}
  // Rows the caller sorted (ascending), with the batch position of each: no sort here.
  static DeviceIndex presorted(const at::Tensor& sorted_rows, const at::Tensor& slots) {
    DeviceIndex index(sorted_rows, slots);
    index.sorted_ = sorted_rows;
    index.sorted_slots_ = slots;
    index.presorted_ = true;
    return index;
  }
  bool presorted() const { return presorted_; }
  int64_t size() const { return rows_.numel(); }
  const at::Tensor& rows() const { return rows_; }
  const int64_t* slots() const { return slots_ ? slots_->const_data_ptr<int64_t>() : nullptr; }
  // The rows ascending (stable), and the batch position of each.
  const at::Tensor& sorted();
  const at::Tensor& sorted_slots();

 private:
  void sort();
  at::Tensor rows_;
  std::optional<at::Tensor> slots_;
  std::optional<at::Tensor> sorted_, sorted_slots_;
  bool presorted_ = false;
};

// batch[k][slot j] = table[k][row j] for every pair, one launch per group of kMaxTables pairs.
void gather_pairs(const std::vector<Pair>& pairs, DeviceIndex& index, const Validation& v);

// table[k][row j] = batch[k][slot j] for every pair; duplicate rows: the last slot wins (or,
// with accumulate, one pair only, all add up in index order).
void scatter_pairs(const std::vector<Pair>& pairs, DeviceIndex& index, int64_t min_rows,
                   const at::Tensor& like, bool accumulate, const Validation& v);

// Write-back and/or load for every pair with indices given (and validated) on the host: sent up
// through pinned memory (the copy does not wait for the stream), then the device path, with no
// device-side validation and no host wait.
void transfer_with_host_indices(const std::vector<Pair>& pairs,
                                const std::optional<at::Tensor>& writeback_index,
                                const std::optional<at::Tensor>& load_index, int64_t min_rows,
                                const at::Tensor& like, bool accumulate,
                                const c10::Device& device);

}  // namespace speedtorch_ops::cuda_impl
