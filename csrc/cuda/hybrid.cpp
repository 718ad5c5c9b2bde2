// The hybrid path: see hybrid.h. Timeline of one call (cur = the caller's stream, dma = a side
// stream from torch's pool):
//   host: wait for cur to reach the call (the CPU touches tables and rows only after the work
//         queued before it), split each index by a hash of the row (a row takes the same side
//         in the write-back and the load, so duplicates resolve on one side and a row written
//         back is loaded by the side that wrote it), upload the zero-copy side's indices.
//   cur:  zero-copy write-back, then zero-copy load (sorted reads, each distinct row once).
//   dma:  write-back rows gathered from the batch into device scratch (one launch), copied to
//         pinned staging chunk by chunk; the host scatters each chunk into the tables as it
//         lands. Then the host gathers the load rows chunk by chunk into pinned staging, each
//         chunk copied up while the next is gathered, and one launch moves them into the batch.
//   cur waits for dma at the end; the call returns when the host part is done.
#include "hybrid.h"

#include "speedtorch_ops/checks.h"
#include "transfer.h"

#include <ATen/Parallel.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

namespace speedtorch_ops::cuda_impl {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<double> g_fixed_share{-1.0};

// Transfers smaller than this go through the zero-copy kernels alone: no host wait, no staging.
constexpr int64_t kHybridMinBytes = int64_t{2} << 20;
// Bytes per CPU chunk: the CPU gathers (or scatters) one chunk while the copy engine moves the
// next (or the previous).
constexpr int64_t kChunkBytes = int64_t{2} << 20;
// Positions per task of the index split.
constexpr int64_t kSplitBlock = int64_t{1} << 13;

// A row is read or written by the zero-copy kernels when its 16-bit hash is under the threshold.
inline uint32_t row_hash(int64_t row) {
  return static_cast<uint32_t>((static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ull) >> 48);
}

// One index split in two sides, the caller's order kept within each side. zc_rows, zc_pos and
// cpu_pos live in the upload buffer (they go to the GPU); cpu_rows stays on the host.
struct Split {
  int64_t n = 0, n_zc = 0, n_cpu = 0;
  int64_t at = 0;  // offset of zc_rows in the upload buffer; then zc_pos, then cpu_pos
  std::vector<int64_t> zc_before;  // zero-copy positions before each block
  at::Tensor cpu_rows;
};

Split count_split(const at::Tensor& idx, uint32_t threshold) {
  Split s;
  s.n = idx.numel();
  const int64_t* p = idx.const_data_ptr<int64_t>();
  const int64_t blocks = (s.n + kSplitBlock - 1) / kSplitBlock;
  std::vector<int64_t> counts(blocks, 0);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t c = 0;
      for (int64_t i = b * kSplitBlock, e = std::min(s.n, i + kSplitBlock); i < e; ++i) {
        c += row_hash(p[i]) < threshold;
      }
      counts[b] = c;
    }
  });
  s.zc_before.resize(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    s.zc_before[b] = s.n_zc;
    s.n_zc += counts[b];
  }
  s.n_cpu = s.n - s.n_zc;
  s.cpu_rows = at::empty({s.n_cpu}, at::kLong);
  return s;
}

void fill_split(const at::Tensor& idx, uint32_t threshold, Split& s, int64_t* upload) {
  const int64_t* p = idx.const_data_ptr<int64_t>();
  int64_t* zc_rows = upload + s.at;
  int64_t* zc_pos = zc_rows + s.n_zc;
  int64_t* cpu_pos = zc_pos + s.n_zc;
  int64_t* cpu_rows = s.cpu_rows.mutable_data_ptr<int64_t>();
  const int64_t blocks = static_cast<int64_t>(s.zc_before.size());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t z = s.zc_before[b];
      int64_t c = b * kSplitBlock - z;
      for (int64_t i = b * kSplitBlock, e = std::min(s.n, i + kSplitBlock); i < e; ++i) {
        if (row_hash(p[i]) < threshold) {
          zc_rows[z] = p[i];
          zc_pos[z++] = i;
        } else {
          cpu_rows[c] = p[i];
          cpu_pos[c++] = i;
        }
      }
    }
  });
}

