// Stochastic rounding of a step's 16-bit stores (the fused update's, and _round_into's for
// torch's own step), shared by the CPU and CUDA kernels (torch-free and CUDA-free: plain C++
// that compiles for the host and, under nvcc, for the device, so both give the same bits for
// the same key).
//
// A float x between two neighbours lo < x < hi of a 16-bit format is stored as hi with
// probability (x - lo) / (hi - lo), else lo: the expected stored value is x, so many updates
// smaller than half a step of the format still move a weight on average (round-to-nearest
// drops every one of them). The draw comes from a counter-based hash of (seed, counter, row,
// element): no generator state, the same on every device, and a seed reproduces a run.
#pragma once

#include <cstdint>
#include <cstring>

#include "optim/rules.h"  // SPEEDTORCH_HD

namespace speedtorch_ops::optim {

// A 16-bit format with float32's exponent range or a narrower one: the mantissa bits it keeps,
// its smallest normal exponent, and the bits of its largest finite value as a float
// (round_stochastic).
struct Narrow {
  int kept;
  int min_exp;
  uint32_t max_bits;
};
constexpr Narrow kHalf{10, -14, 0x477fe000u};  // 65504

SPEEDTORCH_HD uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
#endif
}

SPEEDTORCH_HD float bits_float(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
#endif
}

// A 64-bit finalizer (splitmix64's): every input bit reaches every output bit.
SPEEDTORCH_HD uint64_t mix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xbf58476d1ce4e5b9ull;
  z ^= z >> 27;
  z *= 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A row's key in one step: `counter` rises every step, `row` is the row's staged position.
// One 64-bit mix a row; the per-element draws below are 32-bit arithmetic, native on a GPU.
SPEEDTORCH_HD uint64_t row_key(uint64_t seed, uint64_t counter, int64_t row) {
  return mix64(mix64(seed + counter * 0x9e3779b97f4a7c15ull) ^
               (static_cast<uint64_t>(row) * 0xd1b54a32d192ed03ull));
}

// The element numbers under a row's key: column j (below 2^28) of the weight, of state part
// k (k < 3), and the row-wise value.
SPEEDTORCH_HD uint32_t weight_element(int64_t j) { return static_cast<uint32_t>(j); }
SPEEDTORCH_HD uint32_t state_element(int k, int64_t j) {
  return (static_cast<uint32_t>(k + 1) << 28) | static_cast<uint32_t>(j);
}
constexpr uint32_t kRowElement = 4u << 28;

// A 32-bit finalizer (multiply-xorshift, "lowbias32" constants): each input bit flips about
// half the output bits.
SPEEDTORCH_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

// 32 uniform bits for one element of a row: the row's key folded to 32 bits, each element a
// distinct input under it.
SPEEDTORCH_HD uint32_t draw(uint64_t key, uint32_t element) {
  const uint32_t k = static_cast<uint32_t>(key) ^ static_cast<uint32_t>(key >> 32);
  return mix32(k ^ (element * 0x9e3779b9u));
}

// bfloat16 keeps float32's upper 16 bits: 16 bits of a draw decide it, so one draw serves
// two elements (the pair element / 2, its low half for an even element, its high half for an
// odd one).
SPEEDTORCH_HD uint32_t draw_bf16(uint64_t key, uint32_t element) {
  const uint32_t u = draw(key, element >> 1);
  return (element & 1u) ? u >> 16 : u & 0xffffu;
}

// x rounded stochastically to bfloat16 with a 16-bit draw u16, as a float bfloat16 holds
// exactly (round_stochastic with float32's range: the dropped bits are always the low 16).
SPEEDTORCH_HD float round_bf16(float x, uint32_t u16) {
  const uint32_t b = float_bits(x);
  if ((b & 0x7f800000u) == 0x7f800000u) return x;  // NaN and infinity stay
  return bits_float((b + u16) & 0xffff0000u);
}

// x rounded stochastically to `f` with the draw u: a float that `f` holds exactly (so the
// conversion to f that follows is exact), or infinity past f's range; NaN and infinity stay.
// Sign and magnitude are apart in a float's bits, so adding the draw to the bits below f's
// last kept one rounds the magnitude up with probability equal to its remainder (a carry
// moves into the exponent as it should), for either sign.
SPEEDTORCH_HD float round_stochastic(float x, uint32_t u, Narrow f) {
  uint32_t b = float_bits(x);
  const uint32_t field = (b >> 23) & 0xffu;
  if (field == 0xffu) return x;
  const int e = field == 0 ? -126 : static_cast<int>(field) - 127;  // a float's subnormals
  const int below = f.min_exp - e;  // f's subnormal range: its step stays 2^(min_exp - kept)
  const int drop = 23 - f.kept + (below > 0 ? below : 0);
  if (drop >= 24) {
    // Below f's smallest step s (fp16 only): 0 or s, s with probability |x| / s.
    const float s = bits_float(static_cast<uint32_t>(127 + f.min_exp - f.kept) << 23);
    const float a = x < 0 ? -x : x;
    const float up = static_cast<float>(u) * 2.3283064365386963e-10f < a / s ? s : 0.0f;
    return x < 0 ? -up : up;
  }
  const uint32_t mask = (1u << drop) - 1u;
  const uint32_t up = (b + (u & mask)) & ~mask;
  // Above f's largest finite value the upper neighbour is infinity: values that
  // round-to-nearest keeps finite (within half a step of it) stay at it.
  const uint32_t magnitude = up & 0x7fffffffu;
  if (magnitude > f.max_bits && (b & 0x7fffffffu) < f.max_bits + (1u << (drop - 1))) {
    return bits_float((b & 0x80000000u) | f.max_bits);
  }
  return bits_float(up);
}

// A 16-bit format's stochastic rounding of x under a row's key and an element's number (the
// fused update's stores and _round_into's share it).
enum class Format { kBFloat16, kHalf };
SPEEDTORCH_HD float round_for(Format f, float x, uint64_t key, uint32_t element) {
  return f == Format::kBFloat16 ? round_bf16(x, draw_bf16(key, element))
                                : round_stochastic(x, draw(key, element), kHalf);
}

// _round_into's rows: a flat tensor's elements in blocks of 2^16, element i the (i % 2^16)-th
// of block i / 2^16.
constexpr int kFlatRowBits = 16;
SPEEDTORCH_HD uint32_t flat_element(int64_t i) {
  return static_cast<uint32_t>(i & ((int64_t{1} << kFlatRowBits) - 1));
}

}  // namespace speedtorch_ops::optim
