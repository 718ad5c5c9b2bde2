#include "hash/hash_checks.h"

#include "common/checks.h"

namespace speedtorch_ops {

void check_hash_args(const at::Tensor& keys, const at::Tensor& rows, const at::Tensor& ids,
                     const at::Tensor& new_rows) {
  check_vectors({{keys, "keys", at::kLong}, {rows, "rows", at::kLong}, {ids, "ids", at::kLong}});
  const int64_t slots = keys.numel();
  TORCH_CHECK(slots >= 1 && (slots & (slots - 1)) == 0,
              "keys must have a power-of-two number of slots, got ", slots);
  TORCH_CHECK(rows.numel() == slots, "rows must have keys' ", slots, " slots, got ", rows.numel());
  if (new_rows.defined()) {
    check_vectors({{ids, "ids", at::kLong}, {new_rows, "new_rows", at::kLong}});
    TORCH_CHECK(new_rows.numel() == ids.numel(), "new_rows must have one row an id (",
                ids.numel(), "), got ", new_rows.numel());
  }
}

}  // namespace speedtorch_ops
