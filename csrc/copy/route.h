// Which path a transfer takes: the one routing decision of the CUDA entry points, made over a
// plain description of the call. Torch- and CUDA-free, so the C++ tests check every combination.
//
// The caller passes the index on the rows' device (the GPU when rows go to a GPU); a CPU index
// with host tables and rows on a GPU is the caller's explicit choice of the hybrid path.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

namespace speedtorch_ops::route {

// Where a table's rows live, as the kernels see them.
enum class Memory {
  kDevice,        // device memory
  kMappedHost,    // pinned host memory mapped into the GPU's address space (read in place)
  kPageableHost,  // host memory no kernel can address (e.g. a memory-mapped file)
};

// What a call moves and where everything lives.
struct Call {
  bool device_tables = false;    // some table is in device memory
  bool mapped_tables = false;    // some table is mapped host memory
  bool pageable_tables = false;  // some table is pageable host memory
  bool index_on_device = false;  // the indices are on the GPU (else on the host)
  bool rows_on_device = false;   // the batch rows (out, src, batch, parts) are on the GPU
  bool capturing = false;        // the current stream is capturing a CUDA graph
  bool presorted = false;        // the caller sorted the rows (_sorted_transfer)
  bool may_wait = true;          // the call may wait for its stream (not bounds_check='prechecked')
  int64_t load_rows = 0;         // rows read from the tables into the batch
  int64_t writeback_rows = 0;    // rows written from the batch to the tables
  int64_t moved_bytes = 0;       // bytes moved in both directions, all tables together
  // bytes of a row of the call's widest table (unknown: counts as wide)
  int64_t row_bytes = std::numeric_limits<int64_t>::max();
  double hybrid_share = -1.0;    // the hybrid test hook's fixed zero-copy share; < 0: automatic
  int64_t mapped_span = 0;       // bytes of the largest host-mapped table
  // From this span up, a CUDA index over host-mapped tables takes the hybrid path, and
  // write-backs alone (no load in the call) go through the CPU (see route).
  int64_t hybrid_min_span = kHybridMinSpan;

  // Past this span random rows of a host-mapped table move faster through CPU threads and DMA
  // than through the zero-copy kernels, whose time grows with the span (a row rate: address
  // translation); below it the zero-copy kernels win and no call waits for its stream. See
  // docs/decisions.md, "The hybrid's span".
  static constexpr int64_t kHybridMinSpan = int64_t{6} << 30;
  // Loads of rows narrower than this from tables of hybrid_min_span and more go through the
  // CPU alone (see route): the zero-copy kernels' many small reads share the link with the CPU
  // side's copies, so even a small zero-copy share slows such a call. See docs/decisions.md,
  // "Narrow loads through the CPU side alone".
  static constexpr int64_t kNarrowRowBytes = 128;

  // Records one of the call's tables.
  void add(Memory memory) {
    device_tables |= memory == Memory::kDevice;
    mapped_tables |= memory == Memory::kMappedHost;
    pageable_tables |= memory == Memory::kPageableHost;
  }
};

// One table of a call, as describe() records it.
struct Table {
  Memory memory;
  int64_t bytes = 0;      // the table's size (the largest host-mapped one is the call's span)
  int64_t row_bytes = 0;  // bytes of one of its rows; 0: unknown (the call's rows count as wide)
};

// @brief The one way a call's description is built, for every entry point: `call` as its
// caller describes it (where the index and rows are, what it moves, whether it may wait), with
// what its tables determine filled in: their memories, the largest host-mapped table's span,
// the widest row, and the bytes moved (every table's row, for each row loaded or written
// back). No tables, or a table whose row is unknown: rows of unknown width, which count as wide.
Call describe(const std::vector<Table>& tables, Call call);

enum class Path {
  kCpu,             // CPU kernels: tables, index and rows on the host
  kDevice,          // device kernels over tables in device memory
  kZeroCopy,        // kernels read and write mapped host rows in place, in the caller's order
  kZeroCopySorted,  // the same, but loads read rows in address order, each distinct row once
  kHybrid,          // CPU threads + DMA beside the zero-copy kernels, the split tuned per shape
                    // (a CUDA index is brought to the host first, which waits for its stream)
  kHostStaged,      // the hybrid path's CPU side alone: CPU threads + DMA move every row
                    // (a CUDA index is brought to the host first, which waits for its stream):
                    // pageable tables, write-backs into very wide host tables, loads of narrow
                    // rows from wide ones
  // No path serves the call; the entry point raises, naming the argument and the fix.
  kRefusedRowsOnHost,   // a device table or index, but the rows on the host
  kRefusedMixedTables,  // pageable host tables beside device tables
  kRefusedCapture,      // host work (a host index, a pageable table) while capturing a graph
};

// @brief The path of `call`.
Path route(const Call& call);

// @brief Whether `path` reads the indices on the host (the caller moves them there first).
bool reads_index_on_host(Path path);

// @brief Whether `path` is one of the refusals.
bool refused(Path path);

}  // namespace speedtorch_ops::route
