#include "speedtorch_ops/checks.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace speedtorch_ops {

void check_index(const at::Tensor& index, const char* name) {
  TORCH_CHECK(index.dim() == 1, name, " must be a 1-D tensor of row numbers, got ", index.dim(),
              "-D with shape ", index.sizes(), "; pass ", name, ".reshape(-1)");
  TORCH_CHECK(index.scalar_type() == at::kLong || index.scalar_type() == at::kInt, name,
              " must be int64 or int32, got ", index.scalar_type(), "; pass ", name,
              ".long()");
}

void check_table(const at::Tensor& table, const char* name) {
  TORCH_CHECK(table.dim() >= 1, name, " must have at least one dimension (rows along dim 0)");
  TORCH_CHECK(table.is_contiguous(), name,
              " must be contiguous: rows are read in place, so a copy would not be written "
              "back; pass a contiguous table (e.g. .contiguous() once, before training)");
}

int64_t row_bytes(const at::Tensor& table) {
  int64_t elems = 1;
  for (const auto d : c10::irange(1, table.dim())) elems *= table.size(d);
  return elems * static_cast<int64_t>(table.element_size());
}

namespace {
// See serial_bytes() in checks.h and docs/decisions.md, "Serial CPU passes".
constexpr int64_t kSerialBytes = int64_t{1} << 20;
std::atomic<int64_t> serial_threshold{kSerialBytes};
}  // namespace

int64_t serial_bytes() { return serial_threshold.load(std::memory_order_relaxed); }

int64_t set_serial_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "the serial threshold must be >= 0 bytes (0: the default), got ",
              bytes);
  return serial_threshold.exchange(bytes == 0 ? kSerialBytes : bytes);
}

bool is_serial(int64_t n, int64_t item_bytes) {
  // n * item_bytes < serial_bytes(), without overflow for any n
  return item_bytes <= 0 || n <= (serial_bytes() - 1) / item_bytes;
}

int64_t grain_for(int64_t n, int64_t item_bytes, int64_t parallel_grain) {
  return is_serial(n, item_bytes) ? std::max<int64_t>(n, 1)
                                  : std::max<int64_t>(parallel_grain, 1);
}

void check_rows_like(const at::Tensor& rows, const char* name, const at::Tensor& table,
                     int64_t n, const c10::Device& device) {
  TORCH_CHECK(rows.device() == device, name, " must be on ", device, ", got ", rows.device());
  TORCH_CHECK(rows.scalar_type() == table.scalar_type(), name, " must have the table's dtype ",
              table.scalar_type(), ", got ", rows.scalar_type());
  std::vector<int64_t> expected{n};
  for (const auto d : c10::irange(1, table.dim())) expected.push_back(table.size(d));
  TORCH_CHECK(rows.sizes() == at::IntArrayRef(expected), name, " must have shape ",
              at::IntArrayRef(expected), " (one row per index, the table's row shape), got ",
              rows.sizes());
}

void check_no_overlap(const at::Tensor& a, const char* a_name, const at::Tensor& b,
                      const char* b_name) {
  if (a.numel() == 0 || b.numel() == 0) return;
  // Byte span covered by each tensor (conservative for non-contiguous views).
  auto span = [](const at::Tensor& t) {
    int64_t last = 0;
    for (const auto d : c10::irange(t.dim())) last += (t.size(d) - 1) * t.stride(d);
    const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
    return std::make_pair(begin, begin + (last + 1) * t.element_size());
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  TORCH_CHECK(a1 <= b0 || b1 <= a0, a_name, " and ", b_name,
              " share memory; pass separate tensors (e.g. ", b_name, ".clone())");
}

void check_index_values(const at::Tensor& index, int64_t rows, const char* name) {
  const int64_t n = index.numel();
  std::atomic<int64_t> first_bad{std::numeric_limits<int64_t>::max()};
  AT_DISPATCH_INDEX_TYPES(index.scalar_type(), "check_index_values", [&] {
    const index_t* idx = index.const_data_ptr<index_t>();
    const int64_t grain = grain_for(n, static_cast<int64_t>(sizeof(index_t)), 1 << 14);
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t v = idx[i];
        if (v < 0 || v >= rows) {
          int64_t seen = first_bad.load();
          while (i < seen && !first_bad.compare_exchange_weak(seen, i)) {
          }
          return;
        }
      }
    });
    const int64_t bad = first_bad.load();
    TORCH_CHECK(bad == std::numeric_limits<int64_t>::max(), name, "[", bad, "] = ",
                static_cast<int64_t>(idx[bad]), " is out of range for a table of ", rows,
                " rows; every index must be in [0, ", rows, ")");
  });
}

