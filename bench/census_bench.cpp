// Census throughput side by side with x.sum() and isfinite(x).all(), float32,
// 2^10 ... 2^26 elements, 2 threads. Prints the headline ratios at 2^24:
//   census_vs_sum, census_vs_isfinite, has_nonfinite_vs_sum
// (throughput ratios: > 1 means faster than the baseline).
#include "bench_util.h"

#include <nanguard/census.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

namespace {

at::Tensor data(int64_t n) {
  static std::map<int64_t, at::Tensor> cache;
  auto& t = cache[n];
  if (!t.defined()) t = at::randn({n});
  return t;
}

void set_bytes(benchmark::State& state, int64_t n) {
  state.SetBytesProcessed(state.iterations() * n * int64_t(sizeof(float)));
}

void bm_sum(benchmark::State& state) {
  const at::Tensor x = data(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(x.sum().item<float>());
  set_bytes(state, x.numel());
}

void bm_isfinite_all(benchmark::State& state) {
  const at::Tensor x = data(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(at::isfinite(x).all().item<bool>());
  set_bytes(state, x.numel());
}

void bm_census(benchmark::State& state) {
  const at::Tensor x = data(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(nanguard::census(x));
  set_bytes(state, x.numel());
}

void bm_has_nonfinite(benchmark::State& state) {
  const at::Tensor x = data(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(nanguard::has_nonfinite(x));
  set_bytes(state, x.numel());
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int p = 10; p <= 26; p += 2) b->Arg(int64_t(1) << p);
  b->UseRealTime();
}

BENCHMARK(bm_sum)->Apply(sizes);
BENCHMARK(bm_isfinite_all)->Apply(sizes);
BENCHMARK(bm_census)->Apply(sizes);
BENCHMARK(bm_has_nonfinite)->Apply(sizes);

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(2);
  benchmark::Initialize(&argc, argv);
  nanguard::bench::recording_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  const auto t = [&](const char* bm, int p) {
    return reporter.time(fmt::format("{}/{}/real_time", bm, int64_t(1) << p));
  };
  for (int p = 20; p <= 26; p += 2)
    fmt::print("2^{}: census_vs_sum {:.2f}  census_vs_isfinite {:.1f}  has_nonfinite_vs_sum {:.2f}\n",
               p, t("bm_sum", p) / t("bm_census", p), t("bm_isfinite_all", p) / t("bm_census", p),
               t("bm_sum", p) / t("bm_has_nonfinite", p));
  fmt::print("census_vs_sum: {:.3f}\n", t("bm_sum", 24) / t("bm_census", 24));
  fmt::print("census_vs_isfinite: {:.2f}\n", t("bm_isfinite_all", 24) / t("bm_census", 24));
  fmt::print("has_nonfinite_vs_sum: {:.3f}\n", t("bm_sum", 24) / t("bm_has_nonfinite", 24));
  benchmark::Shutdown();
}
