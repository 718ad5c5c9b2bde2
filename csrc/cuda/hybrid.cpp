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
constexpr int64_t kChunkBytes = int64_t{4} << 20;
// Positions per task of the index split.
constexpr int64_t kSplitBlock = int64_t{1} << 15;

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
  static Tuner t;
  return t;
}

// Rows of `like`'s row shape and dtype over host bytes at `ptr`.
at::Tensor host_rows(char* ptr, const at::Tensor& like, int64_t n) {
  auto sizes = like.sizes().vec();
  sizes[0] = n;
  return at::from_blob(ptr, sizes, at::TensorOptions(like.scalar_type()));
}

at::Tensor upload_via_pinned(const at::Tensor& host, const c10::Device& device) {
  auto pinned = at::empty(host.sizes(), host.options().pinned_memory(true));
  pinned.copy_(host);
  return pinned.to(device, /*non_blocking=*/true);  // torch keeps `pinned` until the copy ran
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

  bool mapped = true;
  int64_t total_rb = 0, span = 0;
  for (const auto& t : tables) {
    mapped = mapped && is_mapped_host(t);
    total_rb += row_bytes(t);
    span = std::max<int64_t>(span, t.nbytes());
  }
  if (total_rb == 0) return;
  std::vector<Pair> pairs;
  for (const auto k : c10::irange(tables.size())) {
    pairs.push_back({mapped ? device_rows(tables[k], "stores", device) : nullptr,
                     static_cast<char*>(batch[k].mutable_data_ptr()), row_bytes(tables[k]), true});
  }

  // The share of rows for the zero-copy side: none for tables a kernel cannot address
  // (pageable memory), all for small transfers, else tuned.
  const Key key{device.index(), wb.has_value(), load.has_value(), log2_bucket(n_wb + n_load),
                log2_bucket(total_rb), log2_bucket(span), at::get_num_threads()};
  const double fixed = g_fixed_share.load();
  const double share = !mapped         ? 0.0
                       : fixed >= 0    ? fixed
                       : (n_wb + n_load) * total_rb < kHybridMinBytes ? 1.0
                                                                      : tuner().share(key);
  const int64_t min_rows = tables[0].size(0);

  if (share >= 1.0) {  // zero-copy only: the indices go up through pinned memory, no host wait
    Validation v(device);  // nothing to validate on the device: the values were checked
    if (wb) {
      DeviceIndex di(upload_via_pinned(*wb, device), std::nullopt);
      scatter_pairs(pairs, di, min_rows, tables[0], accumulate, v);
    }
    if (load) {
      DeviceIndex di(upload_via_pinned(*load, device), std::nullopt);
      gather_pairs(pairs, di, v);
    }
    return;
  }

  auto start = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
  start->record(cur);
  start->synchronize();  // the host touches tables and batch only after the work queued before
  const auto t0 = Clock::now();

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
  auto upload = at::empty({upload_n}, at::TensorOptions(at::kLong).pinned_memory(true));
  if (swb) fill_split(*wb, threshold, *swb, upload.mutable_data_ptr<int64_t>());
  if (sload) fill_split(*load, threshold, *sload, upload.mutable_data_ptr<int64_t>());
  Validation v(device);  // its status is zeroed on cur, before the event dma waits for
  const auto dev = upload.to(device, /*non_blocking=*/true);
  const auto part = [&](int64_t offset, int64_t n) { return dev.narrow(0, offset, n); };
  at::cuda::CUDAEvent uploaded;
  uploaded.record(cur);
  const auto dma = at::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
  uploaded.block(dma);

  const bool has_zc = (swb && swb->n_zc > 0) || (sload && sload->n_zc > 0);
  const bool has_cpu = (swb && swb->n_cpu > 0) || (sload && sload->n_cpu > 0);
  const cuda::Grid grid = v.grid();

  // Write-back.
  at::cuda::CUDAEvent zc_wb_done, wb_read;
  if (swb) {
    const Split& s = *swb;
    if (s.n_zc > 0) {
      DeviceIndex di(part(s.at, s.n_zc), part(s.at + s.n_zc, s.n_zc));
      scatter_pairs(pairs, di, min_rows, tables[0], accumulate, v);
    }
    zc_wb_done.record(cur);
    if (s.n_cpu > 0) {
      const auto off = block_offsets(pairs, s.n_cpu);
      auto scratch = at::empty({off.back()}, at::TensorOptions(at::kByte).device(device));
      auto staging = at::empty({off.back()}, at::TensorOptions(at::kByte).pinned_memory(true));
      char* d = static_cast<char*>(scratch.mutable_data_ptr());
      char* h = static_cast<char*>(staging.mutable_data_ptr());
      cuda::Tables t{};
      std::vector<at::cuda::CUDAEvent> landed;
      const int64_t chunk = std::max<int64_t>(1024, kChunkBytes / total_rb);
      for (size_t first = 0; first < pairs.size(); first += cuda::kMaxTables) {
        t.count = static_cast<int>(std::min<size_t>(cuda::kMaxTables, pairs.size() - first));
        for (int k = 0; k < t.count; ++k) {
          t.dst[k] = d + off[first + k];
          t.src[k] = pairs[first + k].batch;
          t.row_bytes[k] = pairs[first + k].row_bytes;
        }
        C10_CUDA_CHECK(cuda::launch_copy_rows(
            t, nullptr, part(s.at + 2 * s.n_zc, s.n_cpu).const_data_ptr<int64_t>(), s.n_cpu,
            false, nullptr, v.status(), grid, dma));
      }
      wb_read.record(dma);
      for (int64_t b = 0; b < s.n_cpu; b += chunk) {
        const int64_t len = std::min(chunk, s.n_cpu - b);
        for (const auto k : c10::irange(pairs.size())) {
          const int64_t o = off[k] + b * pairs[k].row_bytes;
          C10_CUDA_CHECK(cudaMemcpyAsync(h + o, d + o, len * pairs[k].row_bytes,
                                         cudaMemcpyDeviceToHost, dma));
        }
        landed.emplace_back();
        landed.back().record(dma);
      }
      for (int64_t b = 0, c = 0; b < s.n_cpu; b += chunk, ++c) {
        const int64_t len = std::min(chunk, s.n_cpu - b);
        landed[c].synchronize();
        const auto rows = s.cpu_rows.narrow(0, b, len);
        for (const auto k : c10::irange(pairs.size())) {
          auto table = tables[k];
          scatter_rows_cpu(table, rows, host_rows(h + off[k] + b * pairs[k].row_bytes, table, len),
                           accumulate);
        }
      }
    }
  }

  // Load.
  if (sload) {
    const Split& s = *sload;
    if (s.n_zc > 0) {
      if (swb && swb->n_cpu > 0) wb_read.block(cur);  // the batch is read before it is loaded
      DeviceIndex di(part(s.at, s.n_zc), part(s.at + s.n_zc, s.n_zc));
      gather_pairs(pairs, di, v);
    }
    if (s.n_cpu > 0) {
      zc_wb_done.block(dma);  // likewise for the rows the zero-copy write-back reads
      const auto off = block_offsets(pairs, s.n_cpu);
      auto scratch = at::empty({off.back()}, at::TensorOptions(at::kByte).device(device));
      auto staging = at::empty({off.back()}, at::TensorOptions(at::kByte).pinned_memory(true));
      char* d = static_cast<char*>(scratch.mutable_data_ptr());
      char* h = static_cast<char*>(staging.mutable_data_ptr());
      const int64_t chunk = std::max<int64_t>(1024, kChunkBytes / total_rb);
      for (int64_t b = 0; b < s.n_cpu; b += chunk) {
        const int64_t len = std::min(chunk, s.n_cpu - b);
        const auto rows = s.cpu_rows.narrow(0, b, len);
        for (const auto k : c10::irange(pairs.size())) {
          auto out = host_rows(h + off[k] + b * pairs[k].row_bytes, tables[k], len);
          gather_rows_cpu(tables[k], rows, out);
        }
        for (const auto k : c10::irange(pairs.size())) {
          const int64_t o = off[k] + b * pairs[k].row_bytes;
          C10_CUDA_CHECK(cudaMemcpyAsync(d + o, h + o, len * pairs[k].row_bytes,
                                         cudaMemcpyHostToDevice, dma));
        }
      }
      cuda::Tables t{};
      for (size_t first = 0; first < pairs.size(); first += cuda::kMaxTables) {
        t.count = static_cast<int>(std::min<size_t>(cuda::kMaxTables, pairs.size() - first));
        for (int k = 0; k < t.count; ++k) {
          t.dst[k] = pairs[first + k].batch;
          t.src[k] = d + off[first + k];
          t.row_bytes[k] = pairs[first + k].row_bytes;
        }
        C10_CUDA_CHECK(cuda::launch_copy_rows(
            t, part(s.at + 2 * s.n_zc, s.n_cpu).const_data_ptr<int64_t>(), nullptr, s.n_cpu,
            false, nullptr, v.status(), grid, dma));
      }
      // The staging memory returns to torch's pinned cache only after the copies ran.
      const auto& ptr = staging.storage().data_ptr();
      at::getHostAllocator(at::kCUDA)->record_event(ptr.get(), ptr.get_context(), dma.unwrap());
    }
  }
  const double host_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  auto zc_end = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
  auto dma_end = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
  zc_end->record(cur);
  dma_end->record(dma);
  dma_end->block(cur);  // later work on cur (and frees of the scratch buffers) follows the copies
  if (fixed < 0 && has_zc && has_cpu) tuner().record(key, {start, zc_end, dma_end, share, host_ms});
}

}  // namespace speedtorch_ops::cuda_impl