BoundsCheck parse_bounds_check(c10::string_view mode) {
  if (mode == "deferred") return BoundsCheck::kDeferred;
  if (mode == "raise") return BoundsCheck::kRaise;
  if (mode == "prechecked") return BoundsCheck::kPrechecked;
  TORCH_CHECK(false, "bounds_check must be 'deferred' (no wait: a bad CUDA index raises at the "
              "next call on its GPU), 'raise' (a bad index raises in the failing call, which "
              "waits for the GPU) or 'prechecked' (the caller validated the indices: no wait, no "
              "error), got '", mode, "'; a bad index writes nothing in every mode");
}

void check_accumulate_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16: case at::kChar:
    case at::kByte: case at::kShort: case at::kInt: case at::kLong: case at::kBool:
      return;
    default:
      TORCH_CHECK(false, "accumulate=True supports float, half, bfloat16, double, int8, uint8, "
                  "int16, int32, int64 and bool tables, got ", dtype);
  }
}

void check_gather_into_args(const at::Tensor& table, const at::Tensor& index,
                            const at::Tensor& out, const c10::Device& device) {
  check_table(table, "table");
  check_index(index, "index");
  check_rows_like(out, "out", table, index.numel(), device);
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous (it is written in place)");
  check_no_overlap(out, "out", table, "table");
  check_no_overlap(out, "out", index, "index");
}

at::Tensor gather_output(const at::Tensor& table, const at::Tensor& index) {
  check_table(table, "table");
  check_index(index, "index");
  auto sizes = table.sizes().vec();
  sizes[0] = index.numel();
  return at::empty(sizes, table.options().device(index.device()).pinned_memory(false));
}

void check_scatter_args(const at::Tensor& table, const at::Tensor& index, const at::Tensor& src,
                        bool accumulate, const c10::Device& device) {
  check_table(table, "table");
  check_index(index, "index");
  check_rows_like(src, "src", table, index.numel(), device);
  check_no_overlap(table, "table", src, "src");
  check_no_overlap(table, "table", index, "index");
  if (accumulate) check_accumulate_dtype(table.scalar_type());
}

void check_swap_args(at::TensorList stores, at::TensorList batch,
                     const std::optional<at::Tensor>& writeback_index,
                     const std::optional<at::Tensor>& load_index,
                     const c10::Device& batch_device) {
  const std::pair<const std::optional<at::Tensor>*, const char*> indices[] = {
      {&writeback_index, "writeback_index"}, {&load_index, "load_index"}};
  for (const auto& [idx, name] : indices) {
    if (idx->has_value()) check_index(**idx, name);
  }
  TORCH_CHECK(stores.size() == batch.size(), "stores and batch must pair up: got ",
              stores.size(), " stores and ", batch.size(), " batch tensors");
  auto named = [](const char* list, size_t k) { return std::string(list) + "[" + std::to_string(k) + "]"; };
  for (const auto k : c10::irange(stores.size())) {
    const auto& store = stores[k];
    const auto& b = batch[k];
    const auto store_name = named("stores", k);
    const auto batch_name = named("batch", k);
    check_table(store, store_name.c_str());
    TORCH_CHECK(b.dim() >= 1 && b.is_contiguous(), batch_name,
                " must be a contiguous tensor of batch rows (it is written in place)");
    check_rows_like(b, batch_name.c_str(), store, b.size(0), batch_device);
    for (const auto& [idx, name] : indices) {
      if (!idx->has_value()) continue;
      TORCH_CHECK((*idx)->numel() == b.size(0), name, " has ", (*idx)->numel(), " entries but ",
                  batch_name, " has ", b.size(0), " rows; both must equal the batch size");
      check_no_overlap(b, batch_name.c_str(), **idx, name);
      check_no_overlap(store, store_name.c_str(), **idx, name);
    }
    for (const auto j : c10::irange(stores.size())) {
      check_no_overlap(b, batch_name.c_str(), stores[j], named("stores", j).c_str());
      if (j == k) continue;
      check_no_overlap(b, batch_name.c_str(), batch[j], named("batch", j).c_str());
      check_no_overlap(store, store_name.c_str(), stores[j], named("stores", j).c_str());
    }
  }
}

