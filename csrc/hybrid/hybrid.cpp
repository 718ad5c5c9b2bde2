// The hybrid path: see hybrid.h. Timeline of one call (cur = the caller's stream, dma = the
// copy stream of staging.h):
//   host: wait for cur to reach the call (the CPU touches tables and rows only after the work
//         queued before it), split each index (split.h), upload the zero-copy side's indices.
//   cur:  zero-copy write-back, then zero-copy load (sorted reads, each distinct row once).
//   dma:  write-back rows gathered from the batch into device scratch (one launch), copied to
//         pinned staging chunk by chunk; the host scatters each chunk into the tables as it
//         lands. Then the host gathers the load rows into pinned staging, each chunk copied
//         up as soon as it is in, and one launch moves them into the batch.
//   cur waits for dma at the end; the call returns when the host part is done.
#include "hybrid/hybrid.h"

#include "common/checks.h"
#include "copy/rows_cpu.h"
#include "hybrid/split.h"
#include "hybrid/staging.h"
#include "hybrid/tuner.h"

#include <ATen/Parallel.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

namespace speedtorch_ops::torch_cuda {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void parallel_blocks(int64_t blocks, const std::function<void(int64_t)>& task) {
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) task(b);
  });
}

// The zero-copy side's path: mapped tables, indices on the device (sorted reads for long loads).
route::Path zero_copy_path(int64_t load_rows) {
  route::Call asked;
  asked.load_rows = load_rows;
  asked.index_on_device = asked.rows_on_device = true;
  asked.may_wait = false;  // the zero-copy side of a split: never split again
  return route::route(route::describe({{route::Memory::kMappedHost}}, asked));
}

// One index split in two sides. Its zero-copy rows and positions and its CPU side's positions
// go to the GPU in one upload buffer, from offset `at`; the CPU side's rows stay on the host.
struct Side {
  hybrid::Split split;
  int64_t at = 0;
  at::Tensor cpu_rows;
};

// Gathers rows `rows` of every table into `staging` (position j at staging row j) and calls
// queue(b, len) once positions [b, b + len) of a chunk are all in, to queue that chunk's copy.
// One parallel region for all chunks: each thread gathers its share of every chunk in turn and
// the thread that completes a chunk queues its copy, so no thread waits for the others between
// chunks. A parallel_for per chunk, joined before the host queued the chunk's copy, was slower:
// every join kept the threads that had finished waiting for the last one (see
// docs/decisions.md, "The CPU side's load in one parallel region").
void gather_chunks(const std::vector<Pair>& pairs, const std::vector<at::Tensor>& tables,
                   const at::Tensor& rows, Staging& staging, int64_t chunk,
                   const c10::Device& device, const std::function<void(int64_t, int64_t)>& queue) {
  const int64_t n = rows.numel();
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t shares = std::max<int64_t>(1, at::get_num_threads());
  // Shares of chunk c still being gathered.
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[chunks]);
  for (int64_t c = 0; c < chunks; ++c) left[c].store(shares, std::memory_order_relaxed);
  std::mutex queueing;  // the copies are queued one at a time, on one stream
  at::parallel_for(0, shares, 1, [&](int64_t s0, int64_t s1) {
    c10::cuda::CUDAGuard guard(device);  // a worker thread queues copies too
    // Chunk by chunk even where a thread has several shares (or the region runs inline).
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t b = c * chunk, len = std::min(chunk, n - b);
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t from = b + len * s / shares, to = b + len * (s + 1) / shares;
        if (to > from) {
          const auto part = rows.narrow(0, from, to - from);
          for (const auto k : c10::irange(pairs.size())) {
            auto out = staging.rows(pairs, k, from, to - from, tables[k]);
            gather_rows_cpu(tables[k], part, out, /*for_device=*/true);
          }
        }
        // acq_rel: the other shares' rows are written before their count reaches zero here.
        if (left[c].fetch_sub(1, std::memory_order_acq_rel) == 1) {
          std::lock_guard<std::mutex> lock(queueing);
          queue(b, len);
        }
      }
    }
  });
}

