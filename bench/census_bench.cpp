// Census throughput side by side with x.sum() and isfinite(x).all(), float32,
// 2^10 ... 2^26 elements, 2 threads: Google Benchmark's table, then the
// ratios at 2^20 ... 2^26 measured pairwise (the four operations run
// round-robin, rounds of a few milliseconds each, and each ratio is the
// median of per-round ratios), and the headline ratios at 2^24:
//   census_vs_sum, census_vs_isfinite, has_nonfinite_vs_sum
// (throughput ratios: > 1 means faster than the baseline), with
// `census_vs_sum_ci95` and `has_nonfinite_vs_sum_ci95` intervals.
#include "bench_util.h"
#include "timing.h"

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

// Throughput ratios of census and has_nonfinite to sum and isfinite().all()
// on n elements, from `rounds` interleaved rounds.
struct ratios {
  nanguard::bench::ratio_estimate census_vs_sum, census_vs_isfinite, has_nonfinite_vs_sum;
};

ratios paired_ratios(int64_t n, int rounds) {
  const at::Tensor x = data(n);
  // Calls per round: about 4 ms of x.sum() at 100 GB/s, at least one call.
  const int64_t calls = std::max<int64_t>(1, int64_t(4e-3 * 100e9) / (n * int64_t(sizeof(float))));
  const auto repeat = [calls](auto fn) {
    return [calls, fn] {
      for (int64_t i = 0; i < calls; ++i) benchmark::DoNotOptimize(fn());
    };
  };
  const auto t = nanguard::bench::interleaved_seconds(
      {repeat([&] { return x.sum().item<float>(); }), repeat([&] { return nanguard::census(x).mean; }),
       repeat([&] { return nanguard::has_nonfinite(x); }),
       [&] { benchmark::DoNotOptimize(at::isfinite(x).all().item<bool>()); }},
      rounds);
  // isfinite ran once per round: scale its time to `calls` calls.
  std::vector<double> isfinite_time;
  for (double s : t[3]) isfinite_time.push_back(s * double(calls));
  // Throughput ratio = baseline time / variant time.
  using nanguard::bench::paired_ratio;
  return {paired_ratio(t[0], t[1]), paired_ratio(isfinite_time, t[1]), paired_ratio(t[0], t[2])};
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(2);
  benchmark::Initialize(&argc, argv);
  nanguard::bench::recording_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  fmt::print("\npaired rounds (median of per-round throughput ratios, 95% interval):\n");
  ratios at24{};
  for (int p = 20; p <= 26; p += 2) {
    const ratios r = paired_ratios(int64_t(1) << p, 21);
    fmt::print("2^{}: census_vs_sum {:.2f} ({:.2f}..{:.2f})  census_vs_isfinite {:.1f}  "
               "has_nonfinite_vs_sum {:.2f} ({:.2f}..{:.2f})\n",
               p, r.census_vs_sum.median, r.census_vs_sum.low, r.census_vs_sum.high, r.census_vs_isfinite.median,
               r.has_nonfinite_vs_sum.median, r.has_nonfinite_vs_sum.low, r.has_nonfinite_vs_sum.high);
    if (p == 24) at24 = r;
  }
  fmt::print("census_vs_sum: {:.3f}\n", at24.census_vs_sum.median);
  fmt::print("census_vs_sum_ci95: {:.3f}..{:.3f}\n", at24.census_vs_sum.low, at24.census_vs_sum.high);
  fmt::print("census_vs_isfinite: {:.2f}\n", at24.census_vs_isfinite.median);
  fmt::print("has_nonfinite_vs_sum: {:.3f}\n", at24.has_nonfinite_vs_sum.median);
  fmt::print("has_nonfinite_vs_sum_ci95: {:.3f}..{:.3f}\n", at24.has_nonfinite_vs_sum.low,
             at24.has_nonfinite_vs_sum.high);
  benchmark::Shutdown();
}