c10::Device check_sorted_transfer_args(const at::Tensor& table, at::TensorList parts,
                                       const at::Tensor& sorted_rows, const at::Tensor& slots,
                                       const std::optional<at::Tensor>& count, int64_t sms) {
  TORCH_CHECK(!parts.empty(), "parts must hold at least one tensor");
  TORCH_CHECK(sms >= 0, "sms must be >= 0 (0: the process-wide transfer SM limit), got ", sms);
  const auto device = parts[0].device();
  check_table(table, "table");
  check_index(sorted_rows, "sorted_rows");
  check_index(slots, "slots");
  TORCH_CHECK(table.dim() >= 2 && table.size(1) == static_cast<int64_t>(parts.size()),
              "table must have shape (rows, len(parts), ...) = (rows, ", parts.size(),
              ", ...), got ", table.sizes());
  TORCH_CHECK(slots.numel() == sorted_rows.numel(), "slots has ", slots.numel(),
              " entries but sorted_rows has ", sorted_rows.numel(), "; pass one slot per row");
  TORCH_CHECK(sorted_rows.device() == device && slots.device() == device, "sorted_rows and slots "
              "must be on ", device, " (where parts are), got ", sorted_rows.device(), " and ",
              slots.device());
  const auto part_like = table.select(1, 0);  // the shape and dtype of one part of a row
  for (const auto k : c10::irange(parts.size())) {
    const auto name = "parts[" + std::to_string(k) + "]";
    check_rows_like(parts[k], name.c_str(), part_like, parts[0].size(0), device);
    TORCH_CHECK(parts[k].is_contiguous(), name, " must be contiguous (it is read and written in "
                "place)");
    check_no_overlap(parts[k], name.c_str(), table, "table");
    check_no_overlap(parts[k], name.c_str(), sorted_rows, "sorted_rows");
    check_no_overlap(parts[k], name.c_str(), slots, "slots");
    for (const auto j : c10::irange(k)) {
      const auto other = "parts[" + std::to_string(j) + "]";
      check_no_overlap(parts[k], name.c_str(), parts[j], other.c_str());
    }
  }
  check_no_overlap(table, "table", sorted_rows, "sorted_rows");
  check_no_overlap(table, "table", slots, "slots");
  if (count) {
    TORCH_CHECK(count->scalar_type() == at::kLong && count->numel() == 1, "count must be one "
                "int64 value, got ", count->scalar_type(), " of shape ", count->sizes());
    TORCH_CHECK(count->device() == device, "count must be on ", device, " (where parts are), "
                "got ", count->device());
  }
  return device;
}

namespace {

void check_vector(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& like,
                       const char* like_name) {
  TORCH_CHECK(t.device() == like.device(), name, " must be on ", like_name, "'s device ",
              like.device(), ", got ", t.device());
}

// A step's rows, gradients or state: float32, float64, float16 or bfloat16 (the kernels' Math
// types); returns the dtype.
at::ScalarType check_step_float(const at::Tensor& t, const char* name) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
                  dtype == at::kBFloat16,
              name, " must be float32, float64, float16 or bfloat16, got ", dtype);
  return dtype;
}

// (rows, dim) with each row's elements contiguous and rows any stride (>= dim) apart.
bool is_row_matrix(const at::Tensor& t) {
  return t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1) && t.stride(0) >= t.size(1);
}