// The split is tuned per shape of call: each call's two sides are timed (events on the GPU, a
// clock on the host) and the next call of the same shape moves the share toward the point
// where both sides end together.
using Key = std::tuple<int, bool, bool, int, int, int, int>;

int log2_bucket(int64_t v) {
  int b = 0;
  while (v > 1) {
    v >>= 1;
    ++b;
  }
  return b;
}

struct Sample {
  std::shared_ptr<at::cuda::CUDAEvent> start, zc_end, dma_end;
  double share = 0;
  double host_ms = 0;
  double queued_ms = 0;  // host time until the GPU work of both sides was queued
  int64_t rows = 0;
};

struct Entry {
  double share = 0.5;
  std::optional<Sample> pending;
};

class Tuner {
 public:
  double share(const Key& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    Entry& e = entries_[key];
    if (e.pending) {
      const Sample s = *e.pending;
      if (s.start->query() && s.zc_end->query() && s.dma_end->query()) {
        e.pending.reset();
        const double zc_ms = s.start->elapsed_time(*s.zc_end);
        const double cpu_ms = std::max<double>(s.host_ms, s.start->elapsed_time(*s.dma_end));
        if (zc_ms > 0 && cpu_ms > 0) {
          // Rows per ms of each side; the share at which both would end together.
          const double zc_rate = s.share / zc_ms;
          const double cpu_rate = (1.0 - s.share) / cpu_ms;
          const double target = zc_rate / (zc_rate + cpu_rate);
          e.share = std::clamp(0.5 * s.share + 0.5 * target, 0.02, 0.98);
          if (std::getenv("SPEEDTORCH_OPS_TRACE_SPLIT") != nullptr) {
            std::fprintf(stderr, "hybrid split: %lld rows, share %.3f: zero-copy %.3f ms, cpu "
                         "%.3f ms (host %.3f ms, of which %.3f ms to queue the GPU work) -> "
                         "%.3f\n", static_cast<long long>(s.rows), s.share, zc_ms, cpu_ms,
                         s.host_ms, s.queued_ms, e.share);
          }
        }
      }
    }
    return e.share;
  }

  void record(const Key& key, Sample s) {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_[key].pending = std::move(s);
  }

 private:
  std::mutex mutex_;
  std::map<Key, Entry> entries_;
};

Tuner& tuner() {
  static auto* t = new Tuner();  // never destroyed (its events), like DeviceState
  return *t;
}

// Rows of `like`'s row shape and dtype over host bytes at `ptr`.
at::Tensor host_rows(char* ptr, const at::Tensor& like, int64_t n) {
  auto sizes = like.sizes().vec();
  sizes[0] = n;
  return at::from_blob(ptr, sizes, at::TensorOptions(like.scalar_type()));
}

// Positions per CPU chunk: about kChunkBytes over all tables, at least 1024.
int64_t chunk_rows(const std::vector<Pair>& pairs) {
  int64_t total_rb = 0;
  for (const auto& p : pairs) total_rb += p.row_bytes;
  return std::max<int64_t>(1024, kChunkBytes / std::max<int64_t>(total_rb, 1));
}

// Start offsets of each table's block in a store-major staging area of n rows per table.
std::vector<int64_t> block_offsets(const std::vector<Pair>& pairs, int64_t n) {
  std::vector<int64_t> at;
  int64_t off = 0;
  for (const auto& p : pairs) {
    at.push_back(off);
    off += n * p.row_bytes;
  }
  at.push_back(off);
  return at;
}

