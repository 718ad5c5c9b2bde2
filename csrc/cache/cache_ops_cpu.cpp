// CPU kernels of the row cache's device ops (registration.cpp has their contracts). Each is one pass in
// order over a step's ids (a scan: the positions depend on everything before them), but the
// row moves, whose rows are independent.
#include "cache/cache_checks.h"
#include "common/checks.h"
#include "common/parallel.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <vector>

namespace speedtorch_ops {
namespace {

// The widest digit of the radix sort below: 2^11 counters (16 KiB) stay in the L1 cache.
constexpr int kRadixBits = 11;

// The radix sort of keys below 2^32 (every table's rows but the largest) and fewer than 2^32:
// each key and its position packed in one word, the key above, so that a pass reads and
// writes one array, not two; every pass's counts come from one read of the keys, and the last
// pass writes the keys and positions apart, into out_k and out_p (digits as kRadixBits).
void packed_radix_sort(const int64_t* in, int64_t n, int bits, int64_t* out_k, int64_t* out_p) {
  const int passes = (bits + kRadixBits - 1) / kRadixBits;
  const int digit = (bits + passes - 1) / passes;
  const uint64_t mask = (uint64_t{1} << digit) - 1;
  const size_t buckets = size_t{1} << digit;
  std::vector<int64_t> start(buckets * passes, 0);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t k = static_cast<uint64_t>(in[i]);
    for (int pass = 0; pass < passes; ++pass) ++start[pass * buckets + ((k >> (pass * digit)) & mask)];
  }
  for (int pass = 0; pass < passes; ++pass) {
    int64_t total = 0;
    for (size_t b = 0; b < buckets; ++b) {
      const int64_t c = start[pass * buckets + b];
      start[pass * buckets + b] = total;
      total += c;
    }
  }
  std::unique_ptr<uint64_t[]> words(new uint64_t[n]), spare(passes > 2 ? new uint64_t[n] : nullptr);
  uint64_t* src = nullptr;
  uint64_t* dst = words.get();
  for (int pass = 0; pass < passes; ++pass) {
    int64_t* at = start.data() + pass * buckets;
    const int shift = 32 + pass * digit;  // the key's digit within a word
    if (pass == 0) {
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t w = (static_cast<uint64_t>(in[i]) << 32) | static_cast<uint64_t>(i);
        dst[at[(w >> shift) & mask]++] = w;
      }
    } else if (pass == passes - 1) {
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t w = src[i];
        const int64_t to = at[(w >> shift) & mask]++;
        out_k[to] = static_cast<int64_t>(w >> 32);
        out_p[to] = static_cast<int64_t>(w & 0xffffffffu);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) dst[at[(src[i] >> shift) & mask]++] = src[i];
    }
    src = dst;
    dst = dst == words.get() ? spare.get() : words.get();
  }
  if (passes == 1) {
    for (int64_t i = 0; i < n; ++i) {
      out_k[i] = static_cast<int64_t>(src[i] >> 32);
      out_p[i] = static_cast<int64_t>(src[i] & 0xffffffffu);
    }
  }
}

