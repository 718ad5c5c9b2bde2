// _peer_rows on the CPU (registration.cpp has the contract): the addresses are this process's
// host memory (the op's CPU form, for tests of the same contract the GPU kernel keeps). The
// ranks are checked here; the addresses and rows are trusted, as on the GPU.
#include "copy/row_copy.h"
#include "peer/peer_checks.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

namespace speedtorch_ops {
namespace {

at::Tensor peer_rows_cpu(const at::Tensor& ptrs, int64_t offset, const at::Tensor& rank_of,
                         const at::Tensor& row_of, int64_t dim, at::ScalarType dtype) {
  check_peer_rows_args(ptrs, offset, rank_of, row_of, dim);
  const int64_t n = row_of.numel();
  TORCH_CHECK(n == 0 || (rank_of.min().item<int64_t>() >= 0 &&
                         rank_of.max().item<int64_t>() < ptrs.numel()),
              "rank_of must hold entries of ptrs, each in [0, ", ptrs.numel(), ")");
  auto out = at::empty({n, dim}, rank_of.options().dtype(dtype));
  const int64_t rb = dim * out.element_size();
  const int64_t* addr = ptrs.const_data_ptr<int64_t>();
  const int64_t* rank = rank_of.const_data_ptr<int64_t>();
  const int64_t* row = row_of.const_data_ptr<int64_t>();
  char* dst = static_cast<char*>(out.mutable_data_ptr());
  // Each output row is written once: rows split across threads freely.
  at::parallel_for(0, n, row_grain(rb), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (row[i] < 0) {
        std::memset(dst + i * rb, 0, rb);
        continue;
      }
      const char* src = reinterpret_cast<const char*>(addr[rank[i]]) + offset + row[i] * rb;
      std::memcpy(dst + i * rb, src, rb);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(speedtorch_ops, CPU, m) {
  m.impl("_peer_rows", &peer_rows_cpu);
}

}  // namespace speedtorch_ops