// The CPU side's rows of one direction: pinned staging on the host and scratch on the GPU, both
// store-major (table k's n rows at offset[k]). The scratch comes from the dma stream's pool of
// torch's caching allocator: memory just freed on cur (e.g. a sort buffer of a zero-copy kernel
// still running there) can then not be handed to the copies on dma.
// Pinned host memory kept per device between calls (grown when too small), so no call pays for
// a pinned allocation. A call reuses it only after the previous call's copies have finished
// (see DeviceState).
at::Tensor pinned_area(at::Tensor& slot, int64_t bytes) {
  if (!slot.defined() || slot.nbytes() < static_cast<size_t>(bytes)) {
    slot = at::empty({bytes + bytes / 2}, at::TensorOptions(at::kByte).pinned_memory(true));
  }
  return slot.narrow(0, 0, bytes);
}

// What the hybrid calls on one device share: the staging areas and the event that marks the end
// of the last call's work. Calls on a device run one at a time (they share the copy stream too).
struct DeviceState {
  std::mutex mutex;
  at::Tensor upload, down, up;
  std::optional<at::cuda::CUDAEvent> last_done;
};

DeviceState& state_of(c10::DeviceIndex device) {
  static std::mutex mutex;
  // Never destroyed: at process exit, freeing pinned memory or events after torch's CUDA state
  // is gone aborts the process (seen on the H100: "Unrecognized stream" from ~TensorImpl).
  static auto* states = new std::map<c10::DeviceIndex, std::unique_ptr<DeviceState>>();
  std::lock_guard<std::mutex> lock(mutex);
  auto& state = (*states)[device];
  if (!state) state = std::make_unique<DeviceState>();
  return *state;
}

class Staging {
 public:
  Staging(const std::vector<Pair>& pairs, int64_t n, const c10::Device& device,
          const at::cuda::CUDAStream& dma, at::Tensor& arena, bool scratch = true)
      : offset_(block_offsets(pairs, n)) {
    if (scratch) {
      c10::cuda::CUDAStreamGuard on_dma(dma);
      scratch_ = at::empty({offset_.back()}, at::TensorOptions(at::kByte).device(device));
    }
    host_ = pinned_area(arena, offset_.back());
  }

  char* device_block(size_t k) { return static_cast<char*>(scratch_.mutable_data_ptr()) + offset_[k]; }
  char* host_block(size_t k) { return static_cast<char*>(host_.mutable_data_ptr()) + offset_[k]; }

  // Rows [b, b + len) of table k in the host staging, as a tensor shaped like `like`'s rows.
  at::Tensor rows(const std::vector<Pair>& pairs, size_t k, int64_t b, int64_t len,
                  const at::Tensor& like) {
    return host_rows(host_block(k) + b * pairs[k].row_bytes, like, len);
  }

  // Copies rows [b, b + len) of every table between host staging and device scratch on `stream`.
  void copy_chunk(const std::vector<Pair>& pairs, int64_t b, int64_t len, cudaMemcpyKind kind,
                  const at::cuda::CUDAStream& stream) {
    for (const auto k : c10::irange(pairs.size())) {
      char* dev = device_block(k) + b * pairs[k].row_bytes;
      char* host = host_block(k) + b * pairs[k].row_bytes;
      const bool up = kind == cudaMemcpyHostToDevice;
      C10_CUDA_CHECK(cudaMemcpyAsync(up ? dev : host, up ? host : dev, len * pairs[k].row_bytes,
                                     kind, stream));
    }
  }

 private:
  std::vector<int64_t> offset_;
  at::Tensor scratch_, host_;
};

