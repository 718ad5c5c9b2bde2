// The routing decision of the CUDA entry points (csrc/transfer/route.h), over every kind of call:
// it is torch- and CUDA-free, so these tests run on machines without a GPU.
#include <catch2/catch.hpp>

#include "copy/route.h"

namespace {

using speedtorch_ops::route::Call;
using speedtorch_ops::route::Memory;
using speedtorch_ops::route::Path;
using speedtorch_ops::route::route;

// A call with rows on the GPU, tables in `memory`, and `load_rows` rows loaded (4 KiB rows).
Call call(Memory memory, bool index_on_device, int64_t load_rows = 100) {
  Call c;
  c.add(memory);
  c.index_on_device = index_on_device;
  c.rows_on_device = true;
  c.load_rows = load_rows;
  c.moved_bytes = load_rows * 4096;
  c.row_bytes = 4096;
  return c;
}

// `c` with one change made by `edit`.
template <typename Edit>
Call changed(Call c, const Edit& edit) {
  edit(c);
  return c;
}

}  // namespace

TEST_CASE("route: everything on the host takes the CPU kernels") {
  Call c;
  c.add(Memory::kPageableHost);
  REQUIRE(route(c) == Path::kCpu);
  c.add(Memory::kMappedHost);
  REQUIRE(route(c) == Path::kCpu);
  REQUIRE(speedtorch_ops::route::reads_index_on_host(Path::kCpu));
}

TEST_CASE("route: a CUDA index reads device tables on the device, pinned tables in place") {
  REQUIRE(route(call(Memory::kDevice, true)) == Path::kDevice);
  REQUIRE(route(call(Memory::kDevice, true, 1 << 20)) == Path::kDevice);  // never sorted
  REQUIRE(route(call(Memory::kMappedHost, true)) == Path::kZeroCopy);
  REQUIRE(route(call(Memory::kMappedHost, true, 1 << 20)) == Path::kZeroCopySorted);
  auto presorted = call(Memory::kMappedHost, true, 10);
  presorted.presorted = true;
  REQUIRE(route(presorted) == Path::kZeroCopySorted);
  auto mixed = call(Memory::kDevice, true, 1 << 20);
  mixed.add(Memory::kMappedHost);  // one pinned store beside CUDA stores: zero-copy for all
  REQUIRE(route(mixed) == Path::kZeroCopySorted);
}

TEST_CASE("route: the sorted read starts at 32768 loaded rows") {
  REQUIRE(route(call(Memory::kMappedHost, true, 32767)) == Path::kZeroCopy);
  REQUIRE(route(call(Memory::kMappedHost, true, 32768)) == Path::kZeroCopySorted);
}

TEST_CASE("route: write-backs go in sorted order only into host tables wider than 256 MiB") {
  auto wb = call(Memory::kMappedHost, true, 0);
  wb.writeback_rows = 1 << 20;
  wb.mapped_span = int64_t{256} << 20;
  REQUIRE(route(wb) == Path::kZeroCopy);
  wb.mapped_span += 1;
  REQUIRE(route(wb) == Path::kZeroCopySorted);
  auto device = call(Memory::kDevice, true, 0);
  device.writeback_rows = 1 << 20;
  REQUIRE(route(device) == Path::kDevice);
}

TEST_CASE("route: write-backs alone into a very wide host table go through the CPU") {
  const auto lone_writeback = [](bool on_device) {
    auto wb = call(Memory::kMappedHost, on_device, 0);
    wb.writeback_rows = 1000;
    wb.moved_bytes = 1000 * 4096;
    wb.mapped_span = Call::kHybridMinSpan;
    return wb;
  };
  for (bool on_device : {true, false}) {
    const auto wb = lone_writeback(on_device);
    REQUIRE(route(wb) == Path::kHostStaged);
    REQUIRE(speedtorch_ops::route::reads_index_on_host(route(wb)));
    // rows of every width, by either index, from the hybrid's span up
    auto narrower = changed(wb, [](Call& c) { c.mapped_span = Call::kHybridMinSpan - 1; });
    REQUIRE(route(narrower) == (on_device ? Path::kZeroCopySorted : Path::kHybrid));
    auto narrow_rows = changed(wb, [](Call& c) { c.row_bytes = Call::kNarrowRowBytes - 1; });
    REQUIRE(route(narrow_rows) == Path::kHostStaged);
    narrow_rows.mapped_span = Call::kHybridMinSpan - 1;
    REQUIRE(route(narrow_rows) == (on_device ? Path::kZeroCopySorted : Path::kHybrid));
    narrower.hybrid_min_span = 1 << 20;  // the test hook
    REQUIRE(route(narrower) == Path::kHostStaged);
    auto with_load = wb;  // a swap keeps its split (or zero-copy)
    with_load.load_rows = 1000;
    REQUIRE(route(with_load) == (on_device ? Path::kZeroCopySorted : Path::kHybrid));
    auto forced_whole = wb;
    forced_whole.hybrid_share = 1.0;  // the share hook's "zero-copy alone"
    REQUIRE(route(forced_whole) == Path::kZeroCopySorted);
  }
  // A CUDA index that must not wait, or is being captured, or was sorted by the caller stays on
  // the GPU; a CPU index waits anyway.
  const auto wb = lone_writeback(true);
  REQUIRE(route(changed(wb, [](Call& c) { c.may_wait = false; })) == Path::kZeroCopySorted);
  REQUIRE(route(changed(wb, [](Call& c) { c.capturing = true; })) == Path::kZeroCopySorted);
  REQUIRE(route(changed(wb, [](Call& c) { c.presorted = true; })) == Path::kZeroCopySorted);
  REQUIRE(route(changed(wb, [](Call& c) {
            c.index_on_device = false;
            c.may_wait = false;
          })) == Path::kHostStaged);
}