struct Vector {
  const at::Tensor& tensor;
  const char* name;
  at::ScalarType dtype;
};

// Each of `vectors` 1-D, of its dtype, contiguous, on the first one's device.
void check_vectors(std::initializer_list<Vector> vectors) {
  const Vector& first = *vectors.begin();
  for (const Vector& v : vectors) {
    check_vector(v.tensor, v.name, v.dtype);
    check_same_device(v.tensor, v.name, first.tensor, first.name);
  }
}

// One int64 (shape (1,)) on `like`'s device: a count kept on the device.
void check_one_int64(const at::Tensor& t, const char* name, const at::Tensor& like,
                     const char* like_name) {
  TORCH_CHECK(t.numel() == 1 && t.scalar_type() == at::kLong && t.is_contiguous(), name,
              " must be one int64 (shape (1,)), got ", t.scalar_type(), " of shape ", t.sizes());
  check_same_device(t, name, like, like_name);
}

}  // namespace

void check_items(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.numel() <= std::numeric_limits<int32_t>::max(), name, " has ", t.numel(),
              " entries; at most 2^31 - 1 per call");
}

void check_sort_ids_args(const at::Tensor& keys, const char* name, int64_t bound) {
  check_vector(keys, name, at::kLong);
  TORCH_CHECK(bound >= 1, "bound must be at least 1 (the keys are below it), got ", bound);
}

void check_partition_args(const at::Tensor& flags) {
  check_vector(flags, "flags", at::kBool);
  check_items(flags, "flags");
}

void check_cache_lookup_args(const at::Tensor& ids, const at::Tensor& count,
                             const at::Tensor& slot_of, const at::Tensor& freq, int64_t scratch) {
  check_vectors({{ids, "ids", at::kLong}, {slot_of, "slot_of", at::kInt},
                 {freq, "freq", at::kFloat}});
  check_one_int64(count, "count", ids, "ids");
  TORCH_CHECK(freq.numel() == slot_of.numel(), "freq must have slot_of's length ",
              slot_of.numel(), " (one entry per table row), got ", freq.numel());
  TORCH_CHECK(scratch >= 0, "scratch must be a slot number (>= 0), got ", scratch);
}

void check_coldest_slots_args(const at::Tensor& id_of, const at::Tensor& freq,
                              const at::Tensor& at, int64_t k,
                              const c10::optional<at::Tensor>& hand, int64_t window) {
  check_vectors({{id_of, "id_of", at::kLong}, {freq, "freq", at::kFloat}, {at, "at", at::kLong}});
  check_items(id_of, "id_of");
  TORCH_CHECK(k >= 0 && k <= id_of.numel(), "k must be in [0, ", id_of.numel(),
              "] (the number of slots), got ", k);
  if (window > 0) {
    TORCH_CHECK(window >= k && window <= id_of.numel(), "window must be in [k, slots] = [", k,
                ", ", id_of.numel(), "], got ", window);
    TORCH_CHECK(hand.has_value(), "hand is required with a window (where the window starts)");
    check_one_int64(*hand, "hand", id_of, "id_of");
  } else {
    TORCH_CHECK(window == 0, "window must be >= 0 (0: every slot), got ", window);
  }
}

void check_admission_args(const at::Tensor& ids, const at::Tensor& first,
                          const at::Tensor& victims, const at::Tensor& cold,
                          const at::Tensor& misses, const at::Tensor& freq,
                          const at::Tensor& id_of) {
  check_vectors({{ids, "ids", at::kLong}, {first, "first", at::kLong},
                 {victims, "victims", at::kLong}, {cold, "cold", at::kFloat},
                 {freq, "freq", at::kFloat}, {id_of, "id_of", at::kLong}});
  check_one_int64(misses, "misses", ids, "ids");
  TORCH_CHECK(victims.numel() == first.numel() && cold.numel() == first.numel(),
              "first, victims and cold must have one length, got ", first.numel(), ", ",
              victims.numel(), " and ", cold.numel());
}

