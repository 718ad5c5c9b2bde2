// The hybrid path's split, tuned per shape of call: each call's two sides are timed (events on
// the GPU, a clock on the host) and a search per shape (share_search.h) picks the zero-copy
// share at which such calls take least time. A test hook can fix the share instead.
#pragma once

#include <ATen/cuda/CUDAEvent.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <tuple>

namespace speedtorch_ops::torch_cuda {

// A shape of call: device, directions, and log2 buckets of rows, row bytes, table span and
// the CPU threads.
using TuneKey = std::tuple<int, bool, bool, int, int, int, int>;

// @brief The key of a call on `device` moving `rows` rows of `row_bytes` (all tables) from
// tables spanning up to `span` bytes.
TuneKey tune_key(c10::DeviceIndex device, bool writeback, bool load, int64_t rows,
                 int64_t row_bytes, int64_t span);

// One call's timing: events around both sides on the GPU, and the host's time.
struct Sample {
  std::shared_ptr<at::cuda::CUDAEvent> start, zc_end, dma_end;
  double share = 0;
  double host_ms = 0;
  double queued_ms = 0;  // host time until the GPU work of both sides was queued
  int64_t rows = 0;
};

// @brief The zero-copy share for the next call of shape `key`, after folding in the last
// sample recorded for it if its events have completed.
double tuned_share(const TuneKey& key);

// @brief Records a call's timing for the next call of the same shape.
void record_sample(const TuneKey& key, Sample sample);

// @brief Test hook: forgets every shape's search; while `quick`, new searches change their
// share from a shape's first call on, one call a share (0.5, 0.2, 0.8, 0, then closer), so a
// few calls of a test meet several shares.
void reset_hybrid_tuner(bool quick);

// @brief The test hook's fixed share in [0, 1], or negative for the automatic split.
double fixed_share();

// @brief Sets the test hook (share <= 1; negative: automatic); returns the previous setting.
double set_hybrid_share(double share);

// @brief The table span from which a CUDA index over host-mapped tables takes the hybrid path
// and write-backs alone go through the CPU (route::Call::kHybridMinSpan unless a test set
// another).
int64_t hybrid_min_span();

// @brief The test hook: the span above becomes `bytes` (> 0; 0 restores the default).
// Returns the previous setting (0: the default).
int64_t set_hybrid_min_span(int64_t bytes);

}  // namespace speedtorch_ops::torch_cuda
