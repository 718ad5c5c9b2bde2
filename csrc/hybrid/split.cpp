#include "hybrid/split.h"

#include <algorithm>
#include <cmath>

namespace speedtorch_ops::hybrid {
namespace {

// A 16-bit multiplicative hash: neighbouring rows spread over both sides.
uint32_t row_hash(int64_t row) {
  return static_cast<uint32_t>((static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ull) >> 48);
}

int64_t blocks_of(int64_t n) { return (n + kSplitBlock - 1) / kSplitBlock; }

}  // namespace

uint32_t threshold_of(double share) {
  return static_cast<uint32_t>(std::lround(std::clamp(share, 0.0, 1.0) * 65536.0));
}

bool zero_copy_row(int64_t row, uint32_t threshold) { return row_hash(row) < threshold; }

Split count_split(const int64_t* rows, int64_t n, uint32_t threshold, const ForBlocks& for_blocks) {
  Split s;
  s.n = n;
  const int64_t blocks = blocks_of(n);
  std::vector<int64_t> counts(blocks, 0);
  for_blocks(blocks, [&](int64_t b) {
    int64_t c = 0;
    for (int64_t i = b * kSplitBlock, e = std::min(n, i + kSplitBlock); i < e; ++i) {
      c += zero_copy_row(rows[i], threshold);
    }
    counts[b] = c;
  });
  s.zc_before.resize(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    s.zc_before[b] = s.n_zc;
    s.n_zc += counts[b];
  }
  s.n_cpu = n - s.n_zc;
  return s;
}

void fill_split(const int64_t* rows, uint32_t threshold, const Split& s, const SplitOut& out,
                const ForBlocks& for_blocks) {
  for_blocks(blocks_of(s.n), [&](int64_t b) {
    int64_t z = s.zc_before[b];
    int64_t c = b * kSplitBlock - z;  // CPU-side positions before this block
    for (int64_t i = b * kSplitBlock, e = std::min(s.n, i + kSplitBlock); i < e; ++i) {
      if (zero_copy_row(rows[i], threshold)) {
        out.zc_rows[z] = rows[i];
        out.zc_pos[z++] = i;
      } else {
        out.cpu_rows[c] = rows[i];
        out.cpu_pos[c++] = i;
      }
    }
  });
}

int64_t zero_copy_prefix(double share, int64_t n) {
  return std::clamp<int64_t>(std::llround(share * static_cast<double>(n)), 0, n);
}

}  // namespace speedtorch_ops::hybrid
