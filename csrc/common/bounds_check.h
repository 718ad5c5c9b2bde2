// The transfer ops' bounds_check argument, shared by their entry points and by the device-side
// validation that carries it out (copy/validation.h).
#pragma once

#include <c10/util/string_view.h>

namespace speedtorch_ops {

// The ops' bounds_check argument. Every mode writes nothing for a bad index; they differ in
// whether and when a call raises for one.
//   kDeferred (the default): CUDA indices are checked on the device and the call does not wait;
//     a bad one is recorded in pinned host memory and raised by the next kDeferred or kRaise call
//     on that GPU (or by sync_bounds_check), so the host runs ahead of the GPU and the error
//     still reaches the user.
//   kRaise: a bad index raises in the failing call. CUDA indices are checked on the device and
//     the call waits for the current stream to read the result (not while a CUDA graph is being
//     captured: the call then reports like kDeferred).
//   kPrechecked: the caller validated the indices on the host. CUDA indices are still checked
//     on the device, so a bad one writes nothing, but nothing waits, records or raises (not even
//     another call's recorded index), and the call never takes a path that waits.
// Indices a call reads on the host (the CPU kernels, the hybrid path, a pageable table) are
// checked there in every mode and a bad one raises: that check costs no wait.
enum class BoundsCheck { kDeferred, kRaise, kPrechecked };

// The mode named by `mode`; anything else raises, naming bounds_check and the valid values.
BoundsCheck parse_bounds_check(c10::string_view mode);

}  // namespace speedtorch_ops
