// Probe: can the copy engines scatter rows into pinned host memory (cudaMemcpyBatchAsync, one
// 512 B copy per row), and does that run beside a zero-copy gather kernel (the other PCIe
// direction)? Standalone (no torch): nvcc -O2 -arch=sm_90 ce_batch.cu -o ce_batch && ./ce_batch
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); std::exit(1); } } while (0)

__global__ void gather(const int4* table, const long long* rows, int4* out, long long n, int w) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n * w;
       i += (long long)gridDim.x * blockDim.x) {
    out[i] = table[rows[i / w] * w + i % w];
  }
}

int main(int argc, char** argv) {
  const long long table_rows = argc > 1 ? atoll(argv[1]) : 4000000;
  const long long n = argc > 2 ? atoll(argv[2]) : 49152;
  const size_t rb = 512;
  const int w = rb / 16;
  char* host = nullptr;
  CK(cudaHostAlloc(&host, table_rows * rb, cudaHostAllocMapped));
  std::fill(host, host + table_rows * rb, 1);
  char* dev_rows = nullptr;
  int4* dev_out = nullptr;
  long long* dev_idx = nullptr;
  CK(cudaMalloc(&dev_rows, n * rb));
  CK(cudaMalloc(&dev_out, n * rb));
  CK(cudaMalloc(&dev_idx, n * sizeof(long long)));
  std::mt19937_64 rng(1);
  std::vector<long long> wb(n), ld(n);
  for (auto& r : wb) r = rng() % table_rows;
  for (auto& r : ld) r = rng() % table_rows;
  std::sort(wb.begin(), wb.end());
  std::sort(ld.begin(), ld.end());
  CK(cudaMemcpy(dev_idx, ld.data(), n * sizeof(long long), cudaMemcpyHostToDevice));
  std::vector<void*> dsts(n), srcs(n);
  std::vector<size_t> sizes(n, rb);
  for (long long i = 0; i < n; ++i) {
    dsts[i] = host + wb[i] * rb;
    srcs[i] = dev_rows + i * rb;
  }
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attr_idx = 0;
  cudaStream_t s1, s2;
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  const char* host_table = nullptr;
  CK(cudaHostGetDevicePointer((void**)&host_table, host, 0));
  auto batch = [&](cudaStream_t s) {
    CK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attr, &attr_idx, 1, s));
  };
  auto load = [&](cudaStream_t s) {
    gather<<<132 * 2, 1024, 0, s>>>((const int4*)host_table, dev_idx, dev_out, n, w);
    CK(cudaGetLastError());
  };
  auto time_it = [&](const char* name, auto fn) {
    std::vector<float> ms;
    std::vector<double> api;
    for (int rep = 0; rep < 23; ++rep) {
      CK(cudaDeviceSynchronize());
      CK(cudaEventRecord(a, s1));
      const auto t = std::chrono::steady_clock::now();
      fn();
      api.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count());
      CK(cudaEventRecord(b, s1));
      CK(cudaEventSynchronize(b));
      float m = 0;
      CK(cudaEventElapsedTime(&m, a, b));
      if (rep >= 3) ms.push_back(m);
    }
    std::sort(ms.begin(), ms.end());
    std::sort(api.begin(), api.end());
    std::printf("  %-44s %7.3f ms (%5.1f GB/s), host API %.3f ms\n", name, ms[ms.size() / 2],
                n * rb / ms[ms.size() / 2] / 1e6, api[api.size() / 2]);
  };
  std::printf("table %lld rows x %zu B (%.1f GiB pinned), %lld random sorted rows\n", table_rows,
              rb, table_rows * rb / double(1 << 30), n);
  time_it("zero-copy gather kernel (H2D)", [&] { load(s1); });
  time_it("copy-engine batch scatter, 1 copy/row (D2H)", [&] { batch(s1); });
  time_it("both at once (two streams)", [&] {
    CK(cudaEventRecord(a, s2));
    batch(s2);
    load(s1);
    cudaEvent_t done;
    CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    CK(cudaEventRecord(done, s2));
    CK(cudaStreamWaitEvent(s1, done));
    CK(cudaEventDestroy(done));
  });
  // Check the scatter wrote the rows.
  CK(cudaMemset(dev_rows, 7, n * rb));
  batch(s1);
  CK(cudaStreamSynchronize(s1));
  long long bad = 0;
  for (long long i = 0; i < n; ++i) bad += host[wb[i] * rb + 5] != 7;
  std::printf("  check: %lld rows not written\n", bad);
  return 0;
}
