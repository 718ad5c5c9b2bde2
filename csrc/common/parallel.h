// How the CPU kernels split a pass over their items (rows to copy, index entries to check):
// a pass whose items' bytes come to less than serial_bytes() runs on the calling thread alone,
// a larger one is one parallel region. A region wakes every thread and joins them; for small
// passes that costs more than the threads save, and while another process keeps one core busy
// the join waits for that core's thread to be scheduled again, far longer than the pass.
// The threshold's choice: docs/decisions.md, "Serial CPU passes".
#pragma once

#include <cstdint>

namespace speedtorch_ops {

int64_t serial_bytes();
// Test hook (_set_cpu_serial_bytes): the threshold from now on (0: the default); returns the
// previous one. 1 makes every pass of more than one item parallel; a huge value, none.
int64_t set_serial_bytes(int64_t bytes);
// Whether `n` items of `item_bytes` each come to less than serial_bytes().
bool is_serial(int64_t n, int64_t item_bytes);
// at::parallel_for's grain for a pass over `n` items of `item_bytes` each: `n` itself (so the
// pass runs on the calling thread) when is_serial, else `parallel_grain`.
int64_t grain_for(int64_t n, int64_t item_bytes, int64_t parallel_grain);

}  // namespace speedtorch_ops