// One launch per kMaxTables tables between the batch rows at `pos` and the scratch blocks:
// batch[pos[j]] = scratch[j] (to_batch) or scratch[j] = batch[pos[j]].
void move_blocks(const std::vector<Pair>& pairs, Staging& staging, bool to_batch,
                 const int64_t* pos, int64_t n, const Validation& v,
                 const at::cuda::CUDAStream& stream) {
  for (size_t first = 0; first < pairs.size(); first += cuda::kMaxTables) {
    cuda::Tables t{};
    t.count = static_cast<int>(std::min<size_t>(cuda::kMaxTables, pairs.size() - first));
    for (int k = 0; k < t.count; ++k) {
      char* block = staging.device_block(first + k);
      char* batch = pairs[first + k].batch;
      t.set(k, to_batch ? batch : block, to_batch ? block : batch, pairs[first + k].row_bytes);
    }
    C10_CUDA_CHECK(cuda::launch_copy_rows(t, to_batch ? pos : nullptr, to_batch ? nullptr : pos, n,
                                          false, nullptr, v.status(), v.grid(), stream));
  }
}

// The copy stream of the hybrid path on each device: created once and used by nothing else, so
// the caching allocator's pool for it (the scratch buffers) stays warm between calls.
at::cuda::CUDAStream dma_stream(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(device);
  if (it == streams.end()) {
    c10::cuda::CUDAGuard guard(device);
    cudaStream_t stream = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    it = streams.emplace(device, stream).first;  // lives as long as the process
  }
  return at::cuda::getStreamFromExternal(it->second, device);
}

// Load only: the zero-copy kernels read positions [0, z) of the index, CPU threads the rest,
// chunk by chunk into pinned staging, each chunk copied straight to its place in the batch while
// the next is gathered. A load has no duplicates to resolve, so no split pass and no scratch.
void load_by_position(const std::vector<Pair>& pairs, const std::vector<at::Tensor>& tables,
                      const at::Tensor& idx, const c10::Device& device,
                      const at::cuda::CUDAStream& cur, DeviceState& state, Sample& sample) {
  const int64_t n = idx.numel();
  const int64_t z = std::min<int64_t>(n, std::llround(sample.share * static_cast<double>(n)));
  if (z > 0) {
    Validation v(device);  // nothing to validate on the device: the values were checked
    auto host = pinned_area(state.upload, z * 8).view(at::kLong).copy_(idx.narrow(0, 0, z));
    DeviceIndex di(host.to(device, /*non_blocking=*/true), std::nullopt);
    gather_pairs(pairs, di, v);
  }
  sample.zc_end->record(cur);
  const auto dma = dma_stream(device.index());
  sample.start->block(dma);  // the batch rows are written after the work queued before the call
  const int64_t chunk = chunk_rows(pairs);
  if (z < n) {
    Staging staging(pairs, n - z, device, dma, state.up, /*scratch=*/false);
    for (int64_t b = 0; b < n - z; b += chunk) {
      const int64_t len = std::min(chunk, n - z - b);
      const auto rows = idx.narrow(0, z + b, len);
      for (const auto k : c10::irange(pairs.size())) {
        auto out = staging.rows(pairs, k, b, len, tables[k]);
        gather_rows_cpu(tables[k], rows, out);
      }
      for (const auto k : c10::irange(pairs.size())) {
        const int64_t rb = pairs[k].row_bytes;
        C10_CUDA_CHECK(cudaMemcpyAsync(pairs[k].batch + (z + b) * rb, staging.host_block(k) + b * rb,
                                       len * rb, cudaMemcpyHostToDevice, dma));
      }
    }
  }
  sample.dma_end->record(dma);
  sample.dma_end->block(cur);  // later work on cur follows the copies
}

}  // namespace

double set_hybrid_share(double share) {
  TORCH_CHECK(share <= 1.0, "share must be in [0, 1], or negative for automatic; got ", share);
  return g_fixed_share.exchange(share);
}

