#include "cache/cache_checks.h"

#include "common/checks.h"

#include <algorithm>

namespace speedtorch_ops {

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

}  // namespace speedtorch_ops