// Load only: the zero-copy kernels read positions [0, z) of the index, CPU threads the rest,
// into pinned staging, each chunk copied straight to its place in the batch as soon as it is
// in. A load has no duplicates to resolve, so no split pass and no scratch.
void load_by_position(const std::vector<Pair>& pairs, const std::vector<at::Tensor>& tables,
                      const at::Tensor& idx, const c10::Device& device,
                      const at::cuda::CUDAStream& cur, DeviceState& state, Sample& sample) {
  const int64_t n = idx.numel();
  const int64_t z = hybrid::zero_copy_prefix(sample.share, n);
  if (z > 0) {
    Validation v(device, Report::kNone);  // nothing to validate: the values were checked
    auto host = pinned_area(state.upload, z * 8).view(at::kLong).copy_(idx.narrow(0, 0, z));
    DeviceIndex di(host.to(device, /*non_blocking=*/true), std::nullopt);
    gather_pairs(pairs, di, zero_copy_path(z), v);
  }
  sample.zc_end->record(cur);
  const auto dma = dma_stream(device.index());
  sample.start->block(dma);  // the batch rows are written after the work queued before the call
  const int64_t chunk = chunk_rows(pairs);
  if (z < n) {
    Staging staging(pairs, n - z, device, dma, state.up, /*scratch=*/false);
    gather_chunks(pairs, tables, idx.narrow(0, z, n - z), staging, chunk, device,
                  [&](int64_t b, int64_t len) {
                    staging.copy_batch(pairs, b, len, z + b, /*to_batch=*/true, dma);
                  });
  }
  sample.dma_end->record(dma);
  sample.dma_end->block(cur);  // later work on cur follows the copies
}

// Writes the rows of `down` (staged in position order, chunk c landed once landed[c] has) into
// the tables at `rows`: the index bucketed once for every table, each CPU thread owning a
// range of table rows and waiting for a chunk only when it reaches one of its positions there.
void write_landed(const std::vector<Pair>& pairs, const std::vector<at::Tensor>& tables,
                  const at::Tensor& rows, Staging& down,
                  const std::vector<at::cuda::CUDAEvent>& landed, int64_t chunk,
                  bool accumulate) {
  // One owner at a time asks the driver whether chunks have landed, in order, and the others
  // read how far it got: with every owner synchronizing each chunk's event itself, the CPU
  // side's write-back was slower. An owner waiting on the lock may wait for a later chunk than
  // its own; waiters that spun on the count instead of the lock were no faster. See
  // docs/decisions.md, "One poller for landed chunks".
  std::atomic<int64_t> landed_upto{0};
  std::mutex asking;
  const ChunkReady ready = [&](int64_t c) {
    while (landed_upto.load(std::memory_order_acquire) <= c) {
      std::lock_guard<std::mutex> lock(asking);
      const int64_t k = landed_upto.load(std::memory_order_relaxed);
      if (k > c) break;
      landed[k].synchronize();
      landed_upto.store(k + 1, std::memory_order_release);
    }
  };
  std::vector<at::Tensor> srcs;
  for (const auto k : c10::irange(pairs.size())) {
    srcs.push_back(down.rows(pairs, k, 0, rows.numel(), tables[k]));
  }
  scatter_rows_cpu(tables, rows, srcs, accumulate, chunk, &ready);
}

