// The hybrid path's index split (csrc/hybrid/split.h): torch- and CUDA-free arithmetic,
// checked against a plain sequential split on random indices.
#include <catch2/catch.hpp>

#include "hybrid/split.h"

#include <random>
#include <thread>
#include <vector>

namespace {

namespace hybrid = speedtorch_ops::hybrid;

void sequential(int64_t blocks, const std::function<void(int64_t)>& task) {
  for (int64_t b = 0; b < blocks; ++b) task(b);
}

// Blocks in reverse order on two threads: the split must not depend on the order.
void threaded(int64_t blocks, const std::function<void(int64_t)>& task) {
  std::thread odd([&] {
    for (int64_t b = blocks - 1; b >= 0; --b) {
      if (b % 2) task(b);
    }
  });
  for (int64_t b = blocks - 1; b >= 0; --b) {
    if (b % 2 == 0) task(b);
  }
  odd.join();
}

std::vector<int64_t> random_rows(int64_t n, int64_t rows) {
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_int_distribution<int64_t> pick(0, rows - 1);
  std::vector<int64_t> out(n);
  for (auto& r : out) r = pick(rng);
  return out;
}

}  // namespace

TEST_CASE("split: each side keeps the caller's order and together they cover the index") {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{100}, hybrid::kSplitBlock,
                    3 * hybrid::kSplitBlock + 17}) {
    for (double share : {0.0, 0.37, 0.5, 1.0}) {
      for (const auto& for_blocks : {hybrid::ForBlocks(sequential), hybrid::ForBlocks(threaded)}) {
        const auto rows = random_rows(n, 5000);
        const uint32_t threshold = hybrid::threshold_of(share);
        const auto s = hybrid::count_split(rows.data(), n, threshold, for_blocks);
        REQUIRE(s.n == n);
        REQUIRE(s.n_zc + s.n_cpu == n);
        std::vector<int64_t> zc_rows(s.n_zc), zc_pos(s.n_zc), cpu_rows(s.n_cpu), cpu_pos(s.n_cpu);
        hybrid::fill_split(rows.data(), threshold, s,
                           {zc_rows.data(), zc_pos.data(), cpu_rows.data(), cpu_pos.data()},
                           for_blocks);
        std::vector<int64_t> want_zc, want_cpu;
        for (int64_t i = 0; i < n; ++i) {
          (hybrid::zero_copy_row(rows[i], threshold) ? want_zc : want_cpu).push_back(i);
        }
        REQUIRE(zc_pos == want_zc);
        REQUIRE(cpu_pos == want_cpu);
        for (int64_t j = 0; j < s.n_zc; ++j) REQUIRE(zc_rows[j] == rows[zc_pos[j]]);
        for (int64_t j = 0; j < s.n_cpu; ++j) REQUIRE(cpu_rows[j] == rows[cpu_pos[j]]);
        if (share == 0.0) REQUIRE(s.n_zc == 0);
        if (share == 1.0) REQUIRE(s.n_cpu == 0);
      }
    }
  }
}

TEST_CASE("split: a row takes the same side every time, and the share is roughly kept") {
  const uint32_t threshold = hybrid::threshold_of(0.25);
  int64_t zc = 0;
  const int64_t rows = 1 << 16;
  for (int64_t r = 0; r < rows; ++r) {
    const bool side = hybrid::zero_copy_row(r, threshold);
    REQUIRE(side == hybrid::zero_copy_row(r, threshold));
    zc += side;
  }
  REQUIRE(zc > rows / 5);
  REQUIRE(zc < rows * 3 / 10);
}

TEST_CASE("split: loads split by position, the share of n rounded and clamped") {
  REQUIRE(hybrid::zero_copy_prefix(0.0, 1000) == 0);
  REQUIRE(hybrid::zero_copy_prefix(1.0, 1000) == 1000);
  REQUIRE(hybrid::zero_copy_prefix(0.3333, 3) == 1);
  REQUIRE(hybrid::zero_copy_prefix(0.5, 0) == 0);
  REQUIRE(hybrid::zero_copy_prefix(1.5, 10) == 10);
  REQUIRE(hybrid::threshold_of(0.0) == 0);
  REQUIRE(hybrid::threshold_of(1.0) == 65536);
}
