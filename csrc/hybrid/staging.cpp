#include "hybrid/staging.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <map>
#include <memory>

namespace speedtorch_ops::torch_cuda {
namespace {

// Bytes per CPU chunk: the CPU gathers (or scatters) one chunk while the copy engine moves the
// next (or the previous). Smaller chunks cost more per chunk than they overlap; larger ones
// leave the copy engine idle longer at the start and the end (see docs/decisions.md, "The CPU
// side's chunks").
constexpr int64_t kChunkBytes = int64_t{2} << 20;

// Start offsets of each table's block in a store-major staging area of n rows per table.
std::vector<int64_t> block_offsets(const std::vector<Pair>& pairs, int64_t n) {
  std::vector<int64_t> at;
  int64_t off = 0;
  for (const auto& p : pairs) {
    at.push_back(off);
    off += n * p.row_bytes;
  }
  at.push_back(off);
  return at;
}

}  // namespace

DeviceState& state_of(c10::DeviceIndex device) {
  static std::mutex mutex;
  // Never destroyed: at process exit, freeing pinned memory or events after torch's CUDA state
  // is gone aborts the process ("Unrecognized stream" from ~TensorImpl).
  static auto* states = new std::map<c10::DeviceIndex, std::unique_ptr<DeviceState>>();
  std::lock_guard<std::mutex> lock(mutex);
  auto& state = (*states)[device];
  if (!state) state = std::make_unique<DeviceState>();
  return *state;
}

at::Tensor pinned_area(at::Tensor& slot, int64_t bytes) {
  if (!slot.defined() || slot.nbytes() < static_cast<size_t>(bytes)) {
    slot = at::empty({bytes + bytes / 2}, at::TensorOptions(at::kByte).pinned_memory(true));
  }
  return slot.narrow(0, 0, bytes);
}

at::cuda::CUDAStream dma_stream(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(device);
  if (it == streams.end()) {
    c10::cuda::CUDAGuard guard(device);
    cudaStream_t stream = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    it = streams.emplace(device, stream).first;  // lives as long as the process
  }
  return at::cuda::getStreamFromExternal(it->second, device);
}

int64_t chunk_rows(const std::vector<Pair>& pairs) {
  int64_t total_rb = 0;
  for (const auto& p : pairs) total_rb += p.row_bytes;
  return std::max<int64_t>(1024, kChunkBytes / std::max<int64_t>(total_rb, 1));
}

// The scratch comes from the dma stream's pool of torch's caching allocator: memory just freed
// on the caller's stream (e.g. a sort buffer of a zero-copy kernel still running there) can
// then not be handed to the copies on dma.
Staging::Staging(const std::vector<Pair>& pairs, int64_t n, const c10::Device& device,
                 const at::cuda::CUDAStream& dma, at::Tensor& arena, bool scratch)
    : offset_(block_offsets(pairs, n)) {
  if (scratch) {
    c10::cuda::CUDAStreamGuard on_dma(dma);
    scratch_ = at::empty({offset_.back()}, at::TensorOptions(at::kByte).device(device));
  }
  host_ = pinned_area(arena, offset_.back());
}

char* Staging::device_block(size_t k) {
  return static_cast<char*>(scratch_.mutable_data_ptr()) + offset_[k];
}

char* Staging::host_block(size_t k) {
  return static_cast<char*>(host_.mutable_data_ptr()) + offset_[k];
}

at::Tensor Staging::rows(const std::vector<Pair>& pairs, size_t k, int64_t b, int64_t len,
                         const at::Tensor& like) {
  auto sizes = like.sizes().vec();
  sizes[0] = len;
  return at::from_blob(host_block(k) + b * pairs[k].row_bytes, sizes,
                       at::TensorOptions(like.scalar_type()));
}

void Staging::copy_chunk(const std::vector<Pair>& pairs, int64_t b, int64_t len,
                         cudaMemcpyKind kind, const at::cuda::CUDAStream& stream) {
  for (const auto k : c10::irange(pairs.size())) {
    char* dev = device_block(k) + b * pairs[k].row_bytes;
    char* host = host_block(k) + b * pairs[k].row_bytes;
    const bool up = kind == cudaMemcpyHostToDevice;
    C10_CUDA_CHECK(cudaMemcpyAsync(up ? dev : host, up ? host : dev, len * pairs[k].row_bytes,
                                   kind, stream));
  }
}

void Staging::copy_batch(const std::vector<Pair>& pairs, int64_t b, int64_t len, int64_t at,
                         bool to_batch, const at::cuda::CUDAStream& stream) {
  for (const auto k : c10::irange(pairs.size())) {
    const int64_t rb = pairs[k].row_bytes;
    char* batch = pairs[k].batch + at * rb;
    char* host = host_block(k) + b * rb;
    C10_CUDA_CHECK(cudaMemcpyAsync(to_batch ? batch : host, to_batch ? host : batch, len * rb,
                                   to_batch ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                                   stream));
  }
}

void move_blocks(const std::vector<Pair>& pairs, Staging& staging, bool to_batch,
                 const int64_t* pos, int64_t n, const Validation& v,
                 const at::cuda::CUDAStream& stream) {
  for (size_t first = 0; first < pairs.size(); first += kernels::kMaxTables) {
    kernels::Tables t{};
    t.count = static_cast<int>(std::min<size_t>(kernels::kMaxTables, pairs.size() - first));
    for (int k = 0; k < t.count; ++k) {
      char* block = staging.device_block(first + k);
      char* batch = pairs[first + k].batch;
      t.set(k, to_batch ? batch : block, to_batch ? block : batch, pairs[first + k].row_bytes);
    }
    C10_CUDA_CHECK(kernels::launch_copy_rows(t, to_batch ? pos : nullptr, to_batch ? nullptr : pos, n,
                                          false, kernels::LastOf{}, v.status(), v.grid(), stream));
  }
}

}  // namespace speedtorch_ops::torch_cuda