// Write-back through the CPU side alone (no zero-copy share): the batch rows come down in
// position order straight from the batch, chunk by chunk on dma (no split, no scratch, no
// upload), and are written as they land. The host waited for the call's start already.
void writeback_on_host(const std::vector<Pair>& pairs, const std::vector<at::Tensor>& tables,
                       const at::Tensor& wb, bool accumulate, const c10::Device& device,
                       const at::cuda::CUDAStream& cur, DeviceState& state, Sample& sample) {
  const int64_t n = wb.numel();
  const auto dma = dma_stream(device.index());
  sample.start->block(dma);
  Staging down(pairs, n, device, dma, state.down, /*scratch=*/false);
  const int64_t chunk = chunk_rows(pairs);
  std::vector<at::cuda::CUDAEvent> landed((n + chunk - 1) / chunk);
  for (size_t c = 0; c < landed.size(); ++c) {
    const int64_t b = static_cast<int64_t>(c) * chunk;
    down.copy_batch(pairs, b, std::min(chunk, n - b), b, /*to_batch=*/false, dma);
    landed[c].record(dma);
  }
  write_landed(pairs, tables, wb, down, landed, chunk, accumulate);
  sample.dma_end->record(dma);
  sample.dma_end->block(cur);  // later work on cur (a write to the batch) follows the copies
}

// Write-back (and load): both indices split by row hash, so a row written back is loaded by
// the side that wrote it.
void split_by_row(const std::vector<Pair>& pairs, const std::vector<at::Tensor>& tables,
                  const at::Tensor& wb, const std::optional<at::Tensor>& load, bool accumulate,
                  const c10::Device& device, const at::cuda::CUDAStream& cur, DeviceState& state,
                  Sample& sample, Clock::time_point t0) {
  const uint32_t threshold = hybrid::threshold_of(sample.share);
  // One upload buffer for the zero-copy rows and positions and the CPU side's positions.
  std::optional<Side> swb, sload;
  int64_t upload_n = 0;
  for (auto [idx, side] : {std::pair{&wb, &swb}, std::pair{load ? &*load : nullptr, &sload}}) {
    if (idx == nullptr) continue;
    side->emplace();
    (*side)->split = hybrid::count_split(idx->const_data_ptr<int64_t>(), idx->numel(), threshold,
                                         parallel_blocks);
    (*side)->at = upload_n;
    (*side)->cpu_rows = at::empty({(*side)->split.n_cpu}, at::kLong);
    upload_n += 2 * (*side)->split.n_zc + (*side)->split.n_cpu;
  }
  auto upload = pinned_area(state.upload, upload_n * 8).view(at::kLong);
  const auto fill = [&](const at::Tensor& idx, Side& side) {
    int64_t* zc_rows = upload.mutable_data_ptr<int64_t>() + side.at;
    int64_t* zc_pos = zc_rows + side.split.n_zc;
    hybrid::fill_split(idx.const_data_ptr<int64_t>(), threshold, side.split,
                       {zc_rows, zc_pos, side.cpu_rows.mutable_data_ptr<int64_t>(),
                        zc_pos + side.split.n_zc},
                       parallel_blocks);
  };
  fill(wb, *swb);
  if (sload) fill(*load, *sload);
  // Nothing to validate (the values were checked); its status is zeroed on cur, before the
  // event dma waits for.
  Validation v(device, Report::kNone);
  const auto dev = upload.to(device, /*non_blocking=*/true);
  const auto part = [&](int64_t offset, int64_t n) { return dev.narrow(0, offset, n); };
  at::cuda::CUDAEvent uploaded;
  uploaded.record(cur);
  const auto dma = dma_stream(device.index());
  uploaded.block(dma);

  const int64_t chunk = chunk_rows(pairs);
  const auto cpu_pos = [&](const Side& s) {
    return part(s.at + 2 * s.split.n_zc, s.split.n_cpu).const_data_ptr<int64_t>();
  };

  // 1. The GPU work of both directions is queued first. Zero-copy write-back on cur; the CPU
  // side's write-back rows gathered from the batch into scratch (one launch) and copied down
  // chunk by chunk on dma; then the zero-copy load on cur, once dma has read the batch.
  at::cuda::CUDAEvent zc_wb_done, wb_read;
  std::optional<Staging> down, up;
  std::vector<at::cuda::CUDAEvent> landed;
  const hybrid::Split& w = swb->split;
  if (w.n_zc > 0) {
    DeviceIndex di(part(swb->at, w.n_zc), part(swb->at + w.n_zc, w.n_zc));
    scatter_pairs(pairs, di, zero_copy_path(0), tables[0], accumulate, v);
  }
  zc_wb_done.record(cur);
  if (w.n_cpu > 0) {
    down.emplace(pairs, w.n_cpu, device, dma, state.down);
    move_blocks(pairs, *down, /*to_batch=*/false, cpu_pos(*swb), w.n_cpu, v, dma);
    wb_read.record(dma);
    for (int64_t b = 0; b < w.n_cpu; b += chunk) {
      down->copy_chunk(pairs, b, std::min(chunk, w.n_cpu - b), cudaMemcpyDeviceToHost, dma);
      landed.emplace_back();
      landed.back().record(dma);
    }
  }
  if (sload && sload->split.n_zc > 0) {
    const hybrid::Split& l = sload->split;
    if (down) wb_read.block(cur);  // the batch is read before it is loaded
    DeviceIndex di(part(sload->at, l.n_zc), part(sload->at + l.n_zc, l.n_zc));
    gather_pairs(pairs, di, zero_copy_path(l.n_zc), v);
  }
  sample.zc_end->record(cur);
  sample.queued_ms = ms_since(t0);

  // 2. The CPU side of the write-back, written as its chunks land.
  if (w.n_cpu > 0) write_landed(pairs, tables, swb->cpu_rows, *down, landed, chunk, accumulate);

  // 3. The CPU side of the load: gathered into staging, each chunk copied up as soon as it is
  // in (gather_chunks); one launch moves the rows into the batch once the zero-copy write-back
  // (which reads the batch) is done.
  if (sload && sload->split.n_cpu > 0) {
    const hybrid::Split& l = sload->split;
    up.emplace(pairs, l.n_cpu, device, dma, state.up);
    gather_chunks(pairs, tables, sload->cpu_rows, *up, chunk, device,
                  [&](int64_t b, int64_t len) {
                    up->copy_chunk(pairs, b, len, cudaMemcpyHostToDevice, dma);
                  });
    zc_wb_done.block(dma);
    move_blocks(pairs, *up, /*to_batch=*/true, cpu_pos(*sload), l.n_cpu, v, dma);
  }
  sample.dma_end->record(dma);
  sample.dma_end->block(cur);  // later work on cur follows the copies
}