TEST_CASE("route: a pageable table moves through the CPU side, whatever the index's device") {
  for (bool on_device : {true, false}) {
    const auto path = route(call(Memory::kPageableHost, on_device));
    REQUIRE(path == Path::kHostStaged);
    REQUIRE(speedtorch_ops::route::reads_index_on_host(path));
  }
  auto beside_pinned = call(Memory::kMappedHost, true);
  beside_pinned.add(Memory::kPageableHost);
  REQUIRE(route(beside_pinned) == Path::kHostStaged);
}

TEST_CASE("route: a CPU index with host tables is the hybrid path, when it pays") {
  auto small = call(Memory::kMappedHost, false, 10);  // 40 KiB: zero-copy alone, index uploaded
  REQUIRE(route(small) == Path::kZeroCopy);
  REQUIRE_FALSE(speedtorch_ops::route::reads_index_on_host(Path::kZeroCopy));
  auto large = call(Memory::kMappedHost, false, 1000);  // 4 MB
  REQUIRE(route(large) == Path::kHybrid);
  // The test hook's fixed share: below 1 always splits, 1 is zero-copy alone.
  small.hybrid_share = 0.0;
  REQUIRE(route(small) == Path::kHybrid);
  large.hybrid_share = 1.0;
  REQUIRE(route(large) == Path::kZeroCopy);
}

TEST_CASE("route: a CPU index with device tables is uploaded, never hybrid") {
  REQUIRE(route(call(Memory::kDevice, false, 1 << 20)) == Path::kDevice);
  auto mixed = call(Memory::kDevice, false, 1000);
  mixed.add(Memory::kMappedHost);
  REQUIRE(route(mixed) == Path::kZeroCopy);
}

TEST_CASE("route: impossible combinations are refused") {
  auto mixed = call(Memory::kDevice, true);
  mixed.add(Memory::kPageableHost);
  REQUIRE(route(mixed) == Path::kRefusedMixedTables);

  for (auto memory : {Memory::kDevice, Memory::kMappedHost, Memory::kPageableHost}) {
    auto host_index = call(memory, false);
    host_index.capturing = true;
    REQUIRE(route(host_index) == Path::kRefusedCapture);
  }
  auto pageable = call(Memory::kPageableHost, true);
  pageable.capturing = true;
  REQUIRE(route(pageable) == Path::kRefusedCapture);
  for (auto memory : {Memory::kDevice, Memory::kMappedHost}) {  // capturable
    auto device_index = call(memory, true);
    device_index.capturing = true;
    REQUIRE_FALSE(speedtorch_ops::route::refused(route(device_index)));
  }

  Call rows_on_host;
  rows_on_host.add(Memory::kDevice);
  REQUIRE(route(rows_on_host) == Path::kRefusedRowsOnHost);
  Call index_on_device;
  index_on_device.add(Memory::kMappedHost);
  index_on_device.index_on_device = true;
  REQUIRE(route(index_on_device) == Path::kRefusedRowsOnHost);
  for (auto path : {Path::kRefusedRowsOnHost, Path::kRefusedMixedTables, Path::kRefusedCapture}) {
    REQUIRE(speedtorch_ops::route::refused(path));
  }
}