// (keys sorted ascending, stably; the position of each) of 1-D int64 keys. Up to a pass's
// serial size (serial_bytes(): a key and its position a pass, read and written), a radix sort
// on the calling thread, a pass per 11 bits of the largest key or fewer (two passes for a
// table of up to 4 M rows), where at::sort compares (below 32 k keys: O(n log n)) or sorts
// every byte on all threads (from 32 k keys: parallel regions that join the threads several
// times). Larger inputs go to at::sort where more than two threads share its passes (with one
// or two the radix sort stays ahead at any size); keys below zero (trusted never to come;
// sorted all the same) go there too. See docs/decisions.md, "The CPU sort of a step's ids".
std::tuple<at::Tensor, at::Tensor> stable_sort_ids(const at::Tensor& keys_in) {
  const auto keys = keys_in.contiguous();
  const int64_t n = keys.numel();
  if (!is_serial(n, 2 * static_cast<int64_t>(sizeof(int64_t))) && at::get_num_threads() > 2) {
    return at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  }
  const int64_t* in = keys.const_data_ptr<int64_t>();
  int64_t lo = 0, hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    lo = std::min(lo, in[i]);
    hi = std::max(hi, in[i]);
  }
  if (lo < 0) return at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  auto sorted = at::empty({n}, keys.options());
  auto perm = at::empty({n}, keys.options());
  int64_t* out_k = sorted.mutable_data_ptr<int64_t>();
  int64_t* out_p = perm.mutable_data_ptr<int64_t>();
  const int bits = hi == 0 ? 0 : 64 - __builtin_clzll(static_cast<uint64_t>(hi));
  if (bits == 0) {  // every key is zero: already sorted
    std::fill(out_k, out_k + n, 0);
    for (int64_t i = 0; i < n; ++i) out_p[i] = i;
    return {sorted, perm};
  }
  if (bits <= 32 && n <= (int64_t{1} << 32)) {
    packed_radix_sort(in, n, bits, out_k, out_p);
    return {sorted, perm};
  }
  const int passes = (bits + kRadixBits - 1) / kRadixBits;
  const int digit = (bits + passes - 1) / passes;  // even digits: fewer counters per pass
  const uint64_t mask = (uint64_t{1} << digit) - 1;
  std::vector<int64_t> start(size_t{1} << digit);
  // Passes alternate between the outputs and scratch, so that the last lands in the outputs.
  std::unique_ptr<int64_t[]> tmp_k, tmp_p;
  if (passes > 1) {
    tmp_k.reset(new int64_t[n]);
    tmp_p.reset(new int64_t[n]);
  }
  const int64_t* src_k = in;
  const int64_t* src_p = nullptr;  // the first pass reads positions 0, 1, ...
  for (int pass = 0; pass < passes; ++pass) {
    const bool to_out = (passes - 1 - pass) % 2 == 0;
    int64_t* dst_k = to_out ? out_k : tmp_k.get();
    int64_t* dst_p = to_out ? out_p : tmp_p.get();
    const int shift = pass * digit;
    std::fill(start.begin(), start.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++start[(static_cast<uint64_t>(src_k[i]) >> shift) & mask];
    int64_t total = 0;
    for (auto& s : start) {
      const int64_t c = s;
      s = total;
      total += c;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t to = start[(static_cast<uint64_t>(src_k[i]) >> shift) & mask]++;
      dst_k[to] = src_k[i];
      dst_p[to] = src_p != nullptr ? src_p[i] : i;
    }
    src_k = dst_k;
    src_p = dst_p;
  }
  return {sorted, perm};
}

std::tuple<at::Tensor, at::Tensor> sort_ids_cpu(const at::Tensor& keys, int64_t bound) {
  check_sort_ids_args(keys, "keys", bound);
  return stable_sort_ids(keys);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> distinct_cpu(
    const at::Tensor& index, int64_t bound) {
  check_sort_ids_args(index, "index", bound);
  check_items(index, "index");
  const int64_t n = index.numel();
  auto [sorted, perm] = stable_sort_ids(index);
  auto ids = at::empty({n}, index.options());
  auto inverse = at::empty({n}, index.options());
  auto count = at::empty({1}, index.options());
  auto starts = at::empty({n + 1}, index.options());
  const int64_t* s = sorted.const_data_ptr<int64_t>();
  const int64_t* p = perm.const_data_ptr<int64_t>();
  int64_t* out = ids.mutable_data_ptr<int64_t>();
  int64_t* inv = inverse.mutable_data_ptr<int64_t>();
  int64_t* st = starts.mutable_data_ptr<int64_t>();
  int64_t r = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (i == 0 || s[i] != s[i - 1]) {
      out[++r] = s[i];
      st[r] = i;
    }
    inv[p[i]] = r;
  }
  std::fill(out + (r + 1), out + n, 0);  // on this thread: a zeros() of a large n is a region
  std::fill(st + (r + 1), st + n + 1, n);
  *count.mutable_data_ptr<int64_t>() = r + 1;
  return {ids, inverse, count, perm, starts};
}

std::tuple<at::Tensor, at::Tensor> partition_cpu(const at::Tensor& flags) {
  check_partition_args(flags);
  const int64_t n = flags.numel();
  auto order = at::empty({n}, flags.options().dtype(at::kLong));
  const bool* f = flags.const_data_ptr<bool>();
  int64_t* o = order.mutable_data_ptr<int64_t>();
  int64_t front = 0, back = n;
  for (int64_t i = 0; i < n; ++i) {
    if (f[i]) {
      o[front++] = i;
    } else {
      o[--back] = i;  // the others from the back: descending, as the CUDA kernel leaves them
    }
  }
  return {order, at::full({1}, front, order.options())};
}

