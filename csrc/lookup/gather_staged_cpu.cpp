// _gather_staged on the CPU (registration.cpp has the contract): torch's own row gathers, the
// cache's rows laid over the others' (a CPU module has no cache; the op is whole on every
// device). Indices are checked here: nothing is read outside the tensors.
#include "lookup/lookup_checks.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace speedtorch_ops {
namespace {

at::Tensor gather_staged_cpu(const at::Tensor& rows, const at::Tensor& index,
                           const c10::optional<at::Tensor>& cache,
                           const c10::optional<at::Tensor>& at) {
  check_gather_staged_args(rows, index, cache, at);
  TORCH_CHECK(index.numel() == 0 ||
                  (index.min().item<int64_t>() >= 0 && index.max().item<int64_t>() < rows.size(0)),
              "index must hold rows of rows, each in [0, ", rows.size(0), ")");
  at::Tensor out = rows.index_select(0, index);
  if (!cache.has_value() || index.numel() == 0) return out.contiguous();
  const at::Tensor slot = at->narrow(0, 0, rows.size(0)).index_select(0, index);
  const at::Tensor hit = slot.ge(0).logical_and(slot.lt(cache->size(0)));
  const at::Tensor where = hit.nonzero().view(-1);
  out.index_copy_(0, where, cache->index_select(0, slot.index_select(0, where)));
  return out.contiguous();
}

}  // namespace

TORCH_LIBRARY_IMPL(speedtorch_ops, CPU, m) {
  m.impl("_gather_staged", &gather_staged_cpu);
}

}  // namespace speedtorch_ops
