// How the hybrid path splits an index between its two sides. A row takes the zero-copy side when
// a hash of the row is under a threshold set by the share, so a row takes the same side in the
// write-back and the load of one call: duplicates resolve on one side, and a row written back
// is loaded by the side that wrote it. Torch- and CUDA-free (the C++ tests check it); the
// caller supplies the parallel loop.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace speedtorch_ops::hybrid {

// Positions per task of the split.
constexpr int64_t kSplitBlock = int64_t{1} << 13;

// Runs task(b) for every b in [0, blocks), in any order, possibly on several threads.
using ForBlocks = std::function<void(int64_t blocks, const std::function<void(int64_t)>& task)>;

// @brief The hash threshold of a zero-copy share in [0, 1]: 0 sends every row to the CPU
// side, 1 every row to the zero-copy side.
uint32_t threshold_of(double share);

// @brief Whether `row` takes the zero-copy side under `threshold`.
bool zero_copy_row(int64_t row, uint32_t threshold);

// The sizes of one index's two sides, and where each block's zero-copy positions start.
struct Split {
  int64_t n = 0, n_zc = 0, n_cpu = 0;
  std::vector<int64_t> zc_before;  // zero-copy positions before each block
};

// @brief Counts the two sides of rows[0, n).
Split count_split(const int64_t* rows, int64_t n, uint32_t threshold, const ForBlocks& for_blocks);

// Where fill_split writes: zc_* of n_zc entries, cpu_* of n_cpu entries.
struct SplitOut {
  int64_t* zc_rows;
  int64_t* zc_pos;
  int64_t* cpu_rows;
  int64_t* cpu_pos;
};

// @brief Writes each side's rows and their positions in `rows`, the caller's order kept within
// each side. `split` is count_split's result for the same rows and threshold.
void fill_split(const int64_t* rows, uint32_t threshold, const Split& split, const SplitOut& out,
                const ForBlocks& for_blocks);

// @brief Loads split by position instead (a load has no duplicates to resolve): the zero-copy
// side takes positions [0, z) of n, z = the share of n rounded.
int64_t zero_copy_prefix(double share, int64_t n);

}  // namespace speedtorch_ops::hybrid