// An index of the call, its host copy (made by the call) and the name errors give it.
struct HostIndex {
  const std::optional<at::Tensor>* index;
  std::optional<at::Tensor>* host;
  const char* name;

  // The index, if the call has it and it is on the GPU (cuda) or on the host (!cuda).
  const at::Tensor* given(bool cuda) const {
    return *index && (*index)->is_cuda() == cuda ? &**index : nullptr;
  }
};

// Queues the copies of the CUDA indices into the pinned area held in `slot` (kept between
// calls) on the current stream, for the caller to wait for; each index's `host` is its place
// there. A pinned buffer allocated each call instead (torch's caching host allocator) made
// the index take longer and vary more on its way to the host (see docs/decisions.md, "The CUDA
// index's pinned area").
void queue_to_host(const std::array<HostIndex, 2>& indices, at::Tensor& slot) {
  // Each index's bytes, rounded up so that the next one starts aligned for any index type.
  const auto bytes_of = [](const at::Tensor& i) {
    return (i.numel() * i.element_size() + 7) / 8 * 8;
  };
  int64_t bytes = 0;
  for (const auto& h : indices) {
    if (const auto* i = h.given(/*cuda=*/true)) bytes += bytes_of(*i);
  }
  if (bytes == 0) return;
  const auto area = pinned_area(slot, bytes);
  int64_t at = 0;
  for (const auto& h : indices) {
    const at::Tensor* i = h.given(/*cuda=*/true);
    if (i == nullptr) continue;
    *h.host = area.narrow(0, at, i->numel() * i->element_size())
                  .view(i->scalar_type())
                  .view(i->sizes())
                  .copy_(*i, /*non_blocking=*/true);
    at += bytes_of(*i);
  }
}

}  // namespace

