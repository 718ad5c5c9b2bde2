// The CPU kernels called directly and through the dispatcher, against plain ATen indexing on
// fresh random data, plus the error cases (nothing written when a call fails).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <limits>
#include <mutex>
#include <random>
#include <vector>

#include "copy/rows_cpu.h"
#include "transfer/transfer_checks.h"

namespace {

at::Generator fresh_generator() {
  return at::make_generator<at::CPUGeneratorImpl>(std::random_device{}());
}

at::Tensor random_index(int64_t n, int64_t rows, at::ScalarType dtype, at::Generator& g) {
  return at::randint(0, rows, {n}, g, at::kLong).to(dtype);
}

// Last occurrence wins, computed with a plain sequential loop.
at::Tensor last_wins(const at::Tensor& table, const at::Tensor& index, const at::Tensor& src) {
  auto ref = table.clone();
  const auto idx = index.to(at::kLong);
  for (int64_t i = 0; i < idx.numel(); ++i) ref[idx[i].item<int64_t>()].copy_(src[i]);
  return ref;
}

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

}  // namespace

TEST_CASE("gather_rows_cpu matches index_select for every dtype and index type") {
  auto g = fresh_generator();
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble, at::kChar, at::kInt,
                     at::kLong, at::kBool}) {
    for (auto index_dtype : {at::kLong, at::kInt}) {
      const auto table = at::randn({97, 3, 5}, g).mul(10).to(dtype);
      const auto index = random_index(300, 97, index_dtype, g);
      auto out = at::empty({300, 3, 5}, table.options());
      speedtorch_ops::gather_rows_cpu(table, index, out);
      REQUIRE(at::equal(out, table.index_select(0, index)));
    }
  }
}

TEST_CASE("pinned_gather through the dispatcher, including empty and one-row tables") {
  auto g = fresh_generator();
  auto gather = op("speedtorch_ops::pinned_gather")
                    .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>();
  const auto table = at::randn({41, 7}, g);
  const auto index = random_index(64, 41, at::kLong, g);
  REQUIRE(at::equal(gather.call(table, index, "raise"), table.index_select(0, index)));
  REQUIRE(gather.call(table, at::empty({0}, at::kLong), "raise").sizes() ==
          at::IntArrayRef({0, 7}));
  const auto one = at::randn({1, 3}, g);
  REQUIRE(at::equal(gather.call(one, at::zeros({5}, at::kLong), "prechecked"),
                    one.expand({5, 3})));
}

TEST_CASE("pinned_scatter: last duplicate wins; accumulate adds all in index order") {
  auto g = fresh_generator();
  auto scatter = op("speedtorch_ops::pinned_scatter")
                     .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, bool,
                                 c10::string_view)>();
  // Big enough that the kernel splits the table between threads.
  const auto data = at::randn({3000, 33}, g);
  const auto index = random_index(9000, 3000, at::kInt, g);
  const auto src = at::randn({9000, 33}, g);
  auto table = data.clone();
  scatter.call(table, index, src, false, "raise");
  REQUIRE(at::equal(table, last_wins(data, index, src)));

  auto summed = data.clone();
  scatter.call(summed, index, src, true, "raise");
  const auto ref = data.to(at::kDouble).index_add(0, index.to(at::kLong), src.to(at::kDouble));
  REQUIRE(at::allclose(summed.to(at::kDouble), ref, 1e-5, 1e-4));
}

TEST_CASE("scatter_rows_cpu with rows arriving in chunks reads each chunk only once ready") {
  auto g = fresh_generator();
  const int64_t n = 20000, chunk = 1500;  // ~2.6 MB: split between threads
  const auto data = at::randn({4000, 33}, g);
  const auto index = random_index(n, 4000, at::kLong, g);
  const auto src = at::randn({n, 33}, g);
  for (bool accumulate : {false, true}) {
    // The staged rows are NaN until ready() "lands" their chunk (and every one before it, as a
    // stream would): a row read too early would leave a NaN in the table.
    auto staged = at::full({n, 33}, std::numeric_limits<float>::quiet_NaN());
    std::mutex mutex;
    int64_t landed = 0;
    std::vector<int64_t> asked;
    const speedtorch_ops::ChunkReady ready = [&](int64_t c) {
      std::lock_guard<std::mutex> lock(mutex);
      asked.push_back(c);
      for (; landed <= c; ++landed) {
        const int64_t len = std::min(chunk, n - landed * chunk);
        staged.narrow(0, landed * chunk, len).copy_(src.narrow(0, landed * chunk, len));
      }
    };
    auto table = data.clone();
    speedtorch_ops::scatter_rows_cpu({table}, index, {staged}, accumulate, chunk, &ready);
    if (accumulate) {
      const auto ref = data.to(at::kDouble).index_add(0, index, src.to(at::kDouble));
      REQUIRE(at::allclose(table.to(at::kDouble), ref, 1e-5, 1e-4));
    } else {
      REQUIRE(at::equal(table, last_wins(data, index, src)));
    }
    REQUIRE(landed == (n + chunk - 1) / chunk);
    REQUIRE(*std::max_element(asked.begin(), asked.end()) == landed - 1);
  }
}

