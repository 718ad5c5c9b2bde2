// The CPU row copies (rows_cpu.h): a gather splits its positions over the threads, a scatter
// its table rows (below).
#include "copy/rows_cpu.h"

#include "common/checks.h"
#include "common/parallel.h"
#include "copy/row_copy.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

namespace speedtorch_ops {

// A position and its row, as an owner visits them.
struct PosRow {
  int64_t pos, row;
};

// Duplicate indices must resolve deterministically (the last one wins, or all add up in index
// order). Instead of sorting, each task owns a contiguous range of table rows and visits the
// positions that fall in its range in index order: no row is written by two threads, and each
// row sees its updates in index order. The positions are bucketed by owner first (a counting
// pass and a placing pass over chunks of the index, both parallel), so every task reads only
// its own positions: O(n) work in all, not O(n x threads). One bucketing serves every table of
// a call (they share the index).
struct Owned {
  int64_t parts = 1;            // owners; 1: a single pass in index order
  // Positions with their rows, owner by owner, each owner's in index order: the owner reads
  // them in one sequential pass instead of looking each row up in the index again. Left
  // uninitialized (the placing pass writes every entry): a std::vector zeroes it first, on one
  // thread, which took as long as both parallel passes (docs/decisions.md, "The CPU scatter's
  // owner buckets").
  std::unique_ptr<PosRow[]> order;
  std::vector<int64_t> start;   // where each owner's positions start in `order` (parts + 1)
};

// The owner of a row: rows split into `parts` ranges of about equal size, by a multiply and a
// shift instead of a division (a 64-bit division costs tens of cycles, twice per position).
// Any fixed map of rows to owners keeps the writes deterministic; this one is monotonic and
// stays below `parts` for every row below `rows`.
class OwnerOf {
 public:
  OwnerOf(int64_t parts, int64_t rows) {
    const unsigned __int128 m = (static_cast<unsigned __int128>(parts) << 64) /
                                static_cast<uint64_t>(std::max<int64_t>(rows, 1));
    mul_ = m > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(m);
  }
  int64_t operator()(int64_t row) const {
    return static_cast<int64_t>((static_cast<unsigned __int128>(row) * mul_) >> 64);
  }

 private:
  uint64_t mul_ = 0;
};

template <typename index_t>
static Owned bucket_by_owner(const index_t* idx, int64_t n, int64_t rows, int64_t row_bytes) {
  Owned o;
  o.parts = is_serial(n, row_bytes) ? 1 : std::min<int64_t>(at::get_num_threads(), rows);
  if (o.parts <= 1) return o;
  const int64_t parts = o.parts;
  const OwnerOf owner_of(parts, rows);
  const int64_t chunks = std::min<int64_t>(parts * 4, (n + 4095) / 4096);
  const int64_t chunk = (n + chunks - 1) / chunks;
  // count[c * parts + p]: positions of chunk c owned by p; then, after the scan, where chunk c's
  // positions of owner p start in `order`.
  std::vector<int64_t> count(chunks * parts, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* mine = count.data() + c * parts;
      for (int64_t i = c * chunk, e = std::min(n, i + chunk); i < e; ++i) ++mine[owner_of(idx[i])];
    }
  });
  o.start.assign(parts + 1, 0);
  int64_t total = 0;
  for (int64_t p = 0; p < parts; ++p) {
    o.start[p] = total;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k = count[c * parts + p];
      count[c * parts + p] = total;
      total += k;
    }
  }
  o.start[parts] = total;
  o.order.reset(new PosRow[n]);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* next = count.data() + c * parts;
      for (int64_t i = c * chunk, e = std::min(n, i + chunk); i < e; ++i) {
        const auto row = static_cast<int64_t>(idx[i]);
        o.order[next[owner_of(row)]++] = PosRow{i, row};
      }
    }
  });
  return o;
}

// visit(i, idx[i]) for every position, each owner's in index order on one task. With `ready`,
// the source rows arrive in chunks of `ready_chunk` positions: a task calls ready(c) before it
// first reads a row of chunk c (rising c, possibly skipping some), so the writes of the chunks
// that have landed run while later ones are still on their way.
template <typename index_t, typename Visit>
static void for_each_owned(const Owned& o, const index_t* idx, int64_t n, int64_t ready_chunk,
                           const ChunkReady* ready, const Visit& visit) {
  const auto visit_ready = [&](int64_t i, int64_t row, int64_t& next) {
    if (ready != nullptr && i >= next) {
      (*ready)(i / ready_chunk);
      next = (i / ready_chunk + 1) * ready_chunk;
    }
    visit(i, row);
  };
  if (o.parts <= 1) {
    int64_t next = 0;
    for (int64_t i = 0; i < n; ++i) visit_ready(i, static_cast<int64_t>(idx[i]), next);
    end_streaming();
    return;
  }
  at::parallel_for(0, o.parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      int64_t next = 0;
      for (int64_t k = o.start[p]; k < o.start[p + 1]; ++k) {
        visit_ready(o.order[k].pos, o.order[k].row, next);
      }
    }
    end_streaming();
  });
}