void hybrid_transfer(const std::vector<at::Tensor>& tables, const std::vector<Pair>& pairs,
                     const std::optional<at::Tensor>& writeback_index,
                     const std::optional<at::Tensor>& load_index, bool accumulate,
                     route::Path path, const c10::Device& device, const IndexCheck& check) {
  c10::cuda::CUDAGuard guard(device);
  const auto cur = at::cuda::getCurrentCUDAStream(device.index());
  const int64_t n_wb = writeback_index ? writeback_index->numel() : 0;
  const int64_t n_load = load_index ? load_index->numel() : 0;
  int64_t total_rb = 0, span = 0;
  for (const auto& t : tables) {
    total_rb += row_bytes(t);
    span = std::max<int64_t>(span, t.nbytes());
  }
  if (n_wb + n_load == 0) return;
  // Every value is checked before anything moves (a bad index writes nothing): a CPU index at
  // once, without waiting for anything; a CUDA index once it has landed, below.
  std::optional<at::Tensor> wb, load;
  const std::array<HostIndex, 2> indices{{{&writeback_index, &wb, check.writeback_name},
                                          {&load_index, &load, check.load_name}}};
  for (const auto& h : indices) {
    if (const auto* i = h.given(/*cuda=*/false)) {
      *h.host = i->contiguous();
      check_index_values(**h.host, check.rows, h.name);
    }
  }

  DeviceState& state = state_of(device.index());
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.last_done) state.last_done->synchronize();  // the staging areas are free again
  // A failure after this point waits for what the call queued before it leaves: the index
  // copies (into the index area, on cur) and the CPU side's copies (on dma, which write the
  // batch and read the staging areas behind the caching allocator's and last_done's backs),
  // so the next call, or the batch's next owner, finds nothing in flight.
  try {
    queue_to_host(indices, state.index);
    auto start = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
    start->record(cur);
    // The host touches tables and batch only after the work queued before (and the indices
    // have landed).
    start->synchronize();
    for (const auto& h : indices) {
      if (h.given(/*cuda=*/true)) check_index_values(**h.host, check.rows, h.name);
    }
    if (tables.empty() || total_rb == 0) return;
    for (auto* i : {&wb, &load}) {
      if (*i) *i = (*i)->to(at::kLong);  // contiguous already
    }
    const auto t0 = Clock::now();
    // The zero-copy share: none where no kernel can address the tables, else fixed by the test
    // hook or tuned (after the wait above, so the previous call's timing events on this stream
    // have completed).
    const double fixed = fixed_share();
    const auto key = tune_key(device.index(), wb.has_value(), load.has_value(), n_wb + n_load,
                              total_rb, span);
    const double share = path == route::Path::kHostStaged ? 0.0
                         : fixed >= 0                     ? fixed
                                                          : tuned_share(key);
    Sample sample{start, std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault),
                  std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault), share, 0, 0,
                  n_wb + n_load};
    sample.zc_end->record(cur);  // no zero-copy side yet; the sides that queue one record again
    if (wb && share == 0.0) {
      writeback_on_host(pairs, tables, *wb, accumulate, device, cur, state, sample);
      if (load) load_by_position(pairs, tables, *load, device, cur, state, sample);
    } else if (wb) {
      split_by_row(pairs, tables, *wb, load, accumulate, device, cur, state, sample, t0);
    } else {
      load_by_position(pairs, tables, *load, device, cur, state, sample);
    }
    sample.host_ms = ms_since(t0);
    state.last_done.emplace();
    state.last_done->record(cur);  // after cur waited for dma: the end of all of this call's work
    if (path != route::Path::kHostStaged && fixed < 0) record_sample(key, std::move(sample));
  } catch (...) {
    try {
      cur.synchronize();
      dma_stream(device.index()).synchronize();
    } catch (...) {
      // A context too broken to wait on: the first error is the one to report.
    }
    throw;
  }
}

}  // namespace speedtorch_ops::torch_cuda
