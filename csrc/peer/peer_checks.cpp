#include "peer/peer_checks.h"

#include "common/checks.h"

namespace speedtorch_ops {

void check_peer_rows_args(const at::Tensor& ptrs, int64_t offset, const at::Tensor& rank_of,
                          const at::Tensor& row_of, int64_t dim) {
  check_vectors({{rank_of, "rank_of", at::kLong}, {row_of, "row_of", at::kLong},
                 {ptrs, "ptrs", at::kLong}});
  TORCH_CHECK(rank_of.numel() == row_of.numel(), "rank_of and row_of must have one entry a row "
              "each, got ", rank_of.numel(), " and ", row_of.numel());
  TORCH_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
  TORCH_CHECK(dim >= 0, "dim must be >= 0, got ", dim);
}

}  // namespace speedtorch_ops