void gather_rows_cpu(const at::Tensor& table, const at::Tensor& index, at::Tensor& out,
                     bool for_device) {
  const int64_t n = index.numel();
  const int64_t rb = row_bytes(table);
  if (n == 0 || rb == 0) return;
  const char* src = static_cast<const char*>(table.const_data_ptr());
  char* dst = static_cast<char*>(out.mutable_data_ptr());
  AT_DISPATCH_INDEX_TYPES(index.scalar_type(), "gather_rows_cpu", [&] {
    const index_t* idx = index.const_data_ptr<index_t>();
    const int64_t ahead = prefetch_ahead(rb, static_cast<int64_t>(table.nbytes()));
    const auto row = [&](int64_t i) { return src + static_cast<int64_t>(idx[i]) * rb; };
    // Before copying position i of a task ending at `end`: ask for the row `ahead` on.
    const auto read_ahead = [&](int64_t i, int64_t end) {
      if (ahead > 0 && i + ahead < end) prefetch_row(row(i + ahead), rb);
    };
    const int64_t grain = grain_for(n, rb, row_grain(rb));
    // Each output row is written once, so rows split across threads freely (duplicates only
    // read the same source row twice).
    if (for_device && can_stream_out(dst, rb)) {
      at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          read_ahead(i, end);
          stream_row(dst + i * rb, row(i), rb);
        }
        end_streaming();
      });
      return;
    }
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      copy_rows_cpu(dst, src, rb, begin, end, [&](int64_t i) {
        read_ahead(i, end);
        return std::pair<int64_t, int64_t>{i, idx[i]};
      });
    });
  });
}

void scatter_rows_cpu(at::Tensor& table, const at::Tensor& index, const at::Tensor& src,
                      bool accumulate) {
  scatter_rows_cpu({table}, index, {src}, accumulate, index.numel(), nullptr);
}

void scatter_rows_cpu(const std::vector<at::Tensor>& tables, const at::Tensor& index,
                      const std::vector<at::Tensor>& srcs, bool accumulate, int64_t chunk,
                      const ChunkReady* ready) {
  const int64_t n = index.numel();
  if (n == 0 || tables.empty()) return;
  // Owners split the rows every table has (every index value is below each table's rows).
  int64_t rows = tables[0].size(0), all_row_bytes = 0;
  for (const auto& t : tables) {
    rows = std::min(rows, t.size(0));
    all_row_bytes += row_bytes(t);
  }
  AT_DISPATCH_INDEX_TYPES(index.scalar_type(), "scatter_rows_cpu", [&] {
    const index_t* idx = index.const_data_ptr<index_t>();
    const Owned owned = bucket_by_owner(idx, n, rows, all_row_bytes);
    for (const auto k : c10::irange(tables.size())) {
      const at::Tensor& table = tables[k];
      const at::Tensor& src = srcs[k];
      const int64_t rb = row_bytes(table);
      if (rb == 0) continue;
      if (!accumulate) {
        char* dst = static_cast<char*>(table.mutable_data_ptr());
        const char* s = static_cast<const char*>(src.const_data_ptr());
        if (can_stream_rows(dst, rb, static_cast<int64_t>(table.nbytes()))) {
          for_each_owned(owned, idx, n, chunk, ready,
                         [&](int64_t i, int64_t r) { stream_row(dst + r * rb, s + i * rb, rb); });
          continue;
        }
        for_each_owned(owned, idx, n, chunk, ready, [&](int64_t i, int64_t r) {
          copy_rows_cpu(dst, s, rb, i, i + 1,
                        [&](int64_t) { return std::pair<int64_t, int64_t>{r, i}; });
        });
        continue;
      }
      AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, table.scalar_type(),
                                 "scatter_rows_cpu_accumulate", [&] {
        const int64_t width = rb / static_cast<int64_t>(sizeof(scalar_t));
        scalar_t* dst = table.mutable_data_ptr<scalar_t>();
        const scalar_t* s = src.const_data_ptr<scalar_t>();
        for_each_owned(owned, idx, n, chunk, ready, [&](int64_t i, int64_t r) {
          scalar_t* d = dst + r * width;
          const scalar_t* v = s + i * width;
          for (int64_t c = 0; c < width; ++c) d[c] = static_cast<scalar_t>(d[c] + v[c]);
        });
      });
    }
  });
}

}  // namespace speedtorch_ops