void hybrid_transfer(const std::vector<at::Tensor>& tables, const std::vector<at::Tensor>& batch,
                     const std::optional<at::Tensor>& writeback_index,
                     const std::optional<at::Tensor>& load_index, bool accumulate,
                     const c10::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  const auto cur = at::cuda::getCurrentCUDAStream(device.index());
  const auto as_long = [](const std::optional<at::Tensor>& i) {
    return i ? std::optional(i->to(at::kLong).contiguous()) : std::nullopt;
  };
  const auto wb = as_long(writeback_index);
  const auto load = as_long(load_index);
  const int64_t n_wb = wb ? wb->numel() : 0;
  const int64_t n_load = load ? load->numel() : 0;
  if (n_wb + n_load == 0 || tables.empty()) return;

  // Table addresses for the zero-copy side: all tables must be mapped, else the CPU does it all.
  bool mapped = true;
  int64_t total_rb = 0, span = 0;
  std::vector<Pair> pairs;
  for (const auto k : c10::irange(tables.size())) {
    char* rows = mapped_host_rows(tables[k]);
    mapped = mapped && rows != nullptr;
    total_rb += row_bytes(tables[k]);
    span = std::max<int64_t>(span, tables[k].nbytes());
    pairs.push_back({rows, static_cast<char*>(batch[k].mutable_data_ptr()), row_bytes(tables[k]),
                     true});
  }
  if (total_rb == 0) return;

  const double fixed = g_fixed_share.load();
  const int64_t min_rows = tables[0].size(0);
  if (mapped && (fixed >= 1.0 || (fixed < 0 && (n_wb + n_load) * total_rb < kHybridMinBytes))) {
    // Small transfers (and the test hook's share 1) go by zero-copy alone, with no host wait.
    transfer_with_host_indices(pairs, wb, load, min_rows, tables[0], accumulate, device);
    return;
  }

  DeviceState& state = state_of(device.index());
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.last_done) state.last_done->synchronize();  // the staging areas are free again
  auto start = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
  start->record(cur);
  start->synchronize();  // the host touches tables and batch only after the work queued before
  const auto t0 = Clock::now();
  // The share of rows for the zero-copy side: none for tables a kernel cannot address
  // (pageable memory), else fixed by the test hook or tuned (after the wait above, so the
  // previous call's timing events on this stream have completed).
  const Key key{device.index(), wb.has_value(), load.has_value(), log2_bucket(n_wb + n_load),
                log2_bucket(total_rb), log2_bucket(span), at::get_num_threads()};
  const double share = !mapped ? 0.0 : fixed >= 0 ? fixed : tuner().share(key);

  Sample sample{start, std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault),
                std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault), share, 0, 0,
                n_wb + n_load};
  if (!wb) {
    load_by_position(pairs, tables, *load, device, cur, state, sample);
  } else {
    // Split both indices; one upload buffer for the zero-copy rows and positions and the CPU
    // side's positions.
    const auto threshold = static_cast<uint32_t>(std::lround(share * 65536.0));
    std::optional<Split> swb, sload;
    int64_t upload_n = 0;
    for (auto [idx, split] : {std::pair{&wb, &swb}, std::pair{&load, &sload}}) {
      if (!*idx) continue;
      *split = count_split(**idx, threshold);
      (*split)->at = upload_n;
      upload_n += 2 * (*split)->n_zc + (*split)->n_cpu;
    }
    auto upload = pinned_area(state.upload, upload_n * 8).view(at::kLong);
    if (swb) fill_split(*wb, threshold, *swb, upload.mutable_data_ptr<int64_t>());
    if (sload) fill_split(*load, threshold, *sload, upload.mutable_data_ptr<int64_t>());
    Validation v(device);  // its status is zeroed on cur, before the event dma waits for
    const auto dev = upload.to(device, /*non_blocking=*/true);
    const auto part = [&](int64_t offset, int64_t n) { return dev.narrow(0, offset, n); };
    at::cuda::CUDAEvent uploaded;
    uploaded.record(cur);
    const auto dma = dma_stream(device.index());
    uploaded.block(dma);

    const int64_t chunk = chunk_rows(pairs);
    const auto cpu_pos = [&](const Split& sp) {
      return part(sp.at + 2 * sp.n_zc, sp.n_cpu).const_data_ptr<int64_t>();
    };

    // 1. The GPU work of both directions is queued first. Zero-copy write-back on cur; the CPU
    // side's write-back rows gathered from the batch into scratch (one launch) and copied down
    // chunk by chunk on dma; then the zero-copy load on cur, once dma has read the batch.
    at::cuda::CUDAEvent zc_wb_done, wb_read;
    std::optional<Staging> down, up;
    std::vector<at::cuda::CUDAEvent> landed;
    if (swb) {
      const Split& sp = *swb;
      if (sp.n_zc > 0) {
        DeviceIndex di(part(sp.at, sp.n_zc), part(sp.at + sp.n_zc, sp.n_zc));
        scatter_pairs(pairs, di, min_rows, tables[0], accumulate, v);
      }
      zc_wb_done.record(cur);
      if (sp.n_cpu > 0) {
        down.emplace(pairs, sp.n_cpu, device, dma, state.down);
        move_blocks(pairs, *down, /*to_batch=*/false, cpu_pos(sp), sp.n_cpu, v, dma);
        wb_read.record(dma);
        for (int64_t b = 0; b < sp.n_cpu; b += chunk) {
          down->copy_chunk(pairs, b, std::min(chunk, sp.n_cpu - b), cudaMemcpyDeviceToHost, dma);
          landed.emplace_back();
          landed.back().record(dma);
        }
      }
    }
    if (sload && sload->n_zc > 0) {
      const Split& sp = *sload;
      if (down) wb_read.block(cur);  // the batch is read before it is loaded
      DeviceIndex di(part(sp.at, sp.n_zc), part(sp.at + sp.n_zc, sp.n_zc));
      gather_pairs(pairs, di, v);
    }
    sample.zc_end->record(cur);
    sample.queued_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();

    // 2. The CPU side of the write-back, each chunk as it lands.
    for (size_t c = 0; c < landed.size(); ++c) {
      const int64_t b = static_cast<int64_t>(c) * chunk;
      const int64_t len = std::min(chunk, swb->n_cpu - b);
      landed[c].synchronize();
      const auto rows = swb->cpu_rows.narrow(0, b, len);
      for (const auto k : c10::irange(pairs.size())) {
        auto table = tables[k];
        scatter_rows_cpu(table, rows, down->rows(pairs, k, b, len, table), accumulate);
      }
    }

    // 3. The CPU side of the load: each chunk gathered into staging and copied up while the next
    // is gathered; one launch moves the rows into the batch once the zero-copy write-back (which
    // reads the batch) is done.
    if (sload && sload->n_cpu > 0) {
      const Split& sp = *sload;
      up.emplace(pairs, sp.n_cpu, device, dma, state.up);
      for (int64_t b = 0; b < sp.n_cpu; b += chunk) {
        const int64_t len = std::min(chunk, sp.n_cpu - b);
        const auto rows = sp.cpu_rows.narrow(0, b, len);
        for (const auto k : c10::irange(pairs.size())) {
          auto out = up->rows(pairs, k, b, len, tables[k]);
          gather_rows_cpu(tables[k], rows, out);
        }
        up->copy_chunk(pairs, b, len, cudaMemcpyHostToDevice, dma);
      }
      zc_wb_done.block(dma);
      move_blocks(pairs, *up, /*to_batch=*/true, cpu_pos(sp), sp.n_cpu, v, dma);
    }
    sample.dma_end->record(dma);
    sample.dma_end->block(cur);  // later work on cur follows the copies
  }
  sample.host_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  state.last_done.emplace();
  state.last_done->record(cur);  // after cur waited for dma: the end of all of this call's work
  if (fixed < 0 && share > 0 && share < 1) tuner().record(key, std::move(sample));
}

}  // namespace speedtorch_ops::cuda_impl
