// The CPU kernels' row helpers (csrc/transfer/row_copy.h) that no result can show: which rows of a
// gather are read ahead, and which cache lines a row's read-ahead asks for.
#include <catch2/catch.hpp>

#include "copy/row_copy.h"

#include <cstdint>

namespace {

using speedtorch_ops::kBeyondCacheBytes;
using speedtorch_ops::prefetch_ahead;
using speedtorch_ops::row_lines;

const void* at(uintptr_t address) { return reinterpret_cast<const void*>(address); }

}  // namespace

TEST_CASE("gathers read some 2 KiB of rows ahead, only from tables past the caches") {
  const int64_t big = kBeyondCacheBytes;
  CHECK(prefetch_ahead(512, big - 1) == 0);  // a table the caches mostly hold
  CHECK(prefetch_ahead(16, big) == 0);       // rows too small to be measured
  CHECK(prefetch_ahead(32, big) == 16);
  CHECK(prefetch_ahead(64, big) == 16);
  CHECK(prefetch_ahead(128, big) == 16);
  CHECK(prefetch_ahead(256, big) == 8);
  CHECK(prefetch_ahead(512, big) == 4);
  CHECK(prefetch_ahead(2048, big) == 1);
  CHECK(prefetch_ahead(int64_t{64} << 10, big) == 1);  // at least the next row
}

TEST_CASE("a row's read-ahead covers every line it touches, and no other") {
  CHECK(row_lines(at(0), 1) == 1);
  CHECK(row_lines(at(0), 64) == 1);
  CHECK(row_lines(at(0), 65) == 2);
  CHECK(row_lines(at(32), 64) == 2);   // starts inside a line, ends inside the next
  CHECK(row_lines(at(63), 2) == 2);
  CHECK(row_lines(at(64), 512) == 8);
  CHECK(row_lines(at(100), 512) == 9);
  CHECK(row_lines(at(128), 100) == 2);
}