std::tuple<at::Tensor, at::Tensor> cache_lookup_cpu(const at::Tensor& ids, const at::Tensor& count,
                                                    const at::Tensor& slot_of, at::Tensor& freq,
                                                    int64_t scratch) {
  check_cache_lookup_args(ids, count, slot_of, freq, scratch);
  const int64_t n = ids.numel();
  auto at_slot = at::full({n}, scratch, ids.options());
  auto miss = at::zeros({n}, ids.options().dtype(at::kBool));
  const int64_t valid = std::min(n, count.item<int64_t>());  // a CPU tensor: no wait
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const int32_t* slot = slot_of.const_data_ptr<int32_t>();
  float* f = freq.mutable_data_ptr<float>();
  int64_t* a = at_slot.mutable_data_ptr<int64_t>();
  bool* m = miss.mutable_data_ptr<bool>();
  const int64_t rows = slot_of.numel();
  for (int64_t i = 0; i < valid; ++i) {
    if (id[i] < 0 || id[i] >= rows) continue;  // out of range (trusted, never expected)
    const int32_t s = slot[id[i]];
    if (s >= 0) a[i] = s;
    m[i] = s < 0;
    f[id[i]] += 1.0f;
  }
  return {at_slot, miss};
}

std::tuple<at::Tensor, at::Tensor> coldest_slots_cpu(const at::Tensor& id_of,
                                                     const at::Tensor& freq, const at::Tensor& at,
                                                     int64_t k,
                                                     const c10::optional<at::Tensor>& hand,
                                                     int64_t window) {
  check_coldest_slots_args(id_of, freq, at, k, hand, window);
  const int64_t slots = id_of.numel();
  const int64_t w = window > 0 ? window : slots;
  int64_t* h = window > 0 ? hand->mutable_data_ptr<int64_t>() : nullptr;
  const int64_t start = h != nullptr && slots > 0 ? ((*h % slots) + slots) % slots : 0;
  // Candidate i is slot (start + i) mod slots.
  auto prio = at::empty({w}, freq.options());
  auto slot = at::empty({w}, id_of.options());
  const int64_t* id = id_of.const_data_ptr<int64_t>();
  const float* f = freq.const_data_ptr<float>();
  float* p = prio.mutable_data_ptr<float>();
  int64_t* sl = slot.mutable_data_ptr<int64_t>();
  const int64_t rows = freq.numel();
  for (int64_t i = 0; i < w; ++i) {
    const int64_t s = (start + i) % slots;
    sl[i] = s;
    p[i] = id[s] >= 0 && id[s] < rows ? f[id[s]] : -1.0f;
  }
  const int64_t* used = at.const_data_ptr<int64_t>();
  for (int64_t j = 0; j < at.numel(); ++j) {
    if (used[j] < 0 || used[j] >= slots) continue;
    const int64_t i = (used[j] - start + slots) % slots;
    if (i < w) p[i] = std::numeric_limits<float>::infinity();
  }
  if (h != nullptr && k > 0) *h = (start + w) % slots;  // as the CUDA kernels: k = 0 does nothing
  auto [cold, order] = at::sort(prio, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  auto victims = slot.index_select(0, order.narrow(0, 0, k));
  return {victims, cold.narrow(0, 0, k).contiguous()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> admission_cpu(
    const at::Tensor& ids, const at::Tensor& first, const at::Tensor& victims,
    const at::Tensor& cold, const at::Tensor& misses, const at::Tensor& freq,
    const at::Tensor& id_of, bool by_frequency) {
  check_admission_args(ids, first, victims, cold, misses, freq, id_of);
  const int64_t k = first.numel(), n = ids.numel(), rows = freq.numel(), slots = id_of.numel();
  auto admit = at::empty({k}, ids.options().dtype(at::kBool));
  auto keys = at::empty({k}, ids.options());
  const int64_t m = misses.item<int64_t>();  // a CPU tensor: no wait
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const int64_t* pos = first.const_data_ptr<int64_t>();
  const int64_t* vic = victims.const_data_ptr<int64_t>();
  const float* c = cold.const_data_ptr<float>();
  const float* f = freq.const_data_ptr<float>();
  const int64_t* held = id_of.const_data_ptr<int64_t>();
  bool* yes = admit.mutable_data_ptr<bool>();
  int64_t* key = keys.mutable_data_ptr<int64_t>();
  int64_t evicted = 0;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t row = pos[j] >= 0 && pos[j] < n ? id[pos[j]] : -1;
    bool ok = j < m && std::isfinite(c[j]) && row >= 0 && row < rows && vic[j] >= 0 &&
              vic[j] < slots;
    if (ok && by_frequency) ok = f[row] > c[j];
    const int64_t old = ok ? held[vic[j]] : -1;
    const bool evict = old >= 0 && old < rows;
    yes[j] = ok;
    key[j] = evict ? old : rows;
    evicted += evict;
  }
  return {admit, keys, at::full({1}, evicted, keys.options())};
}

at::Tensor cache_admit_cpu(at::Tensor& slot_of, at::Tensor& id_of, const at::Tensor& ids,
                           const at::Tensor& at, const at::Tensor& first,
                           const at::Tensor& victims, const at::Tensor& admit) {
  check_cache_admit_args(slot_of, id_of, ids, at, first, victims, admit);
  auto dest = at.clone();
  int32_t* slot = slot_of.mutable_data_ptr<int32_t>();
  int64_t* held = id_of.mutable_data_ptr<int64_t>();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const int64_t* pos = first.const_data_ptr<int64_t>();
  const int64_t* vic = victims.const_data_ptr<int64_t>();
  const bool* yes = admit.const_data_ptr<bool>();
  int64_t* d = dest.mutable_data_ptr<int64_t>();
  const int64_t rows = slot_of.numel(), slots = id_of.numel(), n = ids.numel();
  for (int64_t j = 0; j < first.numel(); ++j) {
    // Out-of-range entries (trusted, never expected) are skipped, as on the GPU.
    if (!yes[j] || vic[j] < 0 || vic[j] >= slots || pos[j] < 0 || pos[j] >= n) continue;
    const int64_t v = vic[j], row = id[pos[j]];
    if (row < 0 || row >= rows) continue;
    if (held[v] >= 0 && held[v] < rows) slot[held[v]] = -1;
    slot[row] = static_cast<int32_t>(v);
    held[v] = row;
    d[pos[j]] = v;
  }
  return dest;
}

// The rows of i < min(len(index), count) whose index[i] is a row of the slots' tensor, each
// part one memcpy (take: out[:, i] = src[:, index[i]]; put: dst[:, index[i]] = src[:, i]).
void move_rows_cpu(at::Tensor& dst, const at::Tensor& src, const at::Tensor& index,
                   const at::Tensor& count, bool take) {
  check_move_rows_args(dst, src, index, count, take);
  const int64_t n = std::min(index.numel(), std::max<int64_t>(count.item<int64_t>(), 0));
  const int64_t parts = dst.size(0);
  if (n == 0 || parts == 0) return;
  const int64_t item = dst.element_size();
  const int64_t row = c10::multiply_integers(dst.sizes().slice(2)) * item;
  const int64_t dst_part = dst.stride(0) * item, src_part = src.stride(0) * item;
  const int64_t dst_row = dst.stride(1) * item, src_row = src.stride(1) * item;
  const int64_t slots = take ? src.size(1) : dst.size(1);
  auto* out = static_cast<char*>(dst.mutable_data_ptr());
  const auto* in = static_cast<const char*>(src.const_data_ptr());
  const int64_t* idx = index.const_data_ptr<int64_t>();
  at::parallel_for(0, n, grain_for(n, row * parts, 2048), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t j = idx[i];
      if (j < 0 || j >= slots) continue;  // -1, or past the rows (a miss): nothing moves
      const int64_t to = take ? i : j, from = take ? j : i;
      for (int64_t k = 0; k < parts; ++k) {
        std::memcpy(out + k * dst_part + to * dst_row, in + k * src_part + from * src_row, row);
      }
    }
  });
}

