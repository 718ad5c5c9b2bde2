#include "copy/route.h"

#include <algorithm>

namespace speedtorch_ops::route {
namespace {

// Loads at least this long read host-mapped tables in sorted order, each distinct row once:
// PCIe reads in address order reach the link rate on multi-GiB tables, where random rows are
// capped by a row rate, and repeated rows cross the link once. Shorter loads, and tables in
// device memory (where a sort costs more than it saves), are read in the caller's order; rows
// the caller sorted always take the sorted read (it costs nothing then). Below this many rows
// the sort's own launches cost more than the ordered reads save. See docs/decisions.md,
// "Sorted loads".
constexpr int64_t kSortedLoadMin = 32768;

// Write-backs into host-mapped tables wider than this go in sorted order (each distinct row
// written once, by the last position of its run). Narrower ones go in the caller's order, the
// last position of each row marked first (launch_mark_last) instead of sorted: fewer launches
// and no sort's host time, and random writes there are as fast as sorted ones. Past this span
// random writes hit a row rate (address translation) that the link hides
// only for wide rows. See docs/decisions.md, "Sorted write-backs".
constexpr int64_t kUnsortedWriteMaxSpan = int64_t{256} << 20;

// Hybrid calls smaller than this go through the zero-copy kernels alone: the CPU side's host
// wait and staging would cost more than they save.
constexpr int64_t kHybridMinBytes = int64_t{2} << 20;

bool hybrid_pays(const Call& c) {
  if (c.hybrid_share >= 0) return c.hybrid_share < 1.0;  // the test hook forces a split
  return c.moved_bytes >= kHybridMinBytes;
}

// A call the hybrid serves: loads of narrow rows from a table of hybrid_min_span and more go
// through the CPU side alone. The zero-copy kernels move such rows at a small fraction of the
// CPU side's rate (a row rate caps them there, whatever the row's size), and even the tuner's
// smallest share of them slowed the call: their many small reads share the link with the
// CPU side's copies. The test hook's share still forces a split.
Path split_or_cpu(const Call& c) {
  const bool narrow_load = c.writeback_rows == 0 && c.row_bytes < Call::kNarrowRowBytes &&
                           c.mapped_span >= c.hybrid_min_span && c.hybrid_share < 0;
  return narrow_load ? Path::kHostStaged : Path::kHybrid;
}

}  // namespace

Call describe(const std::vector<Table>& tables, Call call) {
  int64_t total_row_bytes = 0, widest = 0;
  bool unknown = tables.empty();
  for (const auto& t : tables) {
    call.add(t.memory);
    if (t.memory == Memory::kMappedHost) call.mapped_span = std::max(call.mapped_span, t.bytes);
    total_row_bytes += t.row_bytes;
    widest = std::max(widest, t.row_bytes);
    unknown |= t.row_bytes <= 0;
  }
  call.row_bytes = unknown ? Call{}.row_bytes : widest;  // unknown: counted as wide
  call.moved_bytes = (call.load_rows + call.writeback_rows) * total_row_bytes;
  return call;
}

Path route(const Call& c) {
  if (!c.rows_on_device) {
    return c.index_on_device || c.device_tables ? Path::kRefusedRowsOnHost : Path::kCpu;
  }
  if ((c.pageable_tables || !c.index_on_device) && c.capturing) return Path::kRefusedCapture;
  if (c.pageable_tables) return c.device_tables ? Path::kRefusedMixedTables : Path::kHostStaged;
  // Write-backs alone into a very wide host table: CPU threads write random rows there faster
  // than the zero-copy kernels, which a row rate caps (address translation), and than a split
  // between both (its hash split and scratch cost more than the zero-copy share saves). A CUDA
  // index comes to the host (a wait for its stream), so not for calls that must not wait.
  if (!c.device_tables && c.writeback_rows > 0 && c.load_rows == 0 && !c.presorted &&
      (!c.index_on_device || (c.may_wait && !c.capturing)) &&
      c.mapped_span >= c.hybrid_min_span && hybrid_pays(c)) {
    return Path::kHostStaged;
  }
  if (!c.index_on_device && !c.device_tables && hybrid_pays(c)) return split_or_cpu(c);
  if (!c.mapped_tables) return Path::kDevice;
  // Random rows of a huge host table: the zero-copy kernels are capped by a row rate
  // (address translation) that CPU threads do not have, so a CUDA index comes to the host (one
  // wait for its stream, the price of the faster path) and the hybrid splits the rows. Loads
  // only (write-backs: above), and not for calls that must not wait (rows the caller sorted,
  // 'prechecked': the stores' steps) or under capture.
  if (c.index_on_device && !c.device_tables && !c.presorted && c.may_wait && !c.capturing &&
      c.writeback_rows == 0 && c.mapped_span >= c.hybrid_min_span && hybrid_pays(c)) {
    return split_or_cpu(c);
  }
  const bool sorted_writes = c.writeback_rows > 0 && c.mapped_span > kUnsortedWriteMaxSpan;
  return c.presorted || c.load_rows >= kSortedLoadMin || sorted_writes ? Path::kZeroCopySorted
                                                                        : Path::kZeroCopy;
}

bool reads_index_on_host(Path path) {
  return path == Path::kCpu || path == Path::kHybrid || path == Path::kHostStaged;
}

bool refused(Path path) {
  return path == Path::kRefusedRowsOnHost || path == Path::kRefusedMixedTables ||
         path == Path::kRefusedCapture;
}

}  // namespace speedtorch_ops::route