TEST_CASE("optimizer_state_swap writes back before it loads, for every pair") {
  auto g = fresh_generator();
  std::vector<at::Tensor> data, stores, batch, written;
  for (int k = 0; k < 3; ++k) {
    data.push_back(at::randn({50, 4}, g));
    stores.push_back(data.back().clone());
    batch.push_back(at::randn({16, 4}, g));
    written.push_back(batch.back().clone());
  }
  const auto wb = random_index(16, 50, at::kLong, g);
  const auto load = at::cat({wb.slice(0, 0, 4), random_index(12, 50, at::kLong, g)});
  speedtorch_ops::optimizer_state_swap_cpu(stores, batch, wb, load, "raise");
  for (int k = 0; k < 3; ++k) {
    const auto ref = last_wins(data[k], wb, written[k]);
    REQUIRE(at::equal(stores[k], ref));
    REQUIRE(at::equal(batch[k], ref.index_select(0, load)));
  }
}

TEST_CASE("bad input raises, names the argument, and writes nothing") {
  auto g = fresh_generator();
  const auto data = at::randn({20, 4}, g);
  auto table = data.clone();
  const auto src = at::randn({3, 4}, g);
  const auto bad = at::tensor(std::vector<int64_t>{1, 20, 2});
  const auto negative = at::tensor(std::vector<int64_t>{1, 2, -1});

  REQUIRE_THROWS_WITH(speedtorch_ops::pinned_scatter_cpu(table, bad, src, false, "raise"),
                      Catch::Contains("index[1] = 20 is out of range for a table of 20 rows"));
  REQUIRE_THROWS_WITH(speedtorch_ops::pinned_scatter_cpu(table, negative, src, true, "raise"),
                      Catch::Contains("index[2] = -1 is out of range"));
  REQUIRE_THROWS_WITH(speedtorch_ops::pinned_gather_cpu(table, bad.to(at::kFloat), "raise"),
                      Catch::Contains("index must be int64 or int32"));
  REQUIRE_THROWS_WITH(speedtorch_ops::pinned_gather_cpu(table, bad.view({3, 1}), "raise"),
                      Catch::Contains("index must be a 1-D tensor"));
  auto wrong_shape = at::randn({3, 5}, g);
  REQUIRE_THROWS_WITH(speedtorch_ops::pinned_scatter_cpu(table, bad.clamp(0, 19), wrong_shape, false, "raise"),
                      Catch::Contains("src must have shape [3, 4]"));
  auto view = table.slice(0, 5, 8);
  REQUIRE_THROWS_WITH(speedtorch_ops::pinned_scatter_cpu(table, bad.clamp(0, 19), view, false, "raise"),
                      Catch::Contains("table and src share memory"));
  auto wide = at::randn({20, 8}, g);
  auto strided = wide.slice(1, 0, 8, 2);
  REQUIRE_THROWS_WITH(speedtorch_ops::pinned_gather_cpu(strided, bad.clamp(0, 19), "raise"),
                      Catch::Contains("table must be contiguous"));
  std::vector<at::Tensor> stores{table}, batch{at::randn({3, 4}, g)};
  const auto batch_before = batch[0].clone();
  REQUIRE_THROWS_WITH(speedtorch_ops::optimizer_state_swap_cpu(stores, batch, bad.clamp(0, 19), bad, "raise"),
                      Catch::Contains("load_index[1] = 20 is out of range"));
  REQUIRE(at::equal(table, data));
  REQUIRE(at::equal(batch[0], batch_before));
  // The next valid call works.
  REQUIRE(at::equal(speedtorch_ops::pinned_gather_cpu(table, bad.clamp(0, 19), "raise"),
                    data.index_select(0, bad.clamp(0, 19))));
}

TEST_CASE("bounds_check: CPU kernels check on the host in every mode; unknown modes raise") {
  auto g = fresh_generator();
  const auto data = at::randn({20, 4}, g);
  auto table = data.clone();
  const auto bad = at::tensor(std::vector<int64_t>{1, 20, 2});
  const auto src = at::randn({3, 4}, g);
  REQUIRE_THROWS_WITH(speedtorch_ops::pinned_scatter_cpu(table, bad, src, false, "prechecked"),
                      Catch::Contains("index[1] = 20 is out of range"));
  REQUIRE_THROWS_WITH(speedtorch_ops::pinned_scatter_cpu(table, bad.clamp(0, 19), src, false,
                                                         "lazy"),
                      Catch::Contains("bounds_check must be 'deferred'") &&
                          Catch::Contains("'raise'") &&
                          Catch::Contains("'prechecked'") && Catch::Contains("got 'lazy'"));
  REQUIRE(at::equal(table, data));
  auto swap = op("speedtorch_ops::optimizer_state_swap")
                  .typed<void(at::TensorList, at::TensorList, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&, c10::string_view)>();
  std::vector<at::Tensor> stores{table}, batch{at::zeros({3, 4})};
  REQUIRE_THROWS_WITH(swap.call(stores, batch, std::nullopt, bad.clamp(0, 19), ""),
                      Catch::Contains("bounds_check must be"));
  REQUIRE(at::equal(batch[0], at::zeros({3, 4})));
}