TEST_CASE("route: a CUDA index over a huge pinned table takes the hybrid path") {
  auto huge = call(Memory::kMappedHost, true, 1000);  // 4 MB moved
  huge.mapped_span = Call::kHybridMinSpan;
  REQUIRE(route(huge) == Path::kHybrid);
  REQUIRE(speedtorch_ops::route::reads_index_on_host(route(huge)));
  auto below = huge;
  below.mapped_span = Call::kHybridMinSpan - 1;
  REQUIRE(route(below) == Path::kZeroCopy);
  below.hybrid_min_span = 1 << 20;  // the test hook's lower threshold
  REQUIRE(route(below) == Path::kHybrid);
  // Never where the call must not wait or the host cannot help.
  REQUIRE(route(changed(huge, [](Call& c) { c.capturing = true; })) == Path::kZeroCopy);
  REQUIRE(route(changed(huge, [](Call& c) { c.presorted = true; })) == Path::kZeroCopySorted);
  REQUIRE(route(changed(huge, [](Call& c) { c.add(Memory::kDevice); })) == Path::kZeroCopy);
  // bounds_check='prechecked': the caller must not wait
  REQUIRE(route(changed(huge, [](Call& c) { c.may_wait = false; })) == Path::kZeroCopy);
  // with a write-back: zero-copy, sorted writes past 256 MiB
  REQUIRE(route(changed(huge, [](Call& c) { c.writeback_rows = 1; })) ==
          Path::kZeroCopySorted);
  auto small = call(Memory::kMappedHost, true, 10);  // 40 KiB: not worth a wait
  small.mapped_span = Call::kHybridMinSpan;
  REQUIRE(route(small) == Path::kZeroCopy);
  auto forced_whole = huge;
  forced_whole.hybrid_share = 1.0;  // the share hook's "zero-copy alone"
  REQUIRE(route(forced_whole) == Path::kZeroCopy);
}

TEST_CASE("route: loads of narrow rows from a huge host table go through the CPU alone") {
  for (bool on_device : {true, false}) {
    auto narrow = call(Memory::kMappedHost, on_device, 100000);  // 6.4 MB of 64 B rows
    narrow.row_bytes = Call::kNarrowRowBytes / 2;
    narrow.moved_bytes = 100000 * narrow.row_bytes;
    narrow.mapped_span = Call::kHybridMinSpan;
    REQUIRE(route(narrow) == Path::kHostStaged);
    // rows as wide as the threshold, a narrower table, a write-back beside the load, or the
    // test hook's share: the split, as before
    REQUIRE(route(changed(narrow, [](Call& c) { c.row_bytes = Call::kNarrowRowBytes; })) ==
            Path::kHybrid);
    REQUIRE(route(changed(narrow, [](Call& c) { c.mapped_span = Call::kHybridMinSpan - 1; })) ==
            (on_device ? Path::kZeroCopySorted : Path::kHybrid));
    REQUIRE(route(changed(narrow, [](Call& c) { c.writeback_rows = 1; })) ==
            (on_device ? Path::kZeroCopySorted : Path::kHybrid));
    REQUIRE(route(changed(narrow, [](Call& c) { c.hybrid_share = 0.5; })) == Path::kHybrid);
  }
  // A CUDA index that must not wait, or is being captured, stays on the GPU.
  auto narrow = call(Memory::kMappedHost, true, 100000);
  narrow.row_bytes = 64;
  narrow.mapped_span = Call::kHybridMinSpan;
  REQUIRE(route(changed(narrow, [](Call& c) { c.may_wait = false; })) == Path::kZeroCopySorted);
  REQUIRE(route(changed(narrow, [](Call& c) { c.capturing = true; })) == Path::kZeroCopySorted);
}

TEST_CASE("describe: a call's tables and moves as route reads them") {
  using speedtorch_ops::route::describe;
  Call asked;
  asked.load_rows = 10;
  asked.writeback_rows = 4;
  asked.index_on_device = asked.rows_on_device = true;
  asked.may_wait = false;
  const Call c = describe({{Memory::kMappedHost, int64_t{8} << 30, 512},
                           {Memory::kMappedHost, int64_t{1} << 30, 1024},
                           {Memory::kDevice, int64_t{16} << 30, 256}},
                          asked);
  REQUIRE(c.mapped_tables);
  REQUIRE(c.device_tables);
  REQUIRE_FALSE(c.pageable_tables);
  REQUIRE(c.mapped_span == int64_t{8} << 30);  // the largest mapped table, not the device one
  REQUIRE(c.row_bytes == 1024);                // the widest row
  REQUIRE(c.moved_bytes == 14 * (512 + 1024 + 256));
  REQUIRE(c.load_rows == 10);
  REQUIRE(c.writeback_rows == 4);
  REQUIRE(c.index_on_device);
  REQUIRE(c.rows_on_device);
  REQUIRE_FALSE(c.may_wait);
  REQUIRE(c.hybrid_min_span == Call::kHybridMinSpan);
  // Built field by field, the same call routes the same way.
  Call by_hand;
  by_hand.add(Memory::kMappedHost);
  by_hand.add(Memory::kDevice);
  by_hand.mapped_span = int64_t{8} << 30;
  by_hand.row_bytes = 1024;
  by_hand.moved_bytes = c.moved_bytes;
  by_hand.load_rows = 10;
  by_hand.writeback_rows = 4;
  by_hand.index_on_device = by_hand.rows_on_device = true;
  by_hand.may_wait = false;
  REQUIRE(route(c) == route(by_hand));
  // No tables, or a row of unknown width: the rows count as wide.
  REQUIRE(describe({}, asked).row_bytes == std::numeric_limits<int64_t>::max());
  REQUIRE(describe({{Memory::kMappedHost}}, asked).row_bytes ==
          std::numeric_limits<int64_t>::max());
}
