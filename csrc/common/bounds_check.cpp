#include "common/bounds_check.h"

#include <c10/util/Exception.h>

namespace speedtorch_ops {

BoundsCheck parse_bounds_check(c10::string_view mode) {
  if (mode == "deferred") return BoundsCheck::kDeferred;
  if (mode == "raise") return BoundsCheck::kRaise;
  if (mode == "prechecked") return BoundsCheck::kPrechecked;
  TORCH_CHECK(false, "bounds_check must be 'deferred' (no wait: a bad CUDA index raises at the "
              "next call on its GPU), 'raise' (a bad index raises in the failing call, which "
              "waits for the GPU) or 'prechecked' (the caller validated the indices: no wait, no "
              "error), got '", mode, "'; a bad index writes nothing in every mode");
}

}  // namespace speedtorch_ops