void check_cache_admit_args(const at::Tensor& slot_of, const at::Tensor& id_of,
                            const at::Tensor& ids, const at::Tensor& at, const at::Tensor& first,
                            const at::Tensor& victims, const at::Tensor& admit) {
  check_vectors({{slot_of, "slot_of", at::kInt}, {id_of, "id_of", at::kLong},
                 {ids, "ids", at::kLong}, {at, "at", at::kLong}, {first, "first", at::kLong},
                 {victims, "victims", at::kLong}, {admit, "admit", at::kBool}});
  TORCH_CHECK(victims.numel() == first.numel() && admit.numel() == first.numel(),
              "first, victims and admit must have one length, got ", first.numel(), ", ",
              victims.numel(), " and ", admit.numel());
  TORCH_CHECK(first.numel() <= at.numel(), "first must not be longer than at (", at.numel(),
              "), got ", first.numel());
}

namespace {

// (parts, rows, ...) with each row's elements (dims 2 on) contiguous, rows any stride at
// least a row apart (a record's first bytes, say), parts not overlapping.
void check_strided_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() >= 2, name, " must have at least 2 dimensions (parts, rows, ...), got "
              "shape ", t.sizes());
  int64_t step = 1;
  for (int64_t d = t.dim() - 1; d >= 2; --d) {
    TORCH_CHECK(t.size(d) <= 1 || t.stride(d) == step, name,
                " must have each row contiguous (dims 2 on), got strides ", t.strides());
    step *= std::max<int64_t>(t.size(d), 1);
  }
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) >= step, name, " must not have overlapping rows, "
              "got strides ", t.strides(), " for shape ", t.sizes());
  const int64_t part = t.size(1) <= 1 ? step : t.stride(1) * t.size(1);
  TORCH_CHECK(t.size(0) <= 1 || t.stride(0) >= part, name,
              " must not have overlapping parts, got strides ", t.strides());
}

}  // namespace

void check_move_rows_args(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& index,
                          const at::Tensor& count, bool take) {
  const char* dst_name = take ? "out" : "dst";
  check_strided_rows(dst, dst_name);
  check_strided_rows(src, "src");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "src must have ", dst_name, "'s dtype ",
              dst.scalar_type(), ", got ", src.scalar_type());
  check_same_device(src, "src", dst, dst_name);
  TORCH_CHECK(src.size(0) == dst.size(0) && src.sizes().slice(2) == dst.sizes().slice(2),
              "src must have ", dst_name, "'s parts and row shape (dims 0 and 2 on), got ",
              src.sizes(), " and ", dst.sizes());
  check_vector(index, "index", at::kLong);
  check_same_device(index, "index", dst, dst_name);
  check_one_int64(count, "count", index, "index");
  const auto& positions = take ? dst : src;
  TORCH_CHECK(index.numel() <= positions.size(1), "index must have at most ",
              take ? "out" : "src", "'s ", positions.size(1), " rows (one entry a position), got ",
              index.numel());
  check_no_overlap(dst, dst_name, src, "src");
  check_no_overlap(dst, dst_name, index, "index");
  check_no_overlap(dst, dst_name, count, "count");
}

void check_age_args(const at::Tensor& freq, const at::Tensor& age, int64_t period) {
  check_vector(freq, "freq", at::kFloat);
  check_one_int64(age, "age", freq, "freq");
  TORCH_CHECK(period >= 1, "period must be at least 1 (steps between halvings), got ", period);
}

