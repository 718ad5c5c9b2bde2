// Where the hybrid path's CPU side stages its rows: pinned host areas kept per device between
// calls, device scratch, the copy stream, and the launches between scratch and batch rows.
#pragma once

#include "copy/pairs.h"
#include "copy/validation.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>

#include <mutex>
#include <optional>
#include <vector>

namespace speedtorch_ops::torch_cuda {

// What the hybrid calls on one device share: the pinned staging areas and the event that marks
// the end of the last call's work. Calls on a device run one at a time (they share the copy
// stream too), under `mutex`; a call reuses the areas only after last_done (the index area:
// each call waits for its own copies into it before it lets go of the mutex).
struct DeviceState {
  std::mutex mutex;
  at::Tensor index, upload, down, up;
  std::optional<at::cuda::CUDAEvent> last_done;
};

// @brief The state of `device`, made on first use and kept for the life of the process.
DeviceState& state_of(c10::DeviceIndex device);

// @brief The first `bytes` of the pinned area held in `slot`, grown (by half again) when too
// small, so no call pays for a pinned allocation once sizes settle.
at::Tensor pinned_area(at::Tensor& slot, int64_t bytes);

// @brief The hybrid path's copy stream on `device`: created once and used by nothing else, so
// the caching allocator's pool for it (the scratch buffers) stays warm between calls.
at::cuda::CUDAStream dma_stream(c10::DeviceIndex device);

// @brief Positions per CPU chunk: about 2 MiB over all tables, at least 1024 positions.
int64_t chunk_rows(const std::vector<Pair>& pairs);

// The CPU side's rows of one direction, store-major (table k's n rows in block k): pinned
// staging on the host and, unless not wanted, scratch on the GPU.
class Staging {
 public:
  Staging(const std::vector<Pair>& pairs, int64_t n, const c10::Device& device,
          const at::cuda::CUDAStream& dma, at::Tensor& arena, bool scratch = true);

  char* device_block(size_t k);

  // @brief Rows [b, b + len) of table k in the host staging, shaped like `like`'s rows.
  at::Tensor rows(const std::vector<Pair>& pairs, size_t k, int64_t b, int64_t len,
                  const at::Tensor& like);

  // @brief Copies rows [b, b + len) of every table between host staging and device scratch.
  void copy_chunk(const std::vector<Pair>& pairs, int64_t b, int64_t len, cudaMemcpyKind kind,
                  const at::cuda::CUDAStream& stream);

  // @brief Copies rows [b, b + len) of every table's host staging to (to_batch) or from its
  // batch rows [at, at + len), with no scratch in between.
  void copy_batch(const std::vector<Pair>& pairs, int64_t b, int64_t len, int64_t at,
                  bool to_batch, const at::cuda::CUDAStream& stream);

 private:
  char* host_block(size_t k);

  std::vector<int64_t> offset_;
  at::Tensor scratch_, host_;
};

// @brief Moves rows between the batch positions `pos` and the scratch blocks, one launch per
// kMaxTables tables: batch[pos[j]] = scratch[j] (to_batch) or scratch[j] = batch[pos[j]].
void move_blocks(const std::vector<Pair>& pairs, Staging& staging, bool to_batch,
                 const int64_t* pos, int64_t n, const Validation& v,
                 const at::cuda::CUDAStream& stream);

}  // namespace speedtorch_ops::torch_cuda