void take_rows_cpu(at::Tensor& out, const at::Tensor& src, const at::Tensor& index,
                   const at::Tensor& count) {
  move_rows_cpu(out, src, index, count, /*take=*/true);
}

void put_rows_cpu(at::Tensor& dst, const at::Tensor& src, const at::Tensor& index,
                  const at::Tensor& count) {
  move_rows_cpu(dst, src, index, count, /*take=*/false);
}

void age_frequencies_cpu(at::Tensor& freq, at::Tensor& age, int64_t period) {
  check_age_args(freq, age, period);
  int64_t* steps = age.mutable_data_ptr<int64_t>();
  if (++*steps % period == 0) freq.mul_(0.5);
}

}  // namespace

TORCH_LIBRARY_IMPL(speedtorch_ops, CPU, m) {
  m.impl("_sort_ids", &sort_ids_cpu);
  m.impl("_distinct", &distinct_cpu);
  m.impl("_partition", &partition_cpu);
  m.impl("_cache_lookup", &cache_lookup_cpu);
  m.impl("_coldest_slots", &coldest_slots_cpu);
  m.impl("_admission", &admission_cpu);
  m.impl("_cache_admit", &cache_admit_cpu);
  m.impl("_take_rows", &take_rows_cpu);
  m.impl("_put_rows", &put_rows_cpu);
  m.impl("_age_frequencies", &age_frequencies_cpu);
}

}  // namespace speedtorch_ops