void check_segment_sum_args(at::TensorList grads, const at::Tensor& perm,
                            const at::Tensor& starts, const at::Tensor& count, int64_t rows) {
  TORCH_CHECK(!grads.empty(), "grads must hold at least one tensor (the rows' gradients)");
  const at::Tensor& first = grads[0];
  const auto dtype = check_step_float(first, "grads");
  int64_t n = 0;
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& g = grads[k];
    TORCH_CHECK(g.dim() == 2 && g.is_contiguous(), "grads[", k, "] must be a contiguous "
                "(positions, dim) tensor, got shape ", g.sizes());
    TORCH_CHECK(g.size(1) == first.size(1), "grads[", k, "] must have grads[0]'s ",
                first.size(1), " columns, got ", g.size(1));
    TORCH_CHECK(g.scalar_type() == dtype, "grads[", k, "] must be ", dtype, " like grads[0], got ",
                g.scalar_type());
    const std::string name = "grads[" + std::to_string(k) + "]";
    check_same_device(g, name.c_str(), first, "grads[0]");
    n += g.size(0);
  }
  check_vectors({{perm, "perm", at::kLong}, {starts, "starts", at::kLong}});
  check_same_device(perm, "perm", first, "grads[0]");
  TORCH_CHECK(perm.numel() == n, "perm must have one entry a row of grads (", n, "), got ",
              perm.numel());
  TORCH_CHECK(starts.numel() >= 1, "starts must hold at least one entry (segments + 1)");
  check_one_int64(count, "count", first, "grads[0]");
  TORCH_CHECK(rows >= 0, "rows must be >= 0, got ", rows);
  check_items(perm, "perm");
}

void check_gather_staged_args(const at::Tensor& rows, const at::Tensor& index,
                            const c10::optional<at::Tensor>& cache,
                            const c10::optional<at::Tensor>& at) {
  const auto dtype = check_step_float(rows, "rows");
  TORCH_CHECK(is_row_matrix(rows),
              "rows must be (rows, dim) with each row's elements contiguous, got shape ",
              rows.sizes(), " strides ", rows.strides());
  check_vectors({{index, "index", at::kLong}});
  check_same_device(index, "index", rows, "rows");
  TORCH_CHECK(cache.has_value() == at.has_value(), "cache and at go together: give both or "
              "neither");
  if (!cache.has_value()) return;
  TORCH_CHECK(is_row_matrix(*cache) && cache->size(1) == rows.size(1),
              "cache must be (slots, ", rows.size(1), ") with each row's elements contiguous, "
              "got shape ", cache->sizes(), " strides ", cache->strides());
  TORCH_CHECK(cache->scalar_type() == dtype, "cache must be ", dtype, " like rows, got ",
              cache->scalar_type());
  check_same_device(*cache, "cache", rows, "rows");
  check_vectors({{*at, "at", at::kLong}});
  check_same_device(*at, "at", rows, "rows");
  TORCH_CHECK(at->numel() >= rows.size(0), "at must have an entry a row of rows (",
              rows.size(0), "), got ", at->numel());
}

void check_peer_rows_args(const at::Tensor& ptrs, int64_t offset, const at::Tensor& rank_of,
                          const at::Tensor& row_of, int64_t dim) {
  check_vectors({{rank_of, "rank_of", at::kLong}, {row_of, "row_of", at::kLong},
                 {ptrs, "ptrs", at::kLong}});
  TORCH_CHECK(rank_of.numel() == row_of.numel(), "rank_of and row_of must have one entry a row "
              "each, got ", rank_of.numel(), " and ", row_of.numel());
  TORCH_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
  TORCH_CHECK(dim >= 0, "dim must be >= 0, got ", dim);
}

namespace {

// A stochastic rounding's (seed, counter) beside the tensor it rounds into.
void check_rounding(const at::Tensor& r, const at::Tensor& beside, const char* name) {
  TORCH_CHECK(r.dim() == 1 && r.numel() == 2 && r.scalar_type() == at::kLong && r.is_contiguous(),
              "rounding must be a contiguous int64 tensor of 2 values (seed, counter), got ",
              r.scalar_type(), " of shape ", r.sizes());
  check_same_device(r, "rounding", beside, name);
}

}  // namespace

