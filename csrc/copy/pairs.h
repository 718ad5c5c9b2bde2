// The row moves of the CUDA paths: one or more (table, batch) pairs moved by one index on the
// device, in as few launches as possible. Shared by the transfer ops' entry points
// (transfer/transfer_ops_cuda.cpp), the hybrid path's zero-copy side and the row cache's sort.
#pragma once

#include "copy/route.h"
#include "copy/validation.h"

#include <ATen/ATen.h>

#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace speedtorch_ops::torch_cuda {

// One store and its batch-sized tensor, as device-visible addresses.
struct Pair {
  char* table;
  char* batch;
  int64_t row_bytes;
  // Bytes between the table's rows when the pair is a part of a wider row (0: row_bytes). Such
  // pairs are moved row by row (all parts of a row together).
  int64_t table_stride = 0;
};

// An index on the device, sorted once (stably) when a path needs it and shared by every pair.
class DeviceIndex {
 public:
  // rows: int64 row numbers; slots (optional): the batch position of each (else 0..n-1).
  // bound: the rows are below it once validated (the smallest table's row count), so a sort
  // orders only their significant bits.
  DeviceIndex(at::Tensor rows, std::optional<at::Tensor> slots,
              int64_t bound = std::numeric_limits<int64_t>::max())
      : rows_(std::move(rows)), slots_(std::move(slots)), bound_(bound) {}
  // @brief Rows the caller sorted (ascending), with the batch position of each: no sort here.
  // limit (or nullptr): a device pointer to how many leading positions take part.
  static DeviceIndex presorted(const at::Tensor& sorted_rows, const at::Tensor& slots,
                               const int64_t* limit = nullptr);
  // @brief A host index whose values were checked, sent up through pinned memory (the copy is
  // queued on the current stream; the host does not wait for it).
  static DeviceIndex upload(const at::Tensor& host_index, const c10::Device& device,
                            int64_t bound = std::numeric_limits<int64_t>::max());

  bool presorted() const { return presorted_; }
  const int64_t* limit() const { return limit_; }
  int64_t size() const { return rows_.numel(); }
  int64_t bound() const { return bound_; }
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
  int64_t bound_;
  bool presorted_ = false;
  const int64_t* limit_ = nullptr;
};

// @brief (rows sorted ascending, stably; the slot of each: `slots` permuted, or the positions
// without it). rows: int64 on a GPU, contiguous, below `bound` (only those bits are sorted; a
// larger or negative value lands somewhere unspecified).
std::pair<at::Tensor, at::Tensor> sort_rows(const at::Tensor& rows,
                                            const std::optional<at::Tensor>& slots,
                                            int64_t bound);

// @brief batch[k][slot j] = table[k][row j] for every pair, one launch per group of kMaxTables
// pairs; in row order for route::Path::kZeroCopySorted, else in the index's order.
void gather_pairs(const std::vector<Pair>& pairs, DeviceIndex& index, route::Path path,
                  const Validation& v);

// @brief table[k][row j] = batch[k][slot j] for every pair; duplicate rows: the last slot wins
// (or, with accumulate, one pair only, all add up in index order). Sorted for
// route::Path::kZeroCopySorted, for accumulate, and for rows given with slots or a limit; else
// in the index's order, each row's last position marked first (launch_mark_last). `like`
// gives the dtype.
void scatter_pairs(const std::vector<Pair>& pairs, DeviceIndex& index, route::Path path,
                   const at::Tensor& like, bool accumulate, const Validation& v);

// @brief Whether scatter_fused takes a write-back alone (no accumulate) of n positions
// (moved_bytes in all) by a CUDA index into `pairs`, tables in device memory
// (route::Path::kDevice) of at least `rows` rows, on `device`: calls of a few MiB (larger ones
// are GPU-bound), not while capturing (a graph replays the separate kernels at no host cost),
// not under an SM cap (the separate kernels keep to it), where cooperative launches run.
bool can_scatter_fused(const std::vector<Pair>& pairs, int64_t n, int64_t rows,
                       int64_t moved_bytes, bool capturing, const c10::Device& device);

// @brief table[k][index[j]] = batch[k][j] for every pair, the last position of a repeated row
// winning, by one cooperative kernel that also checks `index` against `rows` (a bad value is
// reported as `name`, the `report` way; nothing is written) and zeroes its own status and
// scratch: two queued commands (the allocation and the launch) where a Validation and
// scatter_pairs queue seven. Raises for a bad index when `report` waits. Returns false, having
// queued nothing, where the device cannot hold the kernel's grid at once.
bool scatter_fused(const std::vector<Pair>& pairs, const at::Tensor& index, int64_t rows,
                   const char* name, Report report, const c10::Device& device);

}  // namespace speedtorch_ops::torch_cuda
