// _hash_find and _hash_insert on the CPU (registration.cpp has the contract): an id map of
// open addressing with linear probing, the slots' ids in `keys` and their rows in `rows` (a
// negative row: an empty or erased slot). The home slot of an id is MurmurHash3's 64-bit
// finalizer of it, so ids that differ in a few low bits land far apart.
#include "common/parallel.h"
#include "hash/hash_checks.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

namespace speedtorch_ops {
namespace {

constexpr int64_t kEmpty = -1;
constexpr int64_t kErased = -2;

inline uint64_t home_of(int64_t id) {
  uint64_t x = static_cast<uint64_t>(id);
  x = (x ^ (x >> 33)) * 0xff51afd7ed558ccdULL;
  x = (x ^ (x >> 33)) * 0xc4ceb9fe1a85ec53ULL;
  return x ^ (x >> 33);
}

std::tuple<at::Tensor, at::Tensor> hash_find_cpu(const at::Tensor& keys, const at::Tensor& rows,
                                                 const at::Tensor& ids) {
  check_hash_args(keys, rows, ids, at::Tensor());
  TORCH_CHECK(keys.device().is_cpu(), "_hash_find: the map must be on the CPU here");
  at::Tensor found = at::empty_like(ids);
  at::Tensor slots = at::empty_like(ids);
  const int64_t* key = keys.const_data_ptr<int64_t>();
  const int64_t* row = rows.const_data_ptr<int64_t>();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  int64_t* out = found.mutable_data_ptr<int64_t>();
  int64_t* at_slot = slots.mutable_data_ptr<int64_t>();
  const int64_t size = keys.numel();
  const uint64_t mask = static_cast<uint64_t>(size - 1);
  // Reads only: the ids split over threads (a probe touches a few slots of a large map).
  at::parallel_for(0, ids.numel(), grain_for(ids.numel(), 64, 4096), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      uint64_t s = home_of(id[i]) & mask;
      int64_t r = kEmpty, where = -1;
      for (int64_t step = 0; step < size; ++step, s = (s + 1) & mask) {
        const int64_t here = row[s];
        if (here == kEmpty) break;
        if (here >= 0 && key[s] == id[i]) {
          r = here;
          where = static_cast<int64_t>(s);
          break;
        }
      }
      out[i] = r;
      at_slot[i] = where;
    }
  });
  return {found, slots};
}

at::Tensor hash_insert_cpu(at::Tensor& keys, at::Tensor& rows, const at::Tensor& ids,
                           const at::Tensor& new_rows) {
  check_hash_args(keys, rows, ids, new_rows);
  TORCH_CHECK(keys.device().is_cpu(), "_hash_insert: the map must be on the CPU here");
  int64_t* key = keys.mutable_data_ptr<int64_t>();
  int64_t* row = rows.mutable_data_ptr<int64_t>();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const int64_t* given = new_rows.const_data_ptr<int64_t>();
  const int64_t size = keys.numel();
  const uint64_t mask = static_cast<uint64_t>(size - 1);
  // Free slots first: the map must hold every id, or it would lose one silently.
  int64_t free = 0;
  for (int64_t s = 0; s < size && free < ids.numel(); ++s) free += row[s] < 0;
  TORCH_CHECK(free >= ids.numel(), "_hash_insert: ", ids.numel(), " ids for ", free,
              " free slots; nothing was inserted");
  for (int64_t i = 0; i < ids.numel(); ++i) {
    TORCH_CHECK(given[i] >= 0, "new_rows[", i, "] = ", given[i], " must be >= 0");
  }
  // In order: an id's slot depends on the ids inserted before it.
  int64_t reused = 0;
  for (int64_t i = 0; i < ids.numel(); ++i) {
    uint64_t s = home_of(id[i]) & mask;
    while (row[s] >= 0) s = (s + 1) & mask;
    reused += row[s] == kErased;
    key[s] = id[i];
    row[s] = given[i];
  }
  return at::scalar_tensor(reused, keys.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(speedtorch_ops, CPU, m) {
  m.impl("_hash_find", &hash_find_cpu);
  m.impl("_hash_insert", &hash_insert_cpu);
}

}  // namespace speedtorch_ops