int64_t check_fused_update_args(const at::Tensor& buf, const at::Tensor& grad,
                                const at::Tensor& count, const c10::optional<at::Tensor>& step,
                                int64_t rule, c10::ArrayRef<double> hyper, int64_t flags,
                                c10::ArrayRef<int64_t> fields, at::ScalarType state_dtype,
                                const c10::optional<at::Tensor>& cache,
                                const c10::optional<at::Tensor>& at,
                                const c10::optional<at::Tensor>& rounding) {
  TORCH_CHECK(rule >= 0 && rule <= 5, "rule must be 0 (SGD), 1 (Adagrad), 2 (RowWiseAdagrad), "
              "3 (Adam), 4 (AdamW) or 5 (PartialRowWiseAdam), got ", rule);
  TORCH_CHECK(buf.dim() == 2 && buf.scalar_type() == at::kByte && buf.is_contiguous(),
              "buf must be a contiguous uint8 (rows, record) tensor, got ", buf.scalar_type(),
              " of shape ", buf.sizes());
  TORCH_CHECK(grad.dim() == 2 && grad.is_contiguous(), "grad must be a contiguous (rows, dim) "
              "tensor, got shape ", grad.sizes());
  const auto dtype = check_step_float(grad, "grad");
  const auto state = state_dtype;
  const bool wide = dtype == at::kDouble;
  TORCH_CHECK(wide ? state == at::kDouble
                   : state == at::kFloat || state == at::kBFloat16 || state == dtype,
              "state_dtype must be ", wide ? "float64 with float64 weights (grad's dtype)"
                                           : "float32, bfloat16 or the weights' (grad's) dtype",
              ", got ", state, " for ", dtype, " weights");
  check_same_device(grad, "grad", buf, "buf");
  TORCH_CHECK(grad.size(0) == buf.size(0), "grad must have buf's ", buf.size(0), " rows, got ",
              grad.size(0));
  check_one_int64(count, "count", buf, "buf");
  TORCH_CHECK(hyper.size() == 5, "hyper must hold 5 values (lr, weight_decay, a, b, eps), got ",
              hyper.size());
  TORCH_CHECK(flags >= 0 && flags < 16, "flags must be a combination of 1 (maximize), 2 "
              "(nesterov), 4 (amsgrad) and 8 (first step), got ", flags);
  // Each rule keeps its own per-element state: SGD a momentum buffer or none, Adagrad its sum,
  // RowWiseAdagrad none (its accumulator is the row value), Adam two moments (three with
  // amsgrad), PartialRowWiseAdam its first moment (the second is the row value).
  TORCH_CHECK(fields.size() >= 2 && fields.size() <= 5, "fields must hold the byte offsets of "
              "the weight, the row value (-1: none) and up to 3 states, got ", fields.size(),
              " values");
  const int64_t states = static_cast<int64_t>(fields.size()) - 2;
  const bool amsgrad = (flags & 4) != 0, adam = rule == 3 || rule == 4;
  const bool rowwise = rule == 2 || rule == 5;
  const int64_t needed = rule == 0 ? states : rule == 1 || rule == 5 ? 1
                                   : rule == 2 ? 0 : (amsgrad ? 3 : 2);
  TORCH_CHECK(states == needed && (rule != 0 || states <= 1), "fields must name the rule's ",
              rule == 0 ? "momentum buffer (or nothing)" : rule == 1 ? "sum"
              : rule == 2 ? "no per-element state (the accumulator is the row value)"
              : rule == 5 ? "exp_avg (exp_avg_sq is the row value)"
              : amsgrad ? "exp_avg, exp_avg_sq and max_exp_avg_sq" : "exp_avg and exp_avg_sq",
              " after the weight and the row value, got ", states, " states");
  TORCH_CHECK(rowwise == (fields[1] >= 0), "fields[1] (the row value's offset) must be ",
              rowwise ? "an offset: the rule keeps one value a row" : "-1: the rule keeps none");
  TORCH_CHECK(!amsgrad || adam, "flags: amsgrad (4) is Adam's and AdamW's only");
  TORCH_CHECK((flags & (2 | 8)) == 0 || (rule == 0 && states == 1), "flags: nesterov (2) "
              "and first step (8) need SGD with a momentum buffer");
  // Every field inside the record, aligned to its element size in every row (the record a
  // multiple of it), and no two overlapping.
  const int64_t record = buf.size(1), dim = grad.size(1);
  const int64_t w_item = grad.element_size(), s_item = c10::elementSize(state);
  const int64_t r_item = wide ? 8 : 4;
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (size_t k = 0; k < fields.size(); ++k) {
    if (k == 1 && !rowwise) continue;
    const int64_t item = k == 0 ? w_item : k == 1 ? r_item : s_item;
    const int64_t bytes = k == 1 ? item : dim * item;
    TORCH_CHECK(fields[k] >= 0 && fields[k] % item == 0 && record % item == 0 &&
                    fields[k] + bytes <= record,
                "fields[", k, "] = ", fields[k], " must be a multiple of ", item, " with its ",
                bytes, " bytes inside buf's record of ", record, " bytes (a multiple of ", item,
                ")");
    for (const auto& [lo, hi] : spans) {
      TORCH_CHECK(fields[k] + bytes <= lo || fields[k] >= hi, "fields[", k, "] overlaps another "
                  "field: [", fields[k], ", ", fields[k] + bytes, ") and [", lo, ", ", hi, ")");
    }
    spans.emplace_back(fields[k], fields[k] + bytes);
  }
  const int64_t widest = std::max({w_item, s_item, rowwise ? r_item : 1});
  TORCH_CHECK(reinterpret_cast<uintptr_t>(buf.const_data_ptr()) % widest == 0, "buf's data must "
              "be ", widest, "-byte aligned (its fields' widest element)");
  const bool counts_steps = rule == 1 || rule == 3 || rule == 4 || rule == 5;
  TORCH_CHECK(!counts_steps || step.has_value(), "step is required by rule ", rule,
              " (the step count after this step's increment)");
  if (step.has_value()) {
    const auto& s = *step;
    TORCH_CHECK(s.numel() == 1 && (s.scalar_type() == at::kFloat ||
                                   s.scalar_type() == at::kDouble),
                "step must be one float32 or float64, got ", s.scalar_type(), " of shape ",
                s.sizes());
    TORCH_CHECK(s.device().is_cpu() || s.device() == buf.device(), "step must be on the CPU or "
                "buf's device ", buf.device(), ", got ", s.device());
  }
  check_no_overlap(buf, "buf", grad, "grad");
  TORCH_CHECK(cache.has_value() == at.has_value(), "cache and at go together (a slot per staged "
              "row of the cache), got ", cache.has_value() ? "cache only" : "at only");
  if (cache.has_value()) {
    const auto& c = *cache;
    TORCH_CHECK(c.dim() == 2 && c.scalar_type() == at::kByte && c.is_contiguous() &&
                    c.size(1) == record,
                "cache must be a contiguous uint8 (slots, record) tensor with buf's record of ",
                record, " bytes, got ", c.scalar_type(), " of shape ", c.sizes());
    TORCH_CHECK(reinterpret_cast<uintptr_t>(c.const_data_ptr()) % widest == 0, "cache's data "
                "must be ", widest, "-byte aligned (its fields' widest element)");
    check_same_device(c, "cache", buf, "buf");
    check_vector(*at, "at", at::kLong);
    check_same_device(*at, "at", buf, "buf");
    check_no_overlap(c, "cache", buf, "buf");
    check_no_overlap(c, "cache", grad, "grad");
  }
  if (rounding.has_value()) check_rounding(*rounding, buf, "buf");
  return rule;
}

void check_round_into_args(const at::Tensor& dst, const at::Tensor& src,
                           const at::Tensor& rounding) {
  check_step_float(dst, "dst");
  TORCH_CHECK(dst.is_contiguous(), "dst must be contiguous");
  TORCH_CHECK(src.scalar_type() == at::kFloat && src.is_contiguous(),
              "src must be a contiguous float32 tensor, got ", src.scalar_type());
  TORCH_CHECK(src.sizes() == dst.sizes(), "src must have dst's shape ", dst.sizes(), ", got ",
              src.sizes());
  check_same_device(src, "src", dst, "dst");
  check_no_overlap(dst, "dst", src, "src");
  check_rounding(rounding, dst, "dst");
}

}  // namespace speedtorch_ops
