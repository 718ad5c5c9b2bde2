// Pinning in place: page-lock a CPU tensor's existing storage (cudaHostRegister, mapped), so a
// pinned table never needs a second full-size copy (torch's pinned allocator would also round
// large tables up to a power of two).
//
// A storage is registered in pieces of at most piece_bytes: drivers refuse or stall on a single
// registration of tens of GiB, and pieces let the caller show progress. The storage's deleter is
// wrapped so every piece is unregistered before the memory is freed, whichever tensor or view
// releases it last. A refused piece unregisters all pieces already registered, so a failure never
// leaves a table half-pinned.
#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <torch/library.h>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#ifdef SPEEDTORCH_OPS_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>
#endif

namespace speedtorch_ops {

namespace {
// The most bytes one cudaHostRegister call covers when the caller names no piece size.
constexpr int64_t kDefaultPieceBytes = int64_t{1} << 30;

#ifdef SPEEDTORCH_OPS_WITH_CUDA
struct Pinned {
  c10::DataPtr original;                        // frees the memory once every piece is unregistered
  std::vector<std::pair<char*, size_t>> pieces;  // registered so far, in address order
  size_t registered_bytes = 0;
};

void unregister_pieces(Pinned* pinned) {
  // Never throw here (deleters must not); a failure only means pages stay locked until exit.
  for (auto it = pinned->pieces.rbegin(); it != pinned->pieces.rend(); ++it) {
    (void)cudaHostUnregister(it->first);
  }
  (void)cudaGetLastError();
  pinned->pieces.clear();
  pinned->registered_bytes = 0;
}

void unregister_then_free(void* ctx) {
  auto* pinned = static_cast<Pinned*>(ctx);
  unregister_pieces(pinned);
  delete pinned;  // destroys `original`, which frees the memory
}

Pinned* pinned_context(c10::StorageImpl* storage) {
  return storage->data_ptr().cast_context<Pinned>(&unregister_then_free);
}

// Undo pin_storage_pieces: unregister every piece and give the storage its own deleter back.
void unpin(c10::StorageImpl* storage) {
  Pinned* pinned = pinned_context(storage);
  if (pinned == nullptr) return;
  unregister_pieces(pinned);
  c10::DataPtr ours = storage->set_data_ptr(std::move(pinned->original));
  (void)ours.release_context();  // `pinned` is deleted below, not by our deleter
  delete pinned;
}

bool registered_elsewhere(void* ptr) {
  cudaPointerAttributes attr{};
  const bool host = cudaPointerGetAttributes(&attr, ptr) == cudaSuccess &&
                    attr.type == cudaMemoryTypeHost;
  (void)cudaGetLastError();
  return host;
}
#endif

#ifndef SPEEDTORCH_OPS_WITH_CUDA
[[noreturn]] void fail_without_cuda() {
  TORCH_CHECK(false,
              "speedtorch_ops was built without CUDA, so it cannot pin memory; rebuild with a "
              "CUDA build of torch and nvcc available (and SPEEDTORCH_OPS_CPU_ONLY unset)");
}
#endif
}  // namespace

// Registers up to max_pieces more pieces of self's storage (continuing where an earlier call
// stopped) and returns how many of its bytes are pinned now; the storage's nbytes once done.
// A storage pinned by someone else (torch's pinned allocator) counts as done.
int64_t pin_storage_pieces_cpu(at::Tensor& self, int64_t piece_bytes, int64_t max_pieces) {
  TORCH_CHECK(self.device().is_cpu(), "self must be a CPU tensor, got ", self.device());
  TORCH_CHECK(piece_bytes > 0, "piece_bytes must be > 0, got ", piece_bytes);
  TORCH_CHECK(max_pieces > 0, "max_pieces must be > 0, got ", max_pieces);
#ifndef SPEEDTORCH_OPS_WITH_CUDA
  fail_without_cuda();
#else
  c10::StorageImpl* storage = self.storage().unsafeGetStorageImpl();
  const size_t nbytes = storage->nbytes();
  if (nbytes == 0) return 0;
  auto* base = static_cast<char*>(storage->mutable_data());
  Pinned* pinned = pinned_context(storage);
  if (pinned == nullptr) {
    if (registered_elsewhere(base)) return static_cast<int64_t>(nbytes);
    pinned = new Pinned{};
    pinned->original =
        storage->set_data_ptr(c10::DataPtr(base, pinned, &unregister_then_free, self.device()));
  }
  // Interior cuts fall on page boundaries, so no page belongs to two registrations.
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t piece = (static_cast<size_t>(piece_bytes) + page - 1) / page * page;
  const size_t lead = reinterpret_cast<uintptr_t>(base) % page;  // base's offset in its page
  const bool several = lead + nbytes > piece;
  for (int64_t k = 0; k < max_pieces && pinned->registered_bytes < nbytes; ++k) {
    const size_t begin = pinned->registered_bytes;
    const size_t end = std::min(nbytes, ((lead + begin) / piece + 1) * piece - lead);
    char* start = base + begin;
    cudaError_t err =
        cudaHostRegister(start, end - begin, cudaHostRegisterMapped | cudaHostRegisterPortable);
    void* device = nullptr;
    if (err == cudaSuccess && several) {
      // The kernels address a table from its first byte's device pointer, so pieces are only
      // one table on the GPU where each piece is mapped at its host address (true on 64-bit
      // Linux with unified addressing).
      err = cudaHostGetDevicePointer(&device, start, 0);
      if (err == cudaSuccess && device != start) {
        (void)cudaHostUnregister(start);
        (void)cudaGetLastError();
        unpin(storage);
        TORCH_CHECK(false, "cudaHostRegister maps host memory at other addresses on this GPU, so ",
                    "a table of ", nbytes, " bytes cannot be pinned in pieces of ", piece,
                    " bytes; pass piece_bytes >= ", nbytes, ". Nothing was left pinned.");
      }
      if (err != cudaSuccess) (void)cudaHostUnregister(start);
    }
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      unpin(storage);
      // No GPU is not a memory problem: say so rather than blame the memlock limit.
      TORCH_CHECK(err != cudaErrorNoDevice && err != cudaErrorInsufficientDriver &&
                      err != cudaErrorInitializationError,
                  "cannot pin memory without a usable CUDA device (", cudaGetErrorName(err), ": ",
                  cudaGetErrorString(err), "); pass pin=False on machines without a GPU");
      TORCH_CHECK(false, "cudaHostRegister refused ", end - begin, " bytes at offset ", begin,
                  " of a ", nbytes, "-byte table (", cudaGetErrorName(err), ": ",
                  cudaGetErrorString(err), "); the pieces registered before were unregistered, "
                  "so nothing was left pinned");
    }
    pinned->pieces.emplace_back(start, end - begin);
    pinned->registered_bytes = end;
  }
  return static_cast<int64_t>(pinned->registered_bytes);
#endif
}

// Unregisters every piece pin_storage_pieces registered in self's storage (a no-op for memory
// it did not pin); the memory itself stays where it is.
void unpin_storage_cpu(at::Tensor& self) {
  TORCH_CHECK(self.device().is_cpu(), "self must be a CPU tensor, got ", self.device());
#ifdef SPEEDTORCH_OPS_WITH_CUDA
  unpin(self.storage().unsafeGetStorageImpl());
#endif
}

void pin_storage_cpu(at::Tensor& self) {
#ifndef SPEEDTORCH_OPS_WITH_CUDA
  TORCH_CHECK(self.device().is_cpu(), "self must be a CPU tensor, got ", self.device());
  fail_without_cuda();
#else
  (void)pin_storage_pieces_cpu(self, kDefaultPieceBytes, std::numeric_limits<int64_t>::max());
#endif
}

TORCH_LIBRARY_IMPL(speedtorch_ops, CPU, m) {
  m.impl("_pin_storage_", &pin_storage_cpu);
  m.impl("_pin_storage_pieces_", &pin_storage_pieces_cpu);
  m.impl("_unpin_storage_", &unpin_storage_cpu);
}

}  // namespace speedtorch_ops
