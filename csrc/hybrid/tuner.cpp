#include "hybrid/tuner.h"

#include "copy/route.h"
#include "hybrid/share_search.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>

namespace speedtorch_ops::torch_cuda {
namespace {

std::atomic<double> g_fixed_share{-1.0};
std::atomic<bool> g_quick_search{false};  // the test hook (reset_hybrid_tuner)
std::atomic<int64_t> g_min_span{0};  // the test hook; 0: the default

int log2_bucket(int64_t v) {
  int b = 0;
  while (v > 1) {
    v >>= 1;
    ++b;
  }
  return b;
}

// The search's options: the defaults, or under the test hook a search that changes its share
// from the first call on, one call a share, starting in the middle.
hybrid::ShareSearch::Options search_options() {
  hybrid::ShareSearch::Options o;
  if (g_quick_search.load()) {
    o.grid = {0.5, 0.2, 0.8, 0.0};
    o.per_point = 1;
    o.warmup = 0;
  }
  return o;
}

struct Entry {
  hybrid::ShareSearch search{search_options()};
  std::optional<Sample> pending;
};

// A sampled call's time: until its last side ended (both sides' GPU work, and the host's),
// per row, since the rows of one shape of call vary up to 2x (its key's buckets).
void fold_in(const Sample& s, hybrid::ShareSearch& search) {
  const double zc_ms = s.start->elapsed_time(*s.zc_end);
  const double dma_ms = s.start->elapsed_time(*s.dma_end);
  const double ms = std::max({zc_ms, dma_ms, s.host_ms});
  search.add(s.share, ms / static_cast<double>(std::max<int64_t>(s.rows, 1)));
  if (std::getenv("SPEEDTORCH_OPS_TRACE_SPLIT") != nullptr) {
    std::fprintf(stderr, "hybrid split: %lld rows, share %.3f: %.3f ms (zero-copy %.3f ms, "
                 "copies %.3f ms, host %.3f ms, of which %.3f ms to queue the GPU work) -> %.3f%s\n",
                 static_cast<long long>(s.rows), s.share, ms, zc_ms, dma_ms, s.host_ms,
                 s.queued_ms, search.next(), search.settled() ? " (settled)" : "");
  }
}

std::mutex& tuner_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::map<TuneKey, Entry>& entries() {
  // Never destroyed: its events must not be freed after torch's CUDA state (see staging.cpp).
  static auto* e = new std::map<TuneKey, Entry>();
  return *e;
}

}  // namespace

TuneKey tune_key(c10::DeviceIndex device, bool writeback, bool load, int64_t rows,
                 int64_t row_bytes, int64_t span) {
  return {device, writeback, load, log2_bucket(rows), log2_bucket(row_bytes), log2_bucket(span),
          at::get_num_threads()};
}

double tuned_share(const TuneKey& key) {
  std::lock_guard<std::mutex> lock(tuner_mutex());
  Entry& e = entries()[key];
  if (e.pending) {
    const Sample& s = *e.pending;
    if (s.start->query() && s.zc_end->query() && s.dma_end->query()) {
      fold_in(s, e.search);
      e.pending.reset();
    }
  }
  return e.search.next();
}

void record_sample(const TuneKey& key, Sample sample) {
  std::lock_guard<std::mutex> lock(tuner_mutex());
  entries()[key].pending = std::move(sample);
}

void reset_hybrid_tuner(bool quick) {
  std::lock_guard<std::mutex> lock(tuner_mutex());
  entries().clear();
  g_quick_search.store(quick);
}

double fixed_share() { return g_fixed_share.load(); }

double set_hybrid_share(double share) {
  TORCH_CHECK(share <= 1.0, "share must be in [0, 1], or negative for automatic; got ", share);
  return g_fixed_share.exchange(share);
}

int64_t hybrid_min_span() {
  const int64_t hook = g_min_span.load();
  return hook > 0 ? hook : route::Call::kHybridMinSpan;
}

int64_t set_hybrid_min_span(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "bytes must be >= 0 (0 restores the default), got ", bytes);
  return g_min_span.exchange(bytes);
}

}  // namespace speedtorch_ops::torch_cuda
