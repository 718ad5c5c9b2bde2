#include "common/parallel.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>

namespace speedtorch_ops {

namespace {
// See serial_bytes() in parallel.h and docs/decisions.md, "Serial CPU passes".
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

}  // namespace speedtorch_ops
